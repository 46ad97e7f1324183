"""Context parallelism (CP): one microbatch's sequence split over the CP ranks
of a pipeline stage, attention computed across the split.

Sharding (Megatron-LM's load balance for causal attention): the sequence of
``S`` tokens is cut into ``2C`` chunks of ``S / 2C`` and CP rank ``i`` of
``C`` holds chunks ``i`` and ``2C - 1 - i``. Under a causal mask a late chunk
attends to many keys and an early one to few, so pairing them gives every
rank the same attention work. Everything outside attention (norms, MLP,
projections, the loss) is token-local and runs on the rank's ``S / C``
tokens unchanged; RoPE rotates each token by its global position (or its
document position), read from the whole-sequence tables at the rank's
indices (:meth:`ContextShard.shard`).

Attention needs every earlier key, so it runs one of two ways
(``partition.cp_method``):

* ``allgather`` - all-gather K and V over the CP group (the LLaMA 3 paper's
  choice for its long-context phase: K/V are small under GQA, and one
  collective overlaps nothing but costs one latency), then each of the
  rank's two query chunks attends to the keys up to its own end through
  torch's SDPA, so the rank's own kernel choice applies. The backward
  reduce-scatters the K/V gradients back to their owners.
* ``ring`` - ring attention (Liu et al., "Ring Attention with Blockwise
  Transformers"; Megatron's ``--cp-comm-type p2p``): K/V blocks travel
  around the group in ``C`` steps while each rank attends its queries to the
  block it holds; partial results are merged exactly by their log-sum-exp,
  ``out = sum_b exp(lse_b - lse) out_b`` with ``lse = logsumexp_b lse_b``.
  The backward sends K/V around again, with their gradients riding along
  and arriving home after ``C`` shifts. Blocks are computed here in plain
  fp32 torch (the reference path, exact on CPU); a flash kernel that
  returns the LSE would make it the fast path on GPUs.

Document masking needs no message: every rank has the microbatch's tokens,
so it knows each global token's document (``segments`` over the whole
sequence) and masks any block by the global indices of its queries and keys.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from hetpipe.errors import ConfigError
from hetpipe.parallel.group_facts import all_gather_single, reduce_scatter_single

CP_METHODS = ("allgather", "ring")


@dataclass(frozen=True)
class ContextShard:
    """This rank's place in its CP group: ``size`` ranks, index ``rank``,
    the group (None for one rank) and the attention exchange ``method``."""
    size: int
    rank: int
    group: Optional[dist.ProcessGroup] = None
    method: str = "allgather"

    def __post_init__(self) -> None:
        if self.method not in CP_METHODS:
            raise ConfigError(f"partition.cp_method={self.method!r} must be one of {', '.join(CP_METHODS)}")

    def chunk_ids(self, rank: Optional[int] = None) -> tuple[int, int]:
        """The two of the ``2C`` sequence chunks CP rank ``rank`` holds."""
        r = self.rank if rank is None else rank
        return r, 2 * self.size - 1 - r

    def indices(self, seq: int, rank: Optional[int] = None) -> torch.Tensor:
        """Global positions [seq / C] CP rank ``rank`` (default: this one) holds, in its order."""
        chunk = chunk_length(seq, self.size)
        return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in self.chunk_ids(rank)])

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of ``x`` along its sequence dimension ``dim``."""
        chunk = chunk_length(x.shape[dim], self.size)
        return torch.cat([x.narrow(dim, c * chunk, chunk) for c in self.chunk_ids()], dim=dim)

    def peer(self, offset: int) -> int:
        """The global rank of the CP rank ``offset`` places further round the ring."""
        return dist.get_global_rank(self.group, (self.rank + offset) % self.size)


def chunk_length(seq: int, cp: int) -> int:
    """Tokens per load-balancing chunk; the sequence must split into ``2 * cp`` of them."""
    if seq % (2 * cp):
        raise ConfigError(f"train.seq_length={seq} must be a multiple of 2 x partition.cp = {2 * cp} "
                          "(each CP rank holds two equal chunks of the sequence)")
    return seq // (2 * cp)


def check_cp_degree(cp: int) -> None:
    if cp < 1:
        raise ConfigError(f"partition.cp={cp} must be positive")


# -- masks and block math (fp32) ----------------------------------------------------

def block_mask(q_index: torch.Tensor, k_index: torch.Tensor,
               segments: Optional[torch.Tensor]) -> torch.Tensor:
    """True where a query at global position q_index[i] may attend the key at
    k_index[j]: causal, and in the same document when ``segments`` [b, S]
    (the whole sequence's) is given. [sq, sk], or [b, 1, sq, sk] with documents."""
    causal = q_index[:, None] >= k_index[None, :]
    if segments is None:
        return causal
    same = segments[:, q_index][:, :, None] == segments[:, k_index][:, None, :]
    return (same & causal).unsqueeze(1)


def _expand_heads(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V [b, hkv, s, d] repeated to the query heads (SDPA's GQA mapping)."""
    groups = heads // kv.shape[1]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient over query heads summed back onto the K/V heads."""
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a row that saw no key yet) as 0, so exp(x - lse) stays 0, not nan."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    scores = q.float() @ _expand_heads(k, q.shape[1]).float().transpose(-1, -2) * scale
    return scores.masked_fill(~mask, float("-inf"))


def block_forward(q, k, v, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q attending the block k, v under ``mask``, in fp32;
    a row with no allowed key gives out 0 and lse -inf."""
    scores = _scores(q, k, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse)[..., None])
    return probs @ _expand_heads(v, q.shape[1]).float(), lse


def merge(out, lse, block_out, block_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax results over disjoint keys combined exactly by log-sum-exp."""
    total = torch.logaddexp(lse, block_lse)
    safe = _finite(total)
    out = out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None]
    return out, total


def block_backward(q, k, v, lse, dout, delta, mask, scale):
    """(dq, dk, dv) of one block, in fp32, from the final ``lse`` and
    ``delta = rowsum(dout * out)`` (FlashAttention's backward, one block)."""
    probs = torch.exp(_scores(q, k, mask, scale) - lse[..., None])
    ve = _expand_heads(v, q.shape[1]).float()
    dv = probs.transpose(-1, -2) @ dout
    dscores = probs * (dout @ ve.transpose(-1, -2) - delta[..., None])
    dq = dscores @ _expand_heads(k, q.shape[1]).float() * scale
    dk = dscores.transpose(-1, -2) @ q.float() * scale
    return dq, _fold_heads(dk, k.shape[1]), _fold_heads(dv, k.shape[1])


# -- the ring ---------------------------------------------------------------------

class _Shift:
    """``tensor`` sent one place round the ring, the previous rank's received."""

    def __init__(self, tensor: torch.Tensor, shard: ContextShard) -> None:
        tensor = tensor.contiguous()
        self.received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, shard.peer(1), shard.group),
               dist.P2POp(dist.irecv, self.received, shard.peer(-1), shard.group)]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


def _ring_mask(shard: ContextShard, src: int, seq: int, segments) -> torch.Tensor:
    device = segments.device if segments is not None else None
    q_index, k_index = shard.indices(seq), shard.indices(seq, src)
    if device is not None:
        q_index, k_index = q_index.to(device), k_index.to(device)
    return block_mask(q_index, k_index, segments)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence's keys,
    K/V passed round the CP ring (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, shard: ContextShard, segments: Optional[torch.Tensor]):
        scale, seq = q.shape[-1] ** -0.5, q.shape[2] * shard.size
        kv, out, lse = torch.stack((k, v)), None, None
        for step in range(shard.size):
            shift = _Shift(kv, shard) if step < shard.size - 1 else None
            mask = _ring_mask(shard, (shard.rank - step) % shard.size, seq, segments).to(q.device)
            block = block_forward(q, kv[0], kv[1], mask, scale)
            out, lse = block if out is None else merge(out, lse, *block)
            kv = shift.wait() if shift is not None else kv
        ctx.shard, ctx.scale = shard, scale
        ctx.save_for_backward(q, k, v, out, lse, segments)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, segments = ctx.saved_tensors
        shard, scale, seq = ctx.shard, ctx.scale, q.shape[2] * ctx.shard.size
        dout = dout.float()
        delta = (dout * out).sum(-1)
        kv, dq = torch.stack((k, v)), torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        for step in range(shard.size):
            shift = _Shift(kv, shard) if step < shard.size - 1 else None
            mask = _ring_mask(shard, (shard.rank - step) % shard.size, seq, segments).to(q.device)
            dq_b, dk_b, dv_b = block_backward(q, kv[0], kv[1], lse, dout, delta, mask, scale)
            dq += dq_b
            dkv = _Shift(dkv + torch.stack((dk_b, dv_b)), shard).wait()
            kv = shift.wait() if shift is not None else kv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


# -- all-gather of K/V ------------------------------------------------------------

class GatherSequence(torch.autograd.Function):
    """[b, h, s/C, d] from every CP rank stacked to [C, b, h, s/C, d]; the
    backward sums the ranks' gradients and hands each rank its own."""

    @staticmethod
    def forward(ctx, x, shard: ContextShard):
        ctx.shard = shard
        out = torch.empty((shard.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        all_gather_single(out, x.contiguous(), group=shard.group)
        return out.unflatten(0, (shard.size, x.shape[0]))

    @staticmethod
    def backward(ctx, grad):
        shard = ctx.shard
        grad = grad.contiguous()
        if grad.device.type == "cpu":  # gloo has no reduce-scatter: sum everything, keep ours
            dist.all_reduce(grad, group=shard.group)
            return grad[shard.rank].clone(), None
        out = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
        reduce_scatter_single(out, grad.flatten(0, 1), group=shard.group)
        return out, None


def _in_sequence_order(gathered: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """[C, b, h, s/C, d] gathered by rank to [b, h, S, d] in global order."""
    halves = gathered.unflatten(3, (2, -1))  # [C, b, h, 2, L, d]: each rank's two chunks
    order = [halves[r, :, :, i] for c in range(2 * shard.size)
             for r, i in [_owner(c, shard.size)]]
    return torch.cat(order, dim=2)


def _owner(chunk: int, cp: int) -> tuple[int, int]:
    """(CP rank, which of its two chunks) holding global chunk ``chunk``."""
    return (chunk, 0) if chunk < cp else (2 * cp - 1 - chunk, 1)


def _attend_prefix(q, k, v, chunk: int, length: int, segments, backends) -> torch.Tensor:
    """Query chunk ``chunk`` [b, h, L, d] over keys 0..its end, causal bottom-right aligned."""
    end = (chunk + 1) * length
    k, v = k[:, :, :end], v[:, :, :end]
    if segments is None:
        mask = causal_lower_right(length, end)
    else:
        index = torch.arange(end, device=segments.device)
        mask = block_mask(index[end - length:], index, segments)
    return _sdpa(q, k, v, mask, backends)


def _sdpa(q, k, v, mask, backends) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    if backends is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel(list(backends), set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def allgather_attention(q, k, v, shard: ContextShard, segments, backends=None) -> torch.Tensor:
    """Causal attention of this rank's two query chunks over all-gathered K/V."""
    k = _in_sequence_order(GatherSequence.apply(k, shard), shard)
    v = _in_sequence_order(GatherSequence.apply(v, shard), shard)
    length = q.shape[2] // 2
    outs = [_attend_prefix(q[:, :, i * length:(i + 1) * length], k, v, c, length, segments, backends)
            for i, c in enumerate(shard.chunk_ids())]
    return torch.cat(outs, dim=2)


def context_attention(q, k, v, shard: ContextShard, segments: Optional[torch.Tensor] = None,
                      backends=None) -> torch.Tensor:
    """Causal (block-causal with ``segments``) attention of this rank's
    q [b, hq, s/C, d] over the whole sequence, k/v [b, hkv, s/C, d] held
    across the CP group; ``segments`` [b, S] is the whole microbatch's."""
    if shard.method == "ring":
        return RingAttention.apply(q, k, v, shard, segments)
    return allgather_attention(q, k, v, shard, segments, backends)
