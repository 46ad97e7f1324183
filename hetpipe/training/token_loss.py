"""The training loss as the mean over the global batch's tokens, when labels are masked.

Each microbatch's loss is the mean over its own counted tokens (labels other
than the ignore index). Averaging those means over the microbatches (what the
step did before labels could be masked, and Megatron's default) weighs a token
of a microbatch with few counted tokens more than one of a microbatch with
many. With ``data.eod_mask_loss`` the counts differ, so the step's loss is
instead Megatron's per-token loss (``--calculate-per-token-loss``): the sum of
every counted token's loss over the global batch (all microbatches, all DP
replicas) divided by the number of counted tokens ``N``.

The engine scales microbatch ``m``'s loss by ``1 / M`` as before and, on top,
by the weight ``w_m = n_m * M * DP / N`` (``n_m`` its counted tokens, ``M``
microbatches per DP rank). After the DP average (a division by DP) the
gradient is that of ``sum of token losses / N``, and the logged loss, the sum
of the weighted losses over DP divided by ``M * DP``, is the same mean. ``N``
is known before the schedule runs: every rank of a stage loads its whole
microbatches, labels included, so the last stage counts its own and one
all-reduce over its DP group adds the replicas' counts. TP ranks hold the same
labels and count the same.

Without ``data.eod_mask_loss`` no weights are made: no count, no collective,
and the engine's arithmetic is what it always was, bit for bit. (With it, a
global batch without a masked label has every ``w_m`` exactly 1 - integers:
``N = n * M * DP`` - and multiplying by 1 changes nothing either.)
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hetpipe.data.loader import IGNORE_INDEX
from hetpipe.parallel.group_facts import group_size_rank, is_nccl


def counted_tokens(microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """Each microbatch's labels that count toward the loss."""
    return [int((labels != IGNORE_INDEX).sum()) for _, labels in microbatches]


def token_weights(counts: Sequence[int], total: int, replicas: int = 1) -> list[float]:
    """``w_m = n_m * M * replicas / total`` for this rank's counts ``n_m`` (see
    the module docstring); NaN when no token of the global batch counts, which
    makes the step non-finite (skipped) rather than a silent zero loss."""
    if total == 0:
        return [float("nan")] * len(counts)
    slots = len(counts) * replicas
    return [n * slots / total for n in counts]


class TokenWeights:
    """One rank's per-step loss weights, its counts summed over its DP group.

    The weights are a device tensor: an NCCL group adds the counts on the
    device, and nothing waits for them on the host (the step's first backward
    reads them on the stream), so the previous step's optimizer update still
    overlaps this step's start."""

    def __init__(self, dp_group: Optional[dist.ProcessGroup], device: torch.device) -> None:
        self.group = dp_group
        self.replicas = group_size_rank(dp_group)[0] if dp_group is not None else 1
        # An NCCL group reduces device tensors only; gloo, host tensors.
        self.device = device if dp_group is not None and is_nccl(dp_group) else torch.device("cpu")

    def __call__(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        counts = torch.tensor(counted_tokens(microbatches), dtype=torch.int64).to(self.device)
        total = counts.sum()
        if self.replicas > 1:
            dist.all_reduce(total, group=self.group)
        # As token_weights, in float64 before the fp32 the losses are in (0/0: NaN).
        return (counts.double() * (len(counts) * self.replicas) / total.double()).float()


def step_weights(masks_loss: bool, holds_loss: bool, dp_group: Optional[dist.ProcessGroup],
                 device: torch.device) -> Optional[TokenWeights]:
    """The trainer's weights for this rank: only where labels can be masked and
    the rank computes the loss (the last stage); None leaves the engine's
    arithmetic as it always was."""
    return TokenWeights(dp_group, device) if masks_loss and holds_loss else None
