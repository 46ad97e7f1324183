"""Tensor-parallel parameters: the slice of each weight a rank holds, and what
that slice needs after backward.

Every parameter of a tensor-parallel chunk carries a :class:`TPShard` mark
(``param.tp_shard``), set when it was cut (:func:`shard_parameter`, or the
linears built from it) or declared whole on every rank
(:func:`mark_replicated`). Whatever must treat a slice differently from a
whole tensor reads that mark, never the parameter's name:

* the global gradient norm counts every element once (:func:`tp_sq_norm_share`);
* checkpoints gather and cut whole tensors (:mod:`hetpipe.checkpoint.tp_slices`);
* after backward, :func:`finalize_tensor_parallel_grads` completes two kinds of
  partial gradient: replicated weights that saw only this rank's part of
  the work (the norms under sequence parallelism, which see this rank's
  tokens; per-head norms such as Qwen3's QK-norm, which see its heads) and
  key/value heads replicated over several ranks (each replica computed only
  its own query heads' part).

Which rows or columns a model's weight splits into is the model's knowledge
(:mod:`hetpipe.models.parallelize`); a :class:`ShardRule` only carries it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from hetpipe.parallel.tp_collectives import TPGroup


@dataclass(frozen=True)
class ShardRule:
    """Rank r owns ``full.index_select(dim, index(r))`` of a tensor whose
    unsharded size along ``dim`` is ``full_size``; ``kv_replicas`` > 1 when
    some rows are held alike by that many ranks (replicated KV heads)."""
    dim: int
    full_size: int
    index: Callable[[int], torch.Tensor]
    kv_replicas: int = 1


@dataclass(frozen=True)
class ReplicatedKV:
    """Rows [start, stop) of this rank's shard are KV head ``head`` of
    ``heads``, which every rank of its replica set holds alike."""
    start: int
    stop: int
    head: int
    heads: int


@dataclass(frozen=True)
class TPShard:
    """What a parameter is on this TP rank.

    ``rule`` None: the whole tensor, the same on every rank. ``partial_grad``:
    whole, but its gradient covers only this rank's tokens or heads (needs the TP sum).
    ``replicated_kv``: the rows of a KV head this rank shares with others.
    """
    tp: TPGroup
    rule: Optional[ShardRule] = None
    partial_grad: bool = False
    replicated_kv: Optional[ReplicatedKV] = None


def tp_shard(param: torch.Tensor) -> TPShard:
    """``param``'s mark; a ValueError when it never went through a TP plan."""
    shard = getattr(param, "tp_shard", None)
    if shard is None:
        raise ValueError("this parameter has not been through parallelize_tensor()")
    return shard


def tp_param_spec(param: torch.Tensor) -> Optional[int]:
    """The dim along which ``param`` is split over the TP group, or None when
    every TP rank holds the whole (replicated) tensor."""
    shard = getattr(param, "tp_shard", None)
    return shard.rule.dim if shard is not None and shard.rule is not None else None


def shard_parameter(param: nn.Parameter, rule: ShardRule, tp: TPGroup,
                    replicated_kv: Optional[ReplicatedKV] = None) -> nn.Parameter:
    """A new parameter holding this rank's slice of ``param`` under ``rule``, marked."""
    with torch.no_grad():
        local = param.index_select(rule.dim, rule.index(tp.rank).to(param.device))
    new = nn.Parameter(local, requires_grad=param.requires_grad)
    new.tp_shard = TPShard(tp, rule, replicated_kv=replicated_kv)
    return new


def mark_replicated(param: nn.Parameter, tp: TPGroup, partial_grad: bool = False) -> None:
    """Mark ``param`` as held whole by every TP rank; ``partial_grad``: its
    module runs on this rank's part only (a norm on the sequence slice under
    SP, or on this rank's heads), so its gradient is summed over the group."""
    param.tp_shard = TPShard(tp, partial_grad=partial_grad and tp.size > 1)


def _linear(weight: nn.Parameter, bias: Optional[nn.Parameter]) -> nn.Linear:
    # Built on meta: its own initial weights are replaced at once, so they take
    # no memory and draw nothing from the RNG the rest of the run depends on.
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight = weight
    linear.bias = bias
    return linear


def column_parallel_linear(linear: nn.Linear, rule: ShardRule, tp: TPGroup,
                           replicated_kv: Optional[ReplicatedKV] = None) -> nn.Linear:
    """A new ``nn.Linear`` computing this rank's output features of ``linear``
    (its weight rows and bias entries under ``rule``). Its input must be the
    full activation on every rank, its output is this rank's part."""
    if rule.dim != 0:
        raise ValueError(f"a column-parallel linear splits its weight along dim 0, not {rule.dim}")
    bias = None if linear.bias is None else shard_parameter(linear.bias, rule, tp, replicated_kv)
    return _linear(shard_parameter(linear.weight, rule, tp, replicated_kv), bias)


def row_parallel_linear(linear: nn.Linear, rule: ShardRule, tp: TPGroup) -> nn.Linear:
    """A new ``nn.Linear`` over this rank's input features of ``linear`` (its
    weight columns under ``rule``): the ranks' outputs are partial sums."""
    if rule.dim != 1:
        raise ValueError(f"a row-parallel linear splits its weight along dim 1, not {rule.dim}")
    if linear.bias is not None:
        raise ValueError("a row-parallel linear cannot hold a bias: every rank would add it to the sum")
    return _linear(shard_parameter(linear.weight, rule, tp), None)


def tp_sq_norm_share(param: torch.Tensor, tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's share of the squared L2 norm of the *unsharded* ``tensor``
    (default: ``param.grad``), such that the sum of the shares over the TP
    group is exactly the full tensor's squared norm.

    Sharded elements count on the rank that holds them; replicated tensors
    count on TP rank 0 only; replicated KV rows count on the first rank of
    their replicas. Assumes the gradients were finalised
    (:func:`finalize_tensor_parallel_grads`) so replicas agree.
    """
    t = param.grad if tensor is None else tensor
    if t is None:
        return torch.zeros((), dtype=torch.float32, device=param.device)
    t = t.float()
    shard = tp_shard(param)
    if shard.rule is None:
        return t.pow(2).sum() if shard.tp.rank == 0 else t.new_zeros(())
    if shard.replicated_kv is not None:
        kv = shard.replicated_kv
        share = t[:kv.start].pow(2).sum()
        if shard.tp.rank % shard.rule.kv_replicas == 0:
            share = share + t[kv.start:kv.stop].pow(2).sum()
        return share
    return t.pow(2).sum()


# --------------------------------------------------------------------------
# Post-backward gradient reductions
# --------------------------------------------------------------------------

def allreduce_partial_grads(module: nn.Module) -> None:
    """Sum over the TP group the gradients of the whole weights that saw only
    this rank's part (the norms under SP, per-head norms). A no-op without them."""
    params = [p for p in module.parameters()
              if getattr(p, "tp_shard", None) is not None and p.tp_shard.partial_grad and p.grad is not None]
    if not params:
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=params[0].tp_shard.tp.group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def allreduce_replicated_kv_grads(module: nn.Module) -> None:
    """Sum the k/v gradient rows of each replicated KV head over its replicas.

    When tp > num_query_groups every KV head lives on tp/groups ranks, each of
    which computed only its query heads' part of the head's gradient. Each
    rank writes its rows into a zeroed [heads, ...] buffer at its head's
    slot; one all-reduce over the TP group then gives every replica the sum.
    A no-op when no KV head is replicated.
    """
    params = [p for p in module.parameters()
              if getattr(p, "tp_shard", None) is not None and p.tp_shard.replicated_kv is not None
              and p.grad is not None]
    if not params:
        return
    kv = params[0].tp_shard.replicated_kv
    rows = [p.grad[p.tp_shard.replicated_kv.start: p.tp_shard.replicated_kv.stop] for p in params]
    width = sum(g.numel() for g in rows)
    buf = rows[0].new_zeros((kv.heads, width))
    buf[kv.head] = torch.cat([g.reshape(-1) for g in rows])
    dist.all_reduce(buf, group=params[0].tp_shard.tp.group)
    offset = 0
    for g in rows:
        g.copy_(buf[kv.head, offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def finalize_tensor_parallel_grads(module: nn.Module) -> None:
    """Every post-backward TP reduction ``module`` needs (call once per step,
    after the last micro-batch's backward and before clipping / the optimizer)."""
    allreduce_partial_grads(module)
    allreduce_replicated_kv_grads(module)
