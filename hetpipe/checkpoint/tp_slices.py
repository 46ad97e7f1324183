"""A TP rank's slice of a whole tensor and back: how checkpoints under tensor and
data parallelism go slices in, slices out.

Checkpoints stay plan-neutral (:mod:`hetpipe.checkpoint`): every tensor is
known by its model-unit name and whole shape, and each rank saves the slice
it holds - its TP rows or columns (by the parameter's ``tp_shard`` mark),
its ZeRO-1 ranges of the AdamW moments - as pieces the manifest places in
the whole tensor; nothing is gathered to a writer. On load every rank asks
for the region it holds now (:func:`shard_fn`'s ``region``), read from
whichever pieces cover it, so a checkpoint written at any TP/DP degree
resumes at any other.

:func:`shard_tensor` and :func:`full_tensor` cut a whole tensor to a rank's
slice and gather the slices back (tests and tools use them). Both go by the
parameter's ``tp_shard`` mark (:mod:`hetpipe.parallel.tp_shards`), so they
work for anything shaped like the parameter: its value, its gradient, an
optimizer's moments.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from hetpipe.checkpoint.names import EMBEDDING, TIED_HEAD_COPY
from hetpipe.checkpoint.regions import Region, tp_region
from hetpipe.models import CausalLM
from hetpipe.parallel.tp_collectives import all_gather
from hetpipe.parallel.tp_shards import tp_shard


def shard_tensor(param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of ``full``, the unsharded value of (anything shaped
    like) ``param``. Replicated tensors come back as a copy."""
    shard = tp_shard(param)
    rule = shard.rule
    if rule is None or shard.tp.size == 1:
        return full.detach().clone()
    if full.dim() <= rule.dim or full.shape[rule.dim] != rule.full_size:
        raise ValueError(f"a tensor of shape {tuple(full.shape)} is not the unsharded shape of this parameter "
                         f"(size {rule.full_size} along dim {rule.dim})")
    return full.detach().index_select(rule.dim, rule.index(shard.tp.rank).to(full.device))


def full_tensor(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """The unsharded value of ``local``, this rank's slice of (anything shaped
    like) ``param``. A collective over the TP group: every TP rank must call
    it, for the same parameters in the same order. Replicated tensors are
    returned as they are."""
    shard = tp_shard(param)
    rule, tp = shard.rule, shard.tp
    local = local.detach()
    if rule is None or tp.size == 1:
        return local
    parts = all_gather(local.unsqueeze(0), 0, tp).unbind(0)
    shape = list(local.shape)
    shape[rule.dim] = rule.full_size
    full = local.new_empty(shape)
    # Highest rank first, so a replicated KV head keeps its first replica's value.
    for r in reversed(range(tp.size)):
        full.index_copy_(rule.dim, rule.index(r).to(full.device), parts[r])
    return full


def gather_full_state_dict(chunk: nn.Module) -> dict[str, torch.Tensor]:
    """The chunk's state dict with every tensor unsharded (collective over TP):
    exactly what the same chunk would hold without tensor parallelism."""
    params = dict(chunk.named_parameters())
    return {name: full_tensor(params[name], value) if name in params else value.detach()
            for name, value in chunk.state_dict().items()}


def shard_full_state_dict(chunk: nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`gather_full_state_dict`: this rank's slice of
    each tensor of an unsharded state dict, ready for ``load_state_dict``."""
    params = dict(chunk.named_parameters())
    return {name: shard_tensor(params[name], value) if name in params else value.detach().clone()
            for name, value in full.items()}


def _parameters(chunks: Sequence[CausalLM]) -> dict[str, nn.Parameter]:
    return {name: param for chunk in chunks for name, param in chunk.named_parameters()}


class _Shard:
    """``(canonical name, whole tensor) -> this rank's slice``, and ``region(name)``: which
    slice that is, so a loader can read just it from the checkpoint's pieces."""

    def __init__(self, chunks: Sequence[CausalLM]) -> None:
        self.params = _parameters(chunks)

    def _param(self, name: str) -> Optional[nn.Parameter]:
        # A tied head copy is saved as embedding.weight; the copy is sharded
        # like the embedding (same vocab rows), so either owner can cut it.
        return self.params.get(name, self.params.get(TIED_HEAD_COPY) if name == EMBEDDING else None)

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        param = self._param(name)
        return tensor if param is None else shard_tensor(param, tensor)

    def region(self, name: str) -> Region:
        return tp_region(self._param(name))


def shard_fn(chunks: Sequence[CausalLM]) -> Optional[Callable[[str, torch.Tensor], torch.Tensor]]:
    """``(canonical name, whole tensor) -> this rank's slice`` for loading (with
    ``.region(name)``), or None when no chunk is tensor-parallel."""
    if max(getattr(chunk, "tp_size", 1) for chunk in chunks) == 1:
        return None
    return _Shard(chunks)
