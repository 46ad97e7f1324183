"""Checkpoints under tensor and data parallelism: whole tensors, one writer per stage.

Checkpoints stay plan-neutral (:mod:`hetpipe.checkpoint`): every tensor is
saved whole, under its model-unit name. Under TP each rank holds a slice of a
weight and of its AdamW moments; under ZeRO-1 each DP rank holds a slice of
the moments. Before a save the stage's ranks gather the whole tensors (over
TP, then over DP for a distributed optimizer) onto the rank with DP and TP
index 0, which writes them; the other ranks write only their RNG state. On
load every rank reads whole tensors and keeps its own slice
(:func:`shard_fn`), so a checkpoint written at any TP/DP degree resumes at
any other.

The TP half of that - cutting a whole tensor to a rank's slice and gathering
the slices back - is :func:`shard_tensor` and :func:`full_tensor`. Both go by
the parameter's ``tp_shard`` mark (:mod:`hetpipe.parallel.tp_shards`), so they
work for anything shaped like the parameter: its value, its gradient, an
optimizer's moments.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from hetpipe.checkpoint.names import TIED_HEAD_COPY, canonical_name
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


def gather_for_save(chunks: Sequence[CausalLM], optimizer: torch.optim.Optimizer, writer: bool
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(model tensors, optimizer tensors) by canonical name, whole, on the
    writer; empty dicts elsewhere. A collective over the stage's TP and DP
    ranks: every one of them must call it, in the same step."""
    tp = max(getattr(chunk, "tp_size", 1) for chunk in chunks)
    model: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        state = gather_full_state_dict(chunk) if tp > 1 else chunk.state_dict()
        for name, tensor in state.items():
            if canonical_name(chunk.cfg, name) == name:
                model[name] = tensor.detach()
    # Per-parameter AdamW state by the chunks' own names.
    names = {id(p): n for chunk in chunks for n, p in chunk.named_parameters()}
    if hasattr(optimizer, "full_state_dict"):
        per_param = optimizer.full_state_dict()  # collective over DP
    else:
        per_param = {names[id(p)]: dict(optimizer.state[p])
                     for group in optimizer.param_groups for p in group["params"] if p in optimizer.state}
    params = _parameters(chunks)
    cfg = chunks[0].cfg
    optim: dict[str, torch.Tensor] = {}
    for name in sorted(per_param):  # the same order on every TP rank
        for key, value in sorted(per_param[name].items()):
            value = torch.as_tensor(value)
            if key != "step" and tp > 1:
                value = full_tensor(params[name], value)  # collective over TP
            canonical = canonical_name(cfg, name)
            if canonical == name:
                optim[f"{key}/{canonical}"] = value
    if not writer:
        return {}, {}
    return model, optim


def shard_fn(chunks: Sequence[CausalLM]) -> Optional[Callable[[str, torch.Tensor], torch.Tensor]]:
    """``(canonical name, whole tensor) -> this rank's slice`` for loading, or
    None when no chunk is tensor-parallel."""
    if max(getattr(chunk, "tp_size", 1) for chunk in chunks) == 1:
        return None
    params = _parameters(chunks)

    def shard(name: str, tensor: torch.Tensor) -> torch.Tensor:
        # A tied head copy is saved as embedding.weight; the copy is sharded
        # like the embedding (same vocab rows), so either owner can cut it.
        param = params.get(name, params.get(TIED_HEAD_COPY))
        return tensor if param is None else shard_tensor(param, tensor)

    return shard
