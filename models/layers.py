"""The building blocks of a LLaMA / Qwen2 decoder layer, in plain PyTorch.

Numerics follow the Hugging Face reference implementations closely (RMSNorm in
fp32, RoPE with the rotate-half layout, the same inverse-frequency formula) so
that converted checkpoints give the same logits to ~1e-6 in fp32. The q/k/v and
gate/up projections are fused into one matrix each: one GEMM instead of three
(or two) on the hot path; the HF converter splits them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hetpipe.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inverse_frequencies(head_dim: int, base: float) -> torch.Tensor:
    """RoPE inverse frequencies, computed exactly as transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base ** exponents)


def rope_cos_sin(inv_freq: torch.Tensor, seq_length: int, dtype: torch.dtype):
    """cos/sin tables [seq, head_dim] for positions 0..seq_length-1."""
    positions = torch.arange(seq_length, device=inv_freq.device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, heads, seq, head_dim] by the position tables."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention through scaled_dot_product_attention."""

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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).split(self.split_sizes, dim=-1)
        q = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.num_groups, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.num_groups, self.head_dim).transpose(1, 2)
        # The tables come in the residual stream's dtype (fp32); under autocast
        # q/k are bf16, and rotating them in bf16 (as Hugging Face's bf16
        # models do) keeps fp32 copies of q and k out of the saved activations.
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.num_groups != self.num_heads)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_hidden_size, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.attention = Attention(cfg)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_attention_norm(x))

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
