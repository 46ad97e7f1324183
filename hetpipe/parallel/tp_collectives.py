"""The communication of tensor (and sequence) parallelism: collectives along one
dimension and Megatron's autograd mappings between the parallel regions.

Tensor parallelism (TP; Shoeybi et al., 2019, "Megatron-LM", arXiv:1909.08053)
splits a stage's large matrices over the ranks of a TP group. Two conjugate
autograd functions stitch the split regions to the replicated ones: "copy to
the TP region" (identity forward, all-reduce backward, Megatron's *f*) in front
of every column-parallel linear and "reduce from the TP region" (all-reduce
forward, identity backward, Megatron's *g*) behind every row-parallel one. One
forward + backward of a decoder layer then costs two all-reduces forward and
two backward.

Sequence parallelism (SP; Korthikanti et al., 2022, arXiv:2205.05198) also
splits the activations *between* those regions (norms, residual stream) along
the sequence: *f* becomes an all-gather forward / reduce-scatter backward and
*g* a reduce-scatter forward / all-gather backward. The communication volume
stays the same; the norm and residual activations shrink by ``tp``.

The vocab-parallel cross-entropy is here too: it is the same kind of thing, a
loss whose forward and backward are a few all-reduces over [tokens] vectors.

Nothing here knows the model's layout: :mod:`hetpipe.models.tp_modules`
places these functions, and :mod:`hetpipe.checkpoint.tp_slices` gathers
shards with :func:`all_gather`. They run on gloo (CPU tests) and NCCL/RCCL
alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from hetpipe.errors import ConfigError
from hetpipe.parallel.group_facts import all_gather_single, reduce_scatter_single

SEQ_DIM = 1  # activations are [batch, seq, hidden]


@dataclass(frozen=True)
class TPGroup:
    """What every TP collective needs: the group, its size, this rank's index,
    whether SP is on, and whether the group is gloo (list-based collectives)."""
    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    sequence_parallel: bool
    gloo: bool


def tp_group(group: Optional[dist.ProcessGroup], size: int, rank: int, sequence_parallel: bool) -> TPGroup:
    """The :class:`TPGroup` of ``group`` (None: the default group); SP only
    means something with more than one rank."""
    gloo = size > 1 and dist.get_backend(group) == dist.Backend.GLOO
    return TPGroup(group, size, rank, sequence_parallel and size > 1, gloo)


def all_reduce(x: torch.Tensor, tp: TPGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """The sum (or ``op``) of ``x`` over the group, out of place: the input may
    be a gradient that autograd also hands to another branch."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=tp.group)
    return out


def split(x: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
    """This rank's 1/tp slice of ``x`` along ``dim``."""
    size = x.shape[dim]
    if size % tp.size:
        raise ConfigError(
            f"a dimension of size {size} cannot be split evenly over {tp.size} tensor-parallel ranks"
            + (" (with sequence parallelism the sequence length must be a multiple of the TP size)"
               if tp.sequence_parallel else ""))
    part = size // tp.size
    return x.narrow(dim, tp.rank * part, part).contiguous()


def _list_collectives(x: torch.Tensor, tp: TPGroup) -> bool:
    """gloo (or any CPU tensor) takes the list-based collectives every torch
    version has; the single-tensor ones are the fast path on GPUs."""
    return tp.gloo or x.device.type == "cpu"


def all_gather(x: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order."""
    lead = x.movedim(dim, 0).contiguous()
    if _list_collectives(lead, tp):
        parts = [torch.empty_like(lead) for _ in range(tp.size)]
        dist.all_gather(parts, lead, group=tp.group)
        out = torch.cat(parts, 0)
    else:
        out = lead.new_empty((tp.size * lead.shape[0],) + tuple(lead.shape[1:]))
        all_gather_single(out, lead, group=tp.group)
    return out.movedim(0, dim).contiguous()


def reduce_scatter(x: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
    """``x`` summed over the group, keeping this rank's 1/tp slice along ``dim``."""
    if x.shape[dim] % tp.size:
        return split(x, dim, tp)  # raises the explanatory error
    lead = x.movedim(dim, 0).clone(memory_format=torch.contiguous_format)
    part = lead.shape[0] // tp.size
    if _list_collectives(lead, tp):
        # gloo has no reduce-scatter in older torch; an all-reduce is the same math.
        dist.all_reduce(lead, group=tp.group)
        out = lead.narrow(0, tp.rank * part, part)
    else:
        out = lead.new_empty((part,) + tuple(lead.shape[1:]))
        reduce_scatter_single(out, lead, group=tp.group)
    return out.movedim(0, dim).contiguous()


# --------------------------------------------------------------------------
# The autograd mappings
# --------------------------------------------------------------------------

class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.tp), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """All-reduce forward; identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, tp):
        return all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's sequence slice forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, tp):
        ctx.dim, ctx.tp = dim, tp
        return split(x, dim, tp)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.tp), None, None


class _GatherFromParallelRegion(torch.autograd.Function):
    """All-gather along ``dim`` forward. Backward either reduce-scatters the
    gradient (it is a partial sum, as in front of a column-parallel linear) or
    just keeps this rank's slice (it is already complete and replicated)."""

    @staticmethod
    def forward(ctx, x, dim, tp, grad_is_partial):
        ctx.dim, ctx.tp, ctx.grad_is_partial = dim, tp, grad_is_partial
        return all_gather(x, dim, tp)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return reduce_scatter(grad, ctx.dim, ctx.tp), None, None, None
        return split(grad, ctx.dim, ctx.tp), None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, dim, tp):
        ctx.dim, ctx.tp = dim, tp
        return reduce_scatter(x, dim, tp)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.tp), None, None


def enter_column_parallel(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """In front of a column-parallel linear: its input must be the full sequence
    on every rank, and its input gradient is a partial sum over the ranks."""
    if tp.sequence_parallel:
        return _GatherFromParallelRegion.apply(x, SEQ_DIM, tp, True)
    return _CopyToTensorParallelRegion.apply(x, tp)


def leave_row_parallel(y: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Behind a row-parallel linear (or the vocab-parallel embedding): each rank
    holds a partial sum that must be added up (and, with SP, scattered)."""
    if tp.sequence_parallel:
        return _ReduceScatterToSequenceParallelRegion.apply(y, SEQ_DIM, tp)
    return _ReduceFromTensorParallelRegion.apply(y, tp)


def scatter_to_sequence_parallel(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """A full, replicated [b, s, h] activation -> this rank's [b, s/tp, h] slice."""
    return _ScatterToSequenceParallelRegion.apply(x, SEQ_DIM, tp)


def gather_replicated(x: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
    """Every rank's slice of ``x`` along ``dim`` gathered, for a consumer whose
    gradient is complete and the same on every rank (a stage boundary, logits)."""
    return _GatherFromParallelRegion.apply(x, dim, tp, False)


# --------------------------------------------------------------------------
# Vocab-parallel cross-entropy
# --------------------------------------------------------------------------

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split by vocabulary over the TP group.

    The math of Megatron's ``_VocabParallelCrossEntropy``: the global max, the
    global sum of exponentials and the target's logit are each one all-reduce
    of a [tokens] vector, so the [tokens, vocab] logits are never gathered.
    The gradient is ``softmax - onehot(target)`` on this rank's vocab slice.
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_start, tp):
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = logits - logits_max.unsqueeze(-1)
        vocab_end = vocab_start + logits.shape[-1]
        not_mine = (target < vocab_start) | (target >= vocab_end)
        local_target = (target - vocab_start).masked_fill(not_mine, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(not_mine, 0.0)
        exp = shifted.exp()
        stats = torch.stack((target_logit, exp.sum(dim=-1)))
        dist.all_reduce(stats, group=tp.group)  # one collective for both sums
        target_logit, sum_exp = stats[0], stats[1]
        loss = sum_exp.log() - target_logit
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, not_mine, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, not_mine, local_target = ctx.saved_tensors
        onehot = (~not_mine).to(softmax.dtype).unsqueeze(-1)
        grad = softmax.scatter_add(-1, local_target.unsqueeze(-1), -onehot)
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                                 tp: TPGroup, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy (fp32) of [tokens, vocab/tp] logits against [tokens]
    labels, like ``F.cross_entropy(..., reduction="mean")`` with the same
    ``ignore_index`` default (labels equal to it add nothing to the loss or
    the count)."""
    per_token = _VocabParallelCrossEntropy.apply(local_logits.float(), labels, vocab_start, tp)
    valid = labels != ignore_index
    return per_token.masked_fill(~valid, 0.0).sum() / valid.sum()
