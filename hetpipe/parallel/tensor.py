"""Megatron-style tensor parallelism (and sequence parallelism) as a parallelize step.

Tensor parallelism (TP) splits every large matrix of a pipeline stage across
the ``tp_size`` ranks of a TP group, following Megatron-LM (Shoeybi et al.,
2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism", arXiv:1909.08053):

* attention: the fused q/k/v projection is split by output rows (a
  column-parallel linear) so that each rank owns whole heads - ``heads / tp``
  query heads and the key/value heads those query heads read; the output
  projection is split by input columns (row-parallel) and its partial results
  are summed over the group;
* MLP: the fused gate/up projection is column-parallel (each rank owns its
  slice of the gate rows *and* its slice of the up rows, still stored as
  ``[gate | up]``), the down projection row-parallel;
* the token embedding and the output head are split by vocabulary rows; the
  loss is computed without ever gathering the logits (Megatron's vocab-parallel
  cross-entropy).

Two conjugate autograd functions stitch the regions together: "copy to the TP
region" (identity forward, all-reduce backward) in front of every
column-parallel linear and "reduce from the TP region" (all-reduce forward,
identity backward) behind every row-parallel one. One forward + backward of a
decoder layer then costs two all-reduces forward and two backward.

Sequence parallelism (SP; Korthikanti et al., 2022, "Reducing Activation
Recomputation in Large Transformer Models", arXiv:2205.05198) additionally
splits the activations *between* the TP regions (the norms and the residual
stream) along the sequence: each all-reduce becomes an all-gather in front of
the column-parallel linear and a reduce-scatter behind the row-parallel one.
Communication volume stays the same; the norm/residual activations shrink by
``tp``. Norm weights then see only their rank's tokens, so their gradients must
be summed over the TP group after backward
(:func:`allreduce_sequence_parallel_grads`).

Nothing here edits :mod:`hetpipe.models`: :func:`parallelize_tensor` slices the
parameters of a chunk built with full weights (so every TP rank starts from
exactly the single-process initialisation), keeps the parameter *names* (so
checkpoints stay keyed by model unit), and swaps the classes of the affected
modules for TP subclasses whose ``forward`` adds the communication. A chunk's
inputs and outputs keep the single-process shapes - full sequence, full
hidden size, identical on every TP rank - so the pipeline engine does not
change.

Grouped-query attention with fewer key/value heads than TP ranks replicates
each KV head on ``tp / num_query_groups`` consecutive ranks (each rank keeps
the one its query heads read). The replicas' gradients are partial sums and
must be added up after backward (:func:`allreduce_replicated_kv_grads`);
:func:`finalize_tensor_parallel_grads` does both post-backward reductions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetpipe.errors import ConfigError
from hetpipe.models.model_config import ModelConfig
from hetpipe.models.layers import Attention, RMSNorm, SwiGLU
from hetpipe.models.transformer import CausalLM, Embedding, Head, rope_cos_sin

__all__ = [
    "check_tensor_parallel", "parallelize_tensor", "tp_param_spec", "tp_sq_norm_share",
    "allreduce_sequence_parallel_grads", "allreduce_replicated_kv_grads", "finalize_tensor_parallel_grads",
    "shard_tensor", "full_tensor", "gather_full_state_dict", "shard_full_state_dict",
]

# F.cross_entropy's default: labels equal to it add nothing to the loss or the count.
IGNORE_INDEX = -100


# --------------------------------------------------------------------------
# Configuration checks
# --------------------------------------------------------------------------

def check_tensor_parallel(cfg: ModelConfig, tp_size: int) -> None:
    """Raise :class:`ConfigError` unless ``cfg`` can be split over ``tp_size`` ranks."""
    if tp_size < 1:
        raise ConfigError(f"tensor-parallel size {tp_size} must be at least 1")
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups
    if heads % tp_size:
        raise ConfigError(
            f"model.num_attention_heads={heads} is not divisible by the tensor-parallel size "
            f"{tp_size}; every TP rank must own the same number of whole query heads")
    if groups % tp_size and tp_size % groups:
        raise ConfigError(
            f"model.num_query_groups={groups} and the tensor-parallel size {tp_size} must divide "
            f"one another (each rank owns num_query_groups/tp KV heads, or each KV head is "
            f"replicated on tp/num_query_groups ranks)")
    if cfg.ffn_hidden_size % tp_size:
        raise ConfigError(
            f"model.ffn_hidden_size={cfg.ffn_hidden_size} is not divisible by the tensor-parallel "
            f"size {tp_size}")
    if cfg.vocab_size % tp_size:
        raise ConfigError(
            f"model.vocab_size={cfg.vocab_size} is not divisible by the tensor-parallel size "
            f"{tp_size}; pad the vocabulary to a multiple of it")


# --------------------------------------------------------------------------
# Collectives along one dimension (gloo on CPU, nccl/rccl on GPUs)
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class _TPContext:
    """What the communication of one TP chunk needs: its group, size and rank."""
    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    sequence_parallel: bool
    gloo: bool


# Newer torch renames the single-tensor collectives; both spellings take (out, in, group=).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_reduce(x: torch.Tensor, tp: _TPContext, op=dist.ReduceOp.SUM) -> torch.Tensor:
    # Out of place: the input may be a gradient autograd hands to another branch too.
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=tp.group)
    return out


def _split(x: torch.Tensor, dim: int, tp: _TPContext) -> torch.Tensor:
    """This rank's 1/tp slice of ``x`` along ``dim``."""
    size = x.shape[dim]
    if size % tp.size:
        raise ConfigError(
            f"a dimension of size {size} cannot be split evenly over {tp.size} tensor-parallel ranks"
            + (" (with sequence parallelism the sequence length must be a multiple of the TP size)"
               if tp.sequence_parallel else ""))
    part = size // tp.size
    return x.narrow(dim, tp.rank * part, part).contiguous()


def _list_collectives(x: torch.Tensor, tp: _TPContext) -> bool:
    """gloo (or any CPU tensor) takes the list-based collectives every torch
    version has; the single-tensor ones are the fast path on GPUs."""
    return tp.gloo or x.device.type == "cpu"


def _all_gather(x: torch.Tensor, dim: int, tp: _TPContext) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order."""
    lead = x.movedim(dim, 0).contiguous()
    if _list_collectives(lead, tp):
        parts = [torch.empty_like(lead) for _ in range(tp.size)]
        dist.all_gather(parts, lead, group=tp.group)
        out = torch.cat(parts, 0)
    else:
        out = lead.new_empty((tp.size * lead.shape[0],) + tuple(lead.shape[1:]))
        _all_gather_single(out, lead, group=tp.group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, tp: _TPContext) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's 1/tp slice along ``dim``."""
    if x.shape[dim] % tp.size:
        return _split(x, dim, tp)  # raises the explanatory error
    lead = x.movedim(dim, 0).clone(memory_format=torch.contiguous_format)
    part = lead.shape[0] // tp.size
    if _list_collectives(lead, tp):
        # gloo has no reduce-scatter in older torch; an all-reduce is the same math.
        dist.all_reduce(lead, group=tp.group)
        out = lead.narrow(0, tp.rank * part, part)
    else:
        out = lead.new_empty((part,) + tuple(lead.shape[1:]))
        _reduce_scatter_single(out, lead, group=tp.group)
    return out.movedim(0, dim).contiguous()


# --------------------------------------------------------------------------
# The conjugate autograd functions (Megatron's mappings)
# --------------------------------------------------------------------------

class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.tp), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """All-reduce forward; identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, tp):
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's sequence slice forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, tp):
        ctx.dim, ctx.tp = dim, tp
        return _split(x, dim, tp)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.tp), None, None


class _GatherFromParallelRegion(torch.autograd.Function):
    """All-gather along ``dim`` forward. Backward either reduce-scatters the
    gradient (it is a partial sum, as in front of a column-parallel linear) or
    just keeps this rank's slice (it is already complete and replicated)."""

    @staticmethod
    def forward(ctx, x, dim, tp, grad_is_partial):
        ctx.dim, ctx.tp, ctx.grad_is_partial = dim, tp, grad_is_partial
        return _all_gather(x, dim, tp)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return _reduce_scatter(grad, ctx.dim, ctx.tp), None, None, None
        return _split(grad, ctx.dim, ctx.tp), None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, dim, tp):
        ctx.dim, ctx.tp = dim, tp
        return _reduce_scatter(x, dim, tp)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.tp), None, None


SEQ_DIM = 1  # activations are [batch, seq, hidden]


def _enter_column_parallel(x: torch.Tensor, tp: _TPContext) -> torch.Tensor:
    """In front of a column-parallel linear: its input must be the full sequence
    on every rank, and its input gradient is a partial sum over the ranks."""
    if tp.sequence_parallel:
        return _GatherFromParallelRegion.apply(x, SEQ_DIM, tp, True)
    return _CopyToTensorParallelRegion.apply(x, tp)


def _leave_row_parallel(y: torch.Tensor, tp: _TPContext) -> torch.Tensor:
    """Behind a row-parallel linear (or the vocab-parallel embedding): each rank
    holds a partial sum that must be added up (and, with SP, scattered)."""
    if tp.sequence_parallel:
        return _ReduceScatterToSequenceParallelRegion.apply(y, SEQ_DIM, tp)
    return _ReduceFromTensorParallelRegion.apply(y, tp)


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
                                 tp: _TPContext) -> torch.Tensor:
    """Mean cross-entropy (fp32) of [tokens, vocab/tp] logits against [tokens]
    labels, like ``F.cross_entropy(..., reduction="mean")`` including its
    ``ignore_index=-100``."""
    per_token = _VocabParallelCrossEntropy.apply(local_logits.float(), labels, vocab_start, tp)
    valid = labels != IGNORE_INDEX
    return per_token.masked_fill(~valid, 0.0).sum() / valid.sum()


# --------------------------------------------------------------------------
# TP versions of the model's modules (class swaps: same parameters, new forward)
# --------------------------------------------------------------------------

class TensorParallelAttention(Attention):
    """Attention over this rank's heads; qkv column-parallel, out row-parallel."""

    _tp: _TPContext

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = _enter_column_parallel(x, self._tp)
        return _leave_row_parallel(super().forward(x, cos, sin), self._tp)


class TensorParallelSwiGLU(SwiGLU):
    """SwiGLU over this rank's slice of the intermediate size."""

    _tp: _TPContext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _enter_column_parallel(x, self._tp)
        return _leave_row_parallel(super().forward(x), self._tp)


class VocabParallelEmbedding(Embedding):
    """Embedding rows [vocab_start, vocab_end) of the vocabulary on this rank.

    Tokens outside the range look up row 0 and are zeroed; the sum over the
    group is then the full lookup (scattered along the sequence with SP).
    """

    _tp: _TPContext
    vocab_start: int
    vocab_end: int

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        not_mine = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(not_mine, 0)
        out = F.embedding(local, self.weight).masked_fill(not_mine.unsqueeze(-1), 0.0)
        return _leave_row_parallel(out, self._tp)


class VocabParallelHead(Head):
    """Final norm, output projection onto this rank's vocab rows, and the
    vocab-parallel loss.

    ``x`` is in the chunk's activation layout: [b, s, h] without sequence
    parallelism, this rank's [b, s/tp, h] slice with it (the norm runs on the
    slice, then the sequence is gathered in front of the projection).
    """

    _tp: _TPContext
    vocab_start: int

    def _local_logits(self, x: torch.Tensor) -> torch.Tensor:
        h = _enter_column_parallel(self.norm(x), self._tp)
        return F.linear(h, self.output_weight)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The full [b, s, vocab] logits on every rank (for evaluation)."""
        return _GatherFromParallelRegion.apply(self._local_logits(x), -1, self._tp, False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over all positions, computed in fp32."""
        logits = self._local_logits(x)
        return vocab_parallel_cross_entropy(
            logits.flatten(0, 1), labels.flatten(), self.vocab_start, self._tp)


class TensorParallelCausalLM(CausalLM):
    """A chunk whose units run tensor-parallel; same inputs and outputs as before.

    With sequence parallelism the activations inside the chunk are this rank's
    sequence slice: the embedding reduce-scatters into it, a chunk without the
    embedding scatters its input, and a chunk without the head gathers the
    sequence again before returning, so stage boundaries carry full [b, s, h].
    """

    tp_size: int
    tp_rank: int
    tp_group: Optional[dist.ProcessGroup]
    tp_sequence_parallel: bool
    _tp: _TPContext

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        tp = self._tp
        seq_length = inputs.shape[1]
        if tp.sequence_parallel and seq_length % tp.size:
            raise ConfigError(
                f"sequence length {seq_length} is not divisible by the tensor-parallel size {tp.size}; "
                f"sequence parallelism splits the sequence evenly over the TP ranks")
        if self.embedding is not None:
            x = self.embedding(inputs)
        elif tp.sequence_parallel:
            x = _ScatterToSequenceParallelRegion.apply(inputs, SEQ_DIM, tp)
        else:
            x = inputs
        if self.layers:
            # RoPE tables cover the whole sequence: attention sees it gathered.
            cos, sin = rope_cos_sin(self.inv_freq, seq_length, x.dtype)
            for layer in self.layers.values():
                x = layer(x, cos, sin)
        if self.head is None:
            if tp.sequence_parallel:
                # The next stage's gradient is full and identical on every TP rank.
                x = _GatherFromParallelRegion.apply(x, SEQ_DIM, tp, False)
            return x
        return self.head(x, labels) if labels is not None else self.head.logits(x)


# --------------------------------------------------------------------------
# Which rows / columns of each parameter a rank owns
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class _ShardRule:
    """Rank r owns ``full.index_select(dim, index(r))`` of a parameter whose
    unsharded size along ``dim`` is ``full_size``; ``kv_replicas`` > 1 when
    rows are duplicated over that many ranks (replicated KV heads)."""
    dim: int
    full_size: int
    index: Callable[[int], torch.Tensor]
    kv_replicas: int = 1


def _arange(start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop, dtype=torch.int64)


def _kv_heads(cfg: ModelConfig, tp_size: int, rank: int) -> list[int]:
    """The key/value heads rank ``rank`` uses (replicated when tp > groups)."""
    groups = cfg.num_query_groups
    if groups >= tp_size:
        per = groups // tp_size
        return list(range(rank * per, (rank + 1) * per))
    return [rank * groups // tp_size]


def _qkv_rows(cfg: ModelConfig, tp_size: int, rank: int) -> torch.Tensor:
    d, heads, groups = cfg.head_dim, cfg.num_attention_heads, cfg.num_query_groups
    q_per = heads // tp_size
    q = _arange(rank * q_per * d, (rank + 1) * q_per * d)
    k_base, v_base = heads * d, (heads + groups) * d
    kv = _kv_heads(cfg, tp_size, rank)
    k = torch.cat([_arange(k_base + g * d, k_base + (g + 1) * d) for g in kv])
    v = torch.cat([_arange(v_base + g * d, v_base + (g + 1) * d) for g in kv])
    return torch.cat((q, k, v))


def _shard_rule(cfg: ModelConfig, tp_size: int, name: str) -> Optional[_ShardRule]:
    """How the parameter called ``name`` is split; None when replicated."""
    t = tp_size
    vocab, ffn = cfg.vocab_size, cfg.ffn_hidden_size
    q_size = cfg.num_attention_heads * cfg.head_dim
    if name in ("embedding.weight", "head.output.weight"):
        return _ShardRule(0, vocab, lambda r: _arange(r * vocab // t, (r + 1) * vocab // t))
    if name.endswith((".attention.qkv.weight", ".attention.qkv.bias")):
        replicas = max(1, t // cfg.num_query_groups)
        full = q_size + 2 * cfg.num_query_groups * cfg.head_dim
        return _ShardRule(0, full, lambda r: _qkv_rows(cfg, t, r), replicas)
    if name.endswith(".attention.out.weight"):
        return _ShardRule(1, q_size, lambda r: _arange(r * q_size // t, (r + 1) * q_size // t))
    if name.endswith(".mlp.gate_up.weight"):
        per = ffn // t
        return _ShardRule(0, 2 * ffn, lambda r: torch.cat(
            (_arange(r * per, (r + 1) * per), _arange(ffn + r * per, ffn + (r + 1) * per))))
    if name.endswith(".mlp.down.weight"):
        return _ShardRule(1, ffn, lambda r: _arange(r * ffn // t, (r + 1) * ffn // t))
    return None


def _chunk_tp(chunk: CausalLM) -> tuple[int, int, Optional[dist.ProcessGroup]]:
    size = getattr(chunk, "tp_size", None)
    if size is None:
        raise ValueError("this chunk has not been through parallelize_tensor()")
    return size, chunk.tp_rank, chunk.tp_group


# --------------------------------------------------------------------------
# The parallelize step
# --------------------------------------------------------------------------

def _mark(param: nn.Parameter, rule: Optional[_ShardRule], tp_rank: int, sequence_parallel: bool,
          kv_rows: Optional[tuple[int, int]] = None) -> None:
    param.tp_shard_dim = rule.dim if rule is not None else None
    param.tp_replicated_kv = rule.kv_replicas if rule is not None else 1
    param.sequence_parallel = sequence_parallel
    # Private: what tp_sq_norm_share needs to count each element once.
    param._tp_rank = tp_rank
    param._tp_kv_rows = kv_rows


def parallelize_tensor(chunk: CausalLM, group: Optional[dist.ProcessGroup], tp_size: int, tp_rank: int,
                       sequence_parallel: bool = False) -> CausalLM:
    """Turn a chunk built with full weights into this rank's tensor-parallel shard, in place.

    ``group`` is the TP process group (``None`` means the default group) of
    which this process is rank ``tp_rank`` of ``tp_size``. Call it right after
    ``build_model`` (on any device) and before creating the optimizer: the
    sharded parameters are new ``nn.Parameter`` objects with the old names.
    The chunk's forward keeps its signature and its input/output shapes, and
    returns the same loss (or the full logits / full hidden states) on every
    TP rank. After each backward call :func:`finalize_tensor_parallel_grads`
    (it only communicates when SP or replicated KV heads need it).

    Sets ``chunk.tp_size``, ``chunk.tp_rank``, ``chunk.tp_group`` and
    ``chunk.tp_sequence_parallel``, and on every parameter ``tp_shard_dim``
    (0 or 1 when sharded along that dim, None when replicated),
    ``tp_replicated_kv`` (how many TP ranks hold each of its rows: >1 only for
    q/k/v when KV heads are replicated) and ``sequence_parallel`` (True for
    the norm weights under SP, whose gradients need the TP all-reduce).

    Typical use, one chunk per pipeline stage::

        chunk = build_model(cfg, seed, units=(start, stop), device=device)
        parallelize_tensor(chunk, tp_group, tp_size, tp_rank, sequence_parallel=sp)
        optimizer = torch.optim.AdamW(chunk.parameters(), ...)
        loss = chunk(tokens, labels)          # same value on every TP rank
        loss.backward()
        finalize_tensor_parallel_grads(chunk)
        optimizer.step()

    Building on the CPU and moving the sharded chunk to the GPU afterwards
    (``chunk.to(device)`` keeps the parameter objects and their marks under
    torch's default module-conversion settings) avoids holding the full chunk
    in GPU memory.
    """
    cfg = chunk.cfg
    check_tensor_parallel(cfg, tp_size)
    if getattr(chunk, "tp_size", None) is not None:
        raise ValueError("parallelize_tensor() was already applied to this chunk")
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tensor-parallel rank {tp_rank} is outside [0, {tp_size})")
    if tp_size > 1:
        if not dist.is_initialized():
            raise ConfigError(f"tensor-parallel size {tp_size} needs an initialised torch.distributed group")
        if dist.get_world_size(group) != tp_size or dist.get_rank(group) != tp_rank:
            raise ConfigError(
                f"the TP group has {dist.get_world_size(group)} ranks and this process is its rank "
                f"{dist.get_rank(group)}, but tp_size={tp_size} and tp_rank={tp_rank} were given")
    sequence_parallel = bool(sequence_parallel) and tp_size > 1
    chunk.tp_size, chunk.tp_rank, chunk.tp_group = tp_size, tp_rank, group
    chunk.tp_sequence_parallel = sequence_parallel

    # Shard every parameter by its name's rule and mark it.
    modules = dict(chunk.named_modules())
    for name, param in list(chunk.named_parameters()):
        rule = _shard_rule(cfg, tp_size, name)
        owner_name, _, attr = name.rpartition(".")
        owner = modules[owner_name]
        new = param
        if rule is not None and tp_size > 1:
            index = rule.index(tp_rank).to(param.device)
            with torch.no_grad():
                local = param.index_select(rule.dim, index).clone()
            new = nn.Parameter(local, requires_grad=param.requires_grad)
            setattr(owner, attr, new)
        kv_rows = None
        if rule is not None and rule.kv_replicas > 1:
            q_local = cfg.num_attention_heads // tp_size * cfg.head_dim
            kv_rows = (q_local, new.shape[0])
        _mark(new, rule, tp_rank, sequence_parallel and isinstance(owner, RMSNorm), kv_rows)

    if tp_size == 1:
        return chunk  # nothing to communicate: the modules stay as they are

    tp = _TPContext(group, tp_size, tp_rank, sequence_parallel,
                    dist.get_backend(group) == dist.Backend.GLOO)
    heads = cfg.num_attention_heads // tp_size
    groups = len(_kv_heads(cfg, tp_size, tp_rank))
    ffn = cfg.ffn_hidden_size // tp_size
    vocab = cfg.vocab_size // tp_size
    for layer in chunk.layers.values():
        attn, mlp = layer.attention, layer.mlp
        attn.__class__ = TensorParallelAttention
        attn._tp = tp
        attn.num_heads, attn.num_groups = heads, groups
        attn.split_sizes = (heads * cfg.head_dim, groups * cfg.head_dim, groups * cfg.head_dim)
        attn.qkv.out_features = sum(attn.split_sizes)
        attn.out.in_features = heads * cfg.head_dim
        mlp.__class__ = TensorParallelSwiGLU
        mlp._tp = tp
        mlp.gate_up.out_features = 2 * ffn
        mlp.down.in_features = ffn
    if chunk.embedding is not None:
        chunk.embedding.__class__ = VocabParallelEmbedding
        chunk.embedding._tp = tp
        chunk.embedding.vocab_start, chunk.embedding.vocab_end = tp_rank * vocab, (tp_rank + 1) * vocab
    if chunk.head is not None:
        # A tied head reads the (now sharded) embedding weight through
        # Head.output_weight, so the shard is shared automatically.
        chunk.head.__class__ = VocabParallelHead
        chunk.head._tp = tp
        chunk.head.vocab_start = tp_rank * vocab
        if chunk.head.output is not None:
            chunk.head.output.out_features = vocab
    chunk.__class__ = TensorParallelCausalLM
    chunk._tp = tp
    return chunk


def tp_param_spec(param: torch.Tensor) -> Optional[int]:
    """The dim along which ``param`` is split over the TP group, or None when
    every TP rank holds the whole (replicated) tensor."""
    return getattr(param, "tp_shard_dim", None)


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
    rank = getattr(param, "_tp_rank", 0)
    if tp_param_spec(param) is None:
        return t.pow(2).sum() if rank == 0 else t.new_zeros(())
    replicas = getattr(param, "tp_replicated_kv", 1)
    if replicas > 1:
        start, stop = param._tp_kv_rows
        share = t[:start].pow(2).sum()
        if rank % replicas == 0:
            share = share + t[start:stop].pow(2).sum()
        return share
    return t.pow(2).sum()


# --------------------------------------------------------------------------
# Post-backward gradient reductions
# --------------------------------------------------------------------------

def allreduce_sequence_parallel_grads(chunk: CausalLM) -> None:
    """Sum the gradients of the norm weights over the TP group (with SP each
    rank's norms saw only its sequence slice). A no-op without SP."""
    size, _, group = _chunk_tp(chunk)
    if size == 1 or not chunk.tp_sequence_parallel:
        return
    grads = [p.grad for p in chunk.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def allreduce_replicated_kv_grads(chunk: CausalLM) -> None:
    """Sum the k/v gradient rows of each replicated KV head over its replicas.

    When tp > num_query_groups every KV head lives on tp/groups ranks, each of
    which computed only its query heads' part of the head's gradient. Each
    rank writes its rows into a zeroed [groups, ...] buffer at its head's
    slot; one all-reduce over the TP group then gives every replica the sum.
    A no-op when no KV head is replicated.
    """
    size, rank, group = _chunk_tp(chunk)
    cfg = chunk.cfg
    if size == 1 or cfg.num_query_groups >= size:
        return
    head = _kv_heads(cfg, size, rank)[0]
    params = [p for n, p in chunk.named_parameters()
              if n.endswith((".attention.qkv.weight", ".attention.qkv.bias")) and p.grad is not None]
    if not params:
        return
    kv = [p.grad[p._tp_kv_rows[0]: p._tp_kv_rows[1]] for p in params]
    width = sum(g.numel() for g in kv)
    buf = kv[0].new_zeros((cfg.num_query_groups, width))
    buf[head] = torch.cat([g.reshape(-1) for g in kv])
    dist.all_reduce(buf, group=group)
    offset = 0
    for g in kv:
        g.copy_(buf[head, offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def finalize_tensor_parallel_grads(chunk: CausalLM) -> None:
    """Every post-backward TP reduction this chunk needs (call once per step,
    after the last micro-batch's backward and before clipping / the optimizer)."""
    allreduce_sequence_parallel_grads(chunk)
    allreduce_replicated_kv_grads(chunk)


# --------------------------------------------------------------------------
# Checkpoint helpers: full <-> sharded tensors
# --------------------------------------------------------------------------

def shard_tensor(chunk: CausalLM, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full``, the unsharded value of parameter ``name``.

    Works for anything shaped like the parameter (its value, its gradient,
    an optimizer's moments). Replicated tensors come back as a copy.
    """
    size, rank, _ = _chunk_tp(chunk)
    rule = _shard_rule(chunk.cfg, size, name)
    if rule is None or size == 1:
        return full.detach().clone()
    if full.dim() <= rule.dim or full.shape[rule.dim] != rule.full_size:
        raise ValueError(
            f"{name}: a tensor of shape {tuple(full.shape)} is not the unsharded shape (size "
            f"{rule.full_size} along dim {rule.dim})")
    return full.detach().index_select(rule.dim, rule.index(rank).to(full.device))


def full_tensor(chunk: CausalLM, name: str, local: torch.Tensor) -> torch.Tensor:
    """The unsharded value of parameter ``name`` from every rank's ``local``
    shard (a collective over the TP group: every TP rank must call it, with
    names in the same order). Replicated tensors are returned as they are."""
    size, _, group = _chunk_tp(chunk)
    rule = _shard_rule(chunk.cfg, size, name)
    local = local.detach()
    if rule is None or size == 1:
        return local
    tp = chunk._tp
    parts = [torch.empty_like(local, memory_format=torch.contiguous_format) for _ in range(size)]
    if _list_collectives(local, tp):
        dist.all_gather(parts, local.contiguous(), group=group)
    else:
        stacked = _all_gather(local.unsqueeze(0), 0, tp)
        parts = list(stacked.unbind(0))
    shape = list(local.shape)
    shape[rule.dim] = rule.full_size
    full = local.new_empty(shape)
    # Highest rank first, so a replicated KV head keeps its first replica's value.
    for r in reversed(range(size)):
        full.index_copy_(rule.dim, rule.index(r).to(full.device), parts[r])
    return full


def gather_full_state_dict(chunk: CausalLM) -> dict[str, torch.Tensor]:
    """The chunk's state dict with every tensor unsharded (collective over TP):
    exactly what the same chunk would hold without tensor parallelism."""
    return {name: full_tensor(chunk, name, value) for name, value in chunk.state_dict().items()}


def shard_full_state_dict(chunk: CausalLM, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`gather_full_state_dict`: this rank's shard of
    each tensor of an unsharded state dict, ready for ``load_state_dict``."""
    return {name: shard_tensor(chunk, name, value) for name, value in full.items()}
