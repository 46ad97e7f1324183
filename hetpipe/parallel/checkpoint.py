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
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from hetpipe.checkpoint.names import canonical_name
from hetpipe.models import CausalLM


def _owner(chunks: Sequence[CausalLM]) -> dict[str, CausalLM]:
    return {name: chunk for chunk in chunks for name, _ in chunk.named_parameters()}


def gather_for_save(chunks: Sequence[CausalLM], optimizer: torch.optim.Optimizer, writer: bool
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(model tensors, optimizer tensors) by canonical name, whole, on the
    writer; empty dicts elsewhere. A collective over the stage's TP and DP
    ranks: every one of them must call it, in the same step."""
    from hetpipe.parallel.tensor import full_tensor, gather_full_state_dict

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
    owner = _owner(chunks)
    optim: dict[str, torch.Tensor] = {}
    for name in sorted(per_param):  # the same order on every TP rank
        chunk = owner[name]
        for key, value in sorted(per_param[name].items()):
            value = torch.as_tensor(value)
            if key != "step" and tp > 1:
                value = full_tensor(chunk, name, value)  # collective over TP
            canonical = canonical_name(chunk.cfg, name)
            if canonical == name:
                optim[f"{key}/{canonical}"] = value
    if not writer:
        return {}, {}
    return model, optim


def shard_fn(chunks: Sequence[CausalLM]) -> Optional[Callable[[str, torch.Tensor], torch.Tensor]]:
    """``(canonical name, whole tensor) -> this rank's slice`` for loading, or
    None when no chunk is tensor-parallel."""
    from hetpipe.parallel.tensor import shard_tensor

    if max(getattr(chunk, "tp_size", 1) for chunk in chunks) == 1:
        return None
    owner = _owner(chunks)

    def shard(name: str, tensor: torch.Tensor) -> torch.Tensor:
        # A tied head copy is saved as embedding.weight; the copy is sharded
        # like the embedding (same vocab rows), so either owner can cut it.
        chunk = owner.get(name) or owner.get("head.output.weight")
        if chunk is None:
            return tensor
        return shard_tensor(chunk, name if name in owner else "head.output.weight", tensor)

    return shard
