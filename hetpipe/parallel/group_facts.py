"""Facts about a process group that the tensor- and data-parallel code share
(the groups themselves are made by hetpipe.training.topology): a group's size and rank
even without torch.distributed (a one-process run, a
unit test), whether it is NCCL, and the single-tensor collectives under the
name each torch version gives them."""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

# Newer torch renames the single-tensor collectives; both spellings take (out, in, group=).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size_rank(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """(size, this rank's index) of ``group``; (1, 0) without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def is_nccl(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether ``group`` runs on NCCL (RCCL on ROCm); False without torch.distributed."""
    try:
        return dist.get_backend(group) == "nccl"
    except (RuntimeError, ValueError):
        return False
