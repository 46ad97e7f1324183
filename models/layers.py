"""The building blocks of a LLaMA / Qwen2 / Qwen3 decoder layer, in plain PyTorch.

Numerics follow the Hugging Face reference implementations closely (RMSNorm in
fp32, RoPE with the rotate-half layout, the same inverse-frequency formula) so
that converted checkpoints give the same logits to ~1e-6 in fp32. The q/k/v and
gate/up projections are fused into one matrix each: one GEMM instead of three
(or two) on the hot path; the HF converter splits them.

Fused elementwise work (``train.fuse_elementwise``; :func:`fuse_elementwise`).
Run eagerly, the memory-bound work around the GEMMs (RMSNorm in fp32, RoPE,
SwiGLU's gate, the residual adds and the copies between layouts) is some 60
small kernels per layer and microbatch, each reading and writing whole
activations: 20-27 % of a LLaMA-3-8B stage's wall time on an H200 (profile in
docs/benchmarks.md). With fusion on, each of the pure functions below
(:func:`rms_norm`, :func:`add_rms_norm`, :func:`rope_qkv`, :func:`swiglu`,
and :func:`qk_norm_rope_qkv`, RoPE with Qwen3's QK-norm in front) is
compiled by ``torch.compile`` (Triton on GPUs) into one forward and one
backward kernel, the idea of Megatron-LM's fused RMSNorm, RoPE and
bias-SwiGLU kernels. The GEMMs (with gradient-accumulation fusion), SDPA and
everything else stay eager, so nothing but these functions is traced. The
compiled functions compute the same formulas; in bf16 they may round
intermediates differently from eager (within bf16 resolution). The head's
loss has a fused path of its own (hetpipe.models.loss), switched with these.
On a 2xH200 LLaMA-3-8B pipeline the layers' fusion took the NCCL boundary
from 458.6 to 539.7 TFLOP/s/GPU (docs/benchmarks.md).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hetpipe.models.attention import (ATTENTION_BACKENDS, DeviceFacts, Kernel, SdpaKernel,  # noqa: F401 - re-exported
                                      choose_kernel, fa4_installed, sdpa_preference)
from hetpipe.models.documents import Documents
from hetpipe.models.liger import rms_norm as liger_rms_norm, swiglu as liger_swiglu
from hetpipe.models.families import spec_of
from hetpipe.models.model_config import ModelConfig
# train.fuse_elementwise's choice, re-exported for the trainer (torch-free, for configs and the planner).
from hetpipe.models.train_modes import (ELEMENTWISE_KERNELS, elementwise_kernels,  # noqa: F401 - re-exported
                                        elementwise_mode, fuses_elementwise)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Hugging Face computes it: normalise in fp32, scale in x's dtype."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: (x + delta, rms_norm(x + delta))."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, with gate and up the two halves of the fused projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@functools.cache
def compile_pure(fn):
    """``fn`` (a pure tensor function) under torch.compile: one per function and
    process, shared by all layers (static shapes; a new shape compiles once more)."""
    return torch.compile(fn, fullgraph=True, dynamic=False)


class RMSNorm(nn.Module):
    # Set per instance by fuse_elementwise() and use_liger().
    fused = False
    liger = False

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.liger:
            return liger_rms_norm(x, self.weight, self.eps)
        return (compile_pure(rms_norm) if self.fused else rms_norm)(x, self.weight, self.eps)


def rope_inverse_frequencies(head_dim: int, base: float) -> torch.Tensor:
    """RoPE inverse frequencies, computed exactly as transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base ** exponents)


def llama3_scaled_frequencies(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                              high_freq_factor: float, original_context: int) -> torch.Tensor:
    """``inv_freq`` under the "llama3" scaling of Meta's Llama 3.1 release (the
    rule transformers implements as ``_compute_llama3_parameters``).

    A dimension whose wavelength (positions per full turn) exceeds
    original_context / low_freq_factor never completed a turn in pretraining;
    it is slowed by ``factor`` so that the longer context maps into the angles
    it was trained on. One shorter than original_context / high_freq_factor
    turned many times and encodes relative position; it is kept. Between the
    two, the frequency is blended linearly in turns-per-original-context,
    ``(1 - s) * f / factor + s * f`` with ``s`` going from 0 to 1 across the
    band, so the spectrum has no jump.
    """
    turns = original_context * inv_freq / (2 * math.pi)  # = original_context / wavelength
    # Clamping s to [0, 1] makes the band edges the two pure cases.
    s = ((turns - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)
    return (1 - s) * inv_freq / factor + s * inv_freq


def model_rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The inverse frequencies ``cfg``'s RoPE rotates by (cfg.rope_scaling applied).

    The eager and the fused (compiled ``rope_qkv``) paths both take their
    cos/sin tables from these, through :func:`rope_cos_sin`.
    """
    inv_freq = rope_inverse_frequencies(cfg.head_dim, cfg.rotary_base)
    if cfg.rope_scaling == "llama3":
        inv_freq = llama3_scaled_frequencies(
            inv_freq, cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
            cfg.rope_original_max_position_embeddings)
    return inv_freq


def rope_cos_sin(inv_freq: torch.Tensor, seq_length: int, dtype: torch.dtype):
    """cos/sin tables [seq, head_dim] for positions 0..seq_length-1."""
    positions = torch.arange(seq_length, device=inv_freq.device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _over_heads(table: torch.Tensor) -> torch.Tensor:
    """A per-sample table [b, s, d] as [b, 1, s, d], to rotate [b, heads, s, d];
    a shared [s, d] broadcasts as it is."""
    return table.unsqueeze(1) if table.dim() == 3 else table


def rope_cos_sin_at(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin tables [b, s, head_dim] for positions [b, s] (documents' own
    positions); equal to :func:`rope_cos_sin`'s rows at those positions."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, heads, seq, head_dim] by the position tables."""
    return x * cos + _rotate_half(x) * sin


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, groups: int,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused projection's output [b, s, (heads + 2 groups) * head_dim]
    into q, k, v [b, s, heads or groups, head_dim], rotating q and k.

    Fused, this is one kernel each way: it reads qkv once and writes q, k and v
    contiguous (backward: one gradient for qkv, no concatenation).
    """
    batch, seq, _ = qkv.shape
    q, k, v = qkv.split((heads * head_dim, groups * head_dim, groups * head_dim), dim=-1)
    q = q.view(batch, seq, heads, head_dim)
    k = k.view(batch, seq, groups, head_dim)
    v = v.view(batch, seq, groups, head_dim)
    cos, sin = cos.to(qkv.dtype).unsqueeze(-2), sin.to(qkv.dtype).unsqueeze(-2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()


def qk_norm_rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, groups: int,
                     head_dim: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rope_qkv` with QK-norm first: every query and key head RMS-normed
    over head_dim (one weight per projection), then rotated, as transformers'
    Qwen3Attention orders them."""
    batch, seq, _ = qkv.shape
    q, k, v = qkv.split((heads * head_dim, groups * head_dim, groups * head_dim), dim=-1)
    q = rms_norm(q.view(batch, seq, heads, head_dim), q_weight, eps)
    k = rms_norm(k.view(batch, seq, groups, head_dim), k_weight, eps)
    v = v.view(batch, seq, groups, head_dim)
    cos, sin = cos.to(q.dtype).unsqueeze(-2), sin.to(q.dtype).unsqueeze(-2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()


def set_attention_backend(model: nn.Module, backend: str, deterministic: bool = False,
                          device: Optional[torch.device] = None, rank: int = 0, half: bool = True) -> None:
    """Give every attention module of ``model`` the kernel ``train.attention_backend=backend``
    chooses on ``device`` (default: the model's), deterministic ones when ``deterministic``,
    for attention in bf16/fp16 (``half``) or fp32 (hetpipe.models.attention)."""
    if device is None:
        device = next(model.parameters()).device
    facts = DeviceFacts.of(device)
    use_attention_kernel(model, choose_kernel(backend, deterministic, facts, fa4_installed(), rank, half))


def use_attention_kernel(model: nn.Module, kernel: Kernel) -> None:
    for module in model.modules():
        if isinstance(module, Attention):
            module.kernel = kernel


class Attention(nn.Module):
    """Causal grouped-query self-attention; the core runs the kernel
    hetpipe.models.attention chose for this rank."""

    fused = False
    # Set per instance by set_attention_backend(); by default SDPA in torch's own order.
    kernel: Kernel = SdpaKernel()
    # Set per instance by hetpipe.models.recompute.set_recompute (train.recompute=selective).
    recompute_core = False
    # Set per instance by hetpipe.models.context_hooks.use_context_parallel: this
    # rank's share of the sequence (None: the whole sequence is here).
    context = None

    @property
    def sdpa_backends(self) -> Optional[tuple]:
        """The SDPA backends the kernel tries, best first (None: torch's order, or FA4)."""
        return self.kernel.backends if isinstance(self.kernel, SdpaKernel) else None

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                docs: Optional[Documents]) -> torch.Tensor:
        core = self.kernel if self.context is None else self._context_core
        if self.recompute_core:
            # The attention core reruns in the backward from the q, k, v it keeps.
            return checkpoint(core, q, k, v, docs, use_reentrant=False)
        return core(q, k, v, docs)

    def _context_core(self, q, k, v, docs: Optional[Documents]) -> torch.Tensor:
        """Attention across the CP group (hetpipe.parallel.context); ``docs`` are the whole sequence's."""
        from hetpipe.parallel.context import context_attention
        segments = docs.segments if docs is not None else None
        return context_attention(q, k, v, self.context, segments, self.sdpa_backends)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_groups = cfg.num_query_groups
        self.head_dim = cfg.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_groups * self.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.add_qkv_bias)
        self.out = nn.Linear(q_size, cfg.hidden_size, bias=False)
        # QK-norm (Qwen3): one RMSNorm over head_dim for all query heads, one
        # for all key heads. The TP plan keeps them whole on every rank.
        self.q_norm = self.k_norm = None
        if spec_of(cfg).qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_epsilon)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_epsilon)

    def _fused_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        if self.q_norm is None:
            return compile_pure(rope_qkv)(qkv, cos, sin, self.num_heads, self.num_groups, self.head_dim)
        return compile_pure(qk_norm_rope_qkv)(qkv, cos, sin, self.num_heads, self.num_groups, self.head_dim,
                                              self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Optional[Documents] = None) -> torch.Tensor:
        """x [b, s, hidden]; cos/sin [s, head_dim], or [b, s, head_dim] where
        positions restart per document; docs: the microbatch's documents (block-causal)."""
        batch, seq, _ = x.shape
        if self.fused:
            # [b, s, h, d] views transposed to [b, h, s, d]: the layout SDPA's
            # kernels take without a copy.
            q, k, v = self._fused_qkv(self.qkv(x), cos, sin)
            y = self._attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), docs)
            return self.out(y.transpose(1, 2).reshape(batch, seq, -1))
        q, k, v = self.qkv(x).split(self.split_sizes, dim=-1)
        q = q.view(batch, seq, self.num_heads, self.head_dim)
        k = k.view(batch, seq, self.num_groups, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(batch, seq, self.num_groups, self.head_dim).transpose(1, 2)
        # The tables come in the residual stream's dtype (fp32); under autocast
        # q/k are bf16, and rotating them in bf16 (as Hugging Face's bf16
        # models do) keeps fp32 copies of q and k out of the saved activations.
        cos, sin = _over_heads(cos.to(q.dtype)), _over_heads(sin.to(q.dtype))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self._attend(q, k, v, docs)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    fused = False
    liger = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_hidden_size, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.liger:
            return self.down(liger_swiglu(self.gate_up(x)))
        return self.down((compile_pure(swiglu) if self.fused else swiglu)(self.gate_up(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    fused = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.attention = Attention(cfg)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Optional[Documents] = None) -> torch.Tensor:
        attended = self.attention(self.input_norm(x), cos, sin, docs)
        if self.fused:
            norm = self.post_attention_norm
            x, h = compile_pure(add_rms_norm)(x, attended, norm.weight, norm.eps)
        else:
            x = x + attended
            h = self.post_attention_norm(x)
        return x + self.mlp(h)

    @torch.no_grad()
    def init_weights(self, cfg: ModelConfig, generator: torch.Generator) -> None:
        std = cfg.init_method_std
        # Megatron's scaled init for the projections that write into the
        # residual stream keeps its variance independent of depth.
        out_std = std / math.sqrt(2.0 * cfg.num_layers)
        for linear, s in ((self.attention.qkv, std), (self.attention.out, out_std),
                          (self.mlp.gate_up, std), (self.mlp.down, out_std)):
            linear.weight.normal_(0.0, s, generator=generator)
            if linear.bias is not None:
                linear.bias.zero_()
        self.input_norm.weight.fill_(1.0)
        self.post_attention_norm.weight.fill_(1.0)
        for norm in (self.attention.q_norm, self.attention.k_norm):
            if norm is not None:
                norm.weight.fill_(1.0)


def fuse_elementwise(model: nn.Module, enabled: bool = True) -> None:
    """Switch the fused elementwise path (see the module docstring) on or off for
    every module of ``model`` that has one: the decoder layers' parts, the
    norms and the head's loss (hetpipe.models.loss)."""
    for module in model.modules():
        if isinstance(getattr(type(module), "fused", None), bool):
            module.fused = enabled


def use_liger(model: nn.Module) -> None:
    """Run RMSNorm, SwiGLU and the head's cross-entropy of ``model`` on liger's
    kernels (hetpipe.models.liger); RoPE keeps its compiled kernel, and the
    residual add before the second norm runs eagerly so that the norm is liger's."""
    for module in model.modules():
        if isinstance(getattr(type(module), "liger", None), bool):
            module.liger = True
        if isinstance(module, DecoderLayer):
            module.fused = False
