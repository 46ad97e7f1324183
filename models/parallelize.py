"""The tensor-parallel plan of hetpipe's decoder (LLaMA-3, Qwen2, Qwen3): which module
becomes which TP counterpart, and which rows of its fused weights a rank keeps.

The split is Megatron-LM's (Shoeybi et al., 2019, arXiv:1909.08053):

* attention: the fused q/k/v projection is column-parallel so that each rank
  owns whole heads - ``heads / tp`` query heads and the key/value heads those
  query heads read; the output projection is row-parallel. With fewer KV heads
  than TP ranks each KV head is replicated on ``tp / num_query_groups``
  consecutive ranks (their gradients are summed after backward);
* MLP: the fused gate/up projection is column-parallel (each rank keeps its
  slice of the gate rows *and* of the up rows, still stored as [gate | up]),
  the down projection row-parallel;
* the token embedding and the output head are split by vocabulary rows, and
  the loss never gathers the logits;
* the norms stay whole on every rank. A family's per-head norms (its spec's
  ``tp.per_head_norms``: Qwen3's QK-norm, one head_dim weight shared by all
  query or all key heads) do too, but each rank norms only its own heads,
  so their weight gradients are partial and summed over the TP group, with
  or without sequence parallelism.

The plan is kept next to the model, as torchtitan keeps a ``parallelize.py``
per model, and goes by module type: the model code never sees a process group
and the parallel library never reads a parameter's name.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from hetpipe.errors import ConfigError
from hetpipe.models.families import spec_of
from hetpipe.models.layers import Attention, RMSNorm, SwiGLU
from hetpipe.models.model_config import ModelConfig
from hetpipe.models.tp_modules import (TensorParallelAttention, TensorParallelCausalLM, TensorParallelSwiGLU,
                                       VocabParallelEmbedding, VocabParallelHead)
from hetpipe.models.transformer import CausalLM, Embedding, Head
from hetpipe.parallel.tp_collectives import TPGroup, tp_group
from hetpipe.parallel.tp_shards import (ReplicatedKV, ShardRule, column_parallel_linear, mark_replicated,
                                        row_parallel_linear, shard_parameter)


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
# Which rows / columns of each weight a rank owns
# --------------------------------------------------------------------------

def _arange(start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop, dtype=torch.int64)


def even_rule(dim: int, full_size: int, tp_size: int) -> ShardRule:
    """Rank r owns the r-th of ``tp_size`` equal contiguous blocks along ``dim``."""
    return ShardRule(dim, full_size, lambda r: _arange(r * full_size // tp_size, (r + 1) * full_size // tp_size))


def kv_heads(cfg: ModelConfig, tp_size: int, rank: int) -> list[int]:
    """The key/value heads rank ``rank`` uses (replicated when tp > groups)."""
    groups = cfg.num_query_groups
    if groups >= tp_size:
        per = groups // tp_size
        return list(range(rank * per, (rank + 1) * per))
    return [rank * groups // tp_size]


def qkv_rule(cfg: ModelConfig, tp_size: int) -> ShardRule:
    """The rows of the fused [q | k | v] projection: this rank's query heads,
    then the key and value rows of the KV heads they read."""
    d, heads, groups = cfg.head_dim, cfg.num_attention_heads, cfg.num_query_groups
    q_per = heads // tp_size
    k_base, v_base = heads * d, (heads + groups) * d

    def rows(rank: int) -> torch.Tensor:
        kv = kv_heads(cfg, tp_size, rank)
        k = torch.cat([_arange(k_base + g * d, k_base + (g + 1) * d) for g in kv])
        v = torch.cat([_arange(v_base + g * d, v_base + (g + 1) * d) for g in kv])
        return torch.cat((_arange(rank * q_per * d, (rank + 1) * q_per * d), k, v))

    return ShardRule(0, (heads + 2 * groups) * d, rows, kv_replicas=max(1, tp_size // groups))


def gate_up_rule(cfg: ModelConfig, tp_size: int) -> ShardRule:
    """The rows of the fused [gate | up] projection: this rank's gate rows, then its up rows."""
    ffn, per = cfg.ffn_hidden_size, cfg.ffn_hidden_size // tp_size
    return ShardRule(0, 2 * ffn, lambda r: torch.cat(
        (_arange(r * per, (r + 1) * per), _arange(ffn + r * per, ffn + (r + 1) * per))))


# --------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------

def _attention(dense: Attention, cfg: ModelConfig, tp: TPGroup) -> TensorParallelAttention:
    rule = qkv_rule(cfg, tp.size)
    heads = kv_heads(cfg, tp.size, tp.rank)
    q_rows = cfg.num_attention_heads // tp.size * cfg.head_dim
    replicated = None
    if rule.kv_replicas > 1:
        replicated = ReplicatedKV(q_rows, q_rows + 2 * cfg.head_dim, heads[0], cfg.num_query_groups)
    qkv = column_parallel_linear(dense.qkv, rule, tp, replicated)
    out = row_parallel_linear(dense.out, even_rule(1, cfg.num_attention_heads * cfg.head_dim, tp.size), tp)
    whole = {name: getattr(dense, name) for name in spec_of(cfg).tp.per_head_norms}
    for module in whole.values():
        for param in module.parameters():
            mark_replicated(param, tp, partial_grad=True)
    return TensorParallelAttention(cfg, tp, qkv, out, cfg.num_attention_heads // tp.size, len(heads), whole)


def _mlp(dense: SwiGLU, cfg: ModelConfig, tp: TPGroup) -> TensorParallelSwiGLU:
    gate_up = column_parallel_linear(dense.gate_up, gate_up_rule(cfg, tp.size), tp)
    down = row_parallel_linear(dense.down, even_rule(1, cfg.ffn_hidden_size, tp.size), tp)
    return TensorParallelSwiGLU(cfg, tp, gate_up, down)


def _embedding(dense: Embedding, cfg: ModelConfig, tp: TPGroup) -> VocabParallelEmbedding:
    weight = shard_parameter(dense.weight, even_rule(0, cfg.vocab_size, tp.size), tp)
    return VocabParallelEmbedding(cfg, tp, weight, tp.rank * cfg.vocab_size // tp.size)


def _head(dense: Head, cfg: ModelConfig, tp: TPGroup, embedding: Optional[VocabParallelEmbedding]
          ) -> VocabParallelHead:
    # A head tied to this chunk's embedding reads its (now sharded) weight; a
    # head with its own copy (untied, or tied across stages) cuts the same rows.
    output = None
    if dense.output is not None:
        output = column_parallel_linear(dense.output, even_rule(0, cfg.vocab_size, tp.size), tp)
    tied = embedding if dense.output is None else None
    return VocabParallelHead(cfg, tp, dense.norm, output, tied, tp.rank * cfg.vocab_size // tp.size)


def parallelize_tensor(chunk: CausalLM, group: Optional[dist.ProcessGroup], tp_size: int, tp_rank: int,
                       sequence_parallel: bool = False) -> TensorParallelCausalLM:
    """This rank's tensor-parallel shard of a chunk built with full weights.

    ``group`` is the TP process group (``None``: the default group) of which
    this process is rank ``tp_rank`` of ``tp_size``. Call it right after
    ``build_model`` (on any device), before per-module switches
    (``fuse_elementwise``, ``set_attention_backend``) and the optimizer, and
    use only the returned chunk: it takes over ``chunk``'s decoder layers,
    replacing their attention and MLP by TP counterparts, and ``chunk`` keeps
    its full embedding and head. Every rank thus starts from exactly the
    single-process initialisation; parameter names do not change.

    The result's forward keeps the signature and input/output shapes, and
    returns the same loss (or the full logits / hidden states) on every TP
    rank. After each step's backward call
    :func:`~hetpipe.parallel.tp_shards.finalize_tensor_parallel_grads` (it
    only communicates when SP or replicated KV heads need it). Every
    parameter carries a ``tp_shard`` mark (see :mod:`hetpipe.parallel.tp_shards`).

    Typical use, one chunk per pipeline stage::

        chunk = build_model(cfg, seed, units=(start, stop), device=device)
        chunk = parallelize_tensor(chunk, tp_group, tp_size, tp_rank, sequence_parallel=sp)
        optimizer = torch.optim.AdamW(chunk.parameters(), ...)
        loss = chunk(tokens, labels)          # same value on every TP rank
        loss.backward()
        finalize_tensor_parallel_grads(chunk)
        optimizer.step()

    With ``tp_size`` 1 the units are kept as they are and only marked.
    """
    cfg = chunk.cfg
    check_tensor_parallel(cfg, tp_size)
    if any(getattr(p, "tp_shard", None) is not None for p in chunk.parameters()):
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
    tp = tp_group(group, tp_size, tp_rank, sequence_parallel)

    embedding, head = chunk.embedding, chunk.head
    if tp_size > 1:
        for layer in chunk.layers.values():
            layer.attention = _attention(layer.attention, cfg, tp)
            layer.mlp = _mlp(layer.mlp, cfg, tp)
        if embedding is not None:
            embedding = _embedding(embedding, cfg, tp)
        if head is not None:
            head = _head(head, cfg, tp, embedding)
    parallel = TensorParallelCausalLM(chunk, tp, embedding, chunk.layers, head)
    # Whatever was not cut is whole on every rank; under SP the norms see
    # only this rank's tokens.
    for module in parallel.modules():
        for param in module.parameters(recurse=False):
            if getattr(param, "tp_shard", None) is None:
                mark_replicated(param, tp, partial_grad=isinstance(module, RMSNorm) and tp.sequence_parallel)
    return parallel
