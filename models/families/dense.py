"""The dense decoder's arithmetic, once: parameters, Megatron FLOPs and the
bytes a layer keeps for its backward, for every family whose layer is the
pre-norm GQA + SwiGLU block of :mod:`hetpipe.models.layers` (LLaMA, Qwen2,
Qwen3). A family's optional parts (q/k/v biases, QK-norm) come from its
:class:`~hetpipe.models.families.spec.FamilySpec`.

Readers: ``ModelConfig.num_parameters``, :mod:`hetpipe.models.flops`, and
the partitioner's cost model (``partitioner/cost.py``), which assembles
these per-layer figures into per-unit arrays. The formulas and their
measurements are written out in docs/partitioner.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hetpipe.models.families.spec import ElementSizes, FamilySpec
    from hetpipe.models.model_config import ModelConfig


# -- parameters -----------------------------------------------------------------

def layer_params(spec: "FamilySpec", cfg: "ModelConfig") -> tuple[int, int]:
    """(parameters split by TP, parameters every TP rank keeps) of one decoder layer."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv_out = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * d
    split = h * qkv_out + cfg.num_attention_heads * d * h + 3 * h * cfg.ffn_hidden_size
    if cfg.add_qkv_bias:
        split += qkv_out
    # The two RMSNorm weights are replicated, and so are QK-norm's two
    # head_dim weights (one per projection, shared by all its heads).
    replicated = 2 * h + (2 * d if spec.qk_norm else 0)
    return split, replicated


def num_parameters(spec: "FamilySpec", cfg: "ModelConfig") -> int:
    """Exact parameter count of the full model (shared weights counted once)."""
    h = cfg.hidden_size
    layer = sum(layer_params(spec, cfg))
    embed = cfg.vocab_size * h
    head = h + (0 if cfg.share_embeddings_and_output_weights else cfg.vocab_size * h)
    return embed + cfg.num_layers * layer + head


# -- FLOPs ------------------------------------------------------------------------
# Megatron's model FLOPs count the matrix multiplies only (forward + backward
# = 3x forward, 2 FLOPs a multiply-add, full rather than causal-halved
# attention scores, recomputation not counted). Megatron-LM's
# num_floating_point_operations sums GEMMs only (its comment: every GEMM run
# 3 times at 2mnk FLOPs), so norms, QK-norm included, count nothing there
# or here; their time is memory-bound and only a measured profile prices it.

def model_flops(spec: "FamilySpec", cfg: "ModelConfig", batch_size: int, seq_length: int) -> float:
    """Model FLOPs of one training step over ``batch_size`` sequences of
    ``seq_length``, by Megatron's closed form (see :mod:`hetpipe.models.flops`)."""
    h, L = cfg.hidden_size, cfg.num_layers
    query_projection_ratio = cfg.num_attention_heads * cfg.head_dim / h
    attention = (1 + cfg.num_query_groups / cfg.num_attention_heads + seq_length / h) \
        * query_projection_ratio
    mlp = cfg.ffn_hidden_size / h * 1.5  # SwiGLU: three matrices instead of two
    logits = cfg.vocab_size / (2 * L * h)
    return 12.0 * batch_size * seq_length * L * h * h * (attention + mlp + logits)


def layer_forward_flops(spec: "FamilySpec", cfg: "ModelConfig", b: int, s: int) -> float:
    """One layer's share of :func:`model_flops`, forward only (whole TP group):
    4bs(had + hgd + 1.5hf) + 4bs^2ad."""
    h, a, g, d, f = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim, cfg.ffn_hidden_size
    return 4.0 * b * s * (h * a * d + h * g * d + 1.5 * h * f) + 4.0 * b * s * s * a * d


def head_forward_flops(spec: "FamilySpec", cfg: "ModelConfig", b: int, s: int) -> float:
    """The output projection's forward: 2bshV (the embedding lookup counts none)."""
    return 2.0 * b * s * cfg.hidden_size * cfg.vocab_size


# -- activations ---------------------------------------------------------------------

def _norm_bytes(h: int, prec: "ElementSizes") -> int:
    """Per token, what an RMSNorm feeding a matmul keeps: its input, the normalised
    tensor and the weighted output (fp32, as the residual stream), plus the bf16
    cast the matmul saves under autocast."""
    e, r = prec.matmul_bytes, prec.residual_bytes
    return h * (3 * r + (e if e != r else 0))


def _qk_norm_bytes(cfg: "ModelConfig", prec: "ElementSizes") -> float:
    """Per token and whole TP group, what QK-norm adds to a layer's saved
    tensors (e: the matmul's element size).

    Eager (rms_norm on each q and k head): its fp32 upcast unless e is fp32
    already, the normalised tensor cast back to e (the weight product's
    input) and one fp32 1/rms per head. Fused (one compiled kernel with RoPE,
    layers.qk_norm_rope_qkv): the kernel's input, the whole qkv projection
    output (v included), and one fp32 1/rms per head.

    Measured on CPU with tiny_qwen3 against the same layer without QK-norm
    (saved-tensor hooks, microbatches 1, 2 and 4 at seq 64): exact per token
    in fp32 and bf16 autocast, eager and compiled; under autocast the
    difference also holds a constant 12 KiB of bf16 RoPE tables, which this
    model leaves out for every family (the tables are shared by a stage's
    layers). tests/test_families.py repeats the measurement.
    """
    e, a, g, d = prec.matmul_bytes, cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim
    if prec.fused_elementwise:
        return (a + 2 * g) * d * e + 4 * (a + g)
    return (a + g) * (d * (e + (4 if e != 4 else 0)) + 4)


def layer_activation_bytes(spec: "FamilySpec", cfg: "ModelConfig", b: int, s: int, tp: int,
                           prec: "ElementSizes") -> float:
    """Bytes one decoder layer keeps for its backward (per microbatch, per device).

    Counted tensor by tensor from the layer's autograd graph (the CPU profile
    of tiny_llama measures it within 2%, the difference being the RoPE tables
    that all layers of a stage share):
    two RMSNorms (replicated over TP); attention keeps the fused qkv output,
    the rotated q and k and the attention output (flash-style: no s x s
    scores) plus its log-sum-exp; the SwiGLU keeps the gate/up output,
    silu(gate) and the product feeding the down projection; QK-norm, where
    the family has it, what :func:`_qk_norm_bytes` says (split by TP with
    the heads).

    Fused elementwise kernels keep less: a norm keeps its input and its
    per-token scale (its output is the matmul's saved input), RoPE keeps
    nothing (the rotated q, k and the contiguous v are what attention
    keeps), and SwiGLU keeps only the gate/up output.
    """
    e = prec.matmul_bytes
    h, a, g, d, f = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups,
                     cfg.head_dim, cfg.ffn_hidden_size)
    if prec.fused_elementwise:
        norm = h * (prec.residual_bytes + e) + 4
        sharded = e * (2 * d * (a + g) + 3 * f) + 4 * a
        if spec.qk_norm:
            sharded += _qk_norm_bytes(cfg, prec)
        return float(b * s * (2 * norm + sharded / tp))
    sharded = e * (3 * d * (a + g) + 4 * f) + 4 * a
    if spec.qk_norm:
        sharded += _qk_norm_bytes(cfg, prec)
    return float(b * s * (2 * _norm_bytes(h, prec) + 8 + sharded / tp))


def head_activation_bytes(spec: "FamilySpec", cfg: "ModelConfig", b: int, s: int, tp: int,
                          prec: "ElementSizes") -> tuple[float, float]:
    """(kept, transient) bytes of the head: the norm, the fp32 log-softmax of the
    logits and the labels are kept for the backward; the bf16 and fp32 logits
    and the log-softmax's gradient exist while the head runs."""
    e = prec.matmul_bytes
    v = cfg.vocab_size
    kept = b * s * (_norm_bytes(cfg.hidden_size, prec) + 8 + 4.0 * v / tp)
    transient = b * s * (e + 4.0 + 4.0) * v / tp
    return float(kept), float(transient)


def layer_weight_pass_bytes(spec: "FamilySpec", cfg: "ModelConfig", b: int, s: int, tp: int,
                            prec: "ElementSizes") -> tuple[float, float, float]:
    """One decoder layer under a zero-bubble schedule's split backward
    (hetpipe/models/split_backward.py), per microbatch and device:
    (kept from B to W, weight gradients W materialises when the linears'
    gradients are not fused into .grad, the GEMM inputs W's reruns free).

    B keeps, for W, the gradient entering every weight GEMM: the output
    gradients of qkv, the output projection, gate/up and down (e bytes; the
    column-parallel ones split by TP, the row-parallel ones whole), and in
    the eager path also those entering the norms' weight products (in the
    residual stream's dtype r: the two layer norms, and QK-norm's over every
    q and k head). A compiled (fused) norm is one custom node that returns
    its weight's gradient from B, so it keeps only that gradient.

    W, unfused, reruns each GEMM node for its weight edge and backpropagates
    all the weight gradients it collected at once: a layer's linear weights'
    size in gradients (e bytes), less the GEMM inputs the reruns free
    (nothing else saved the two norms' outputs and SwiGLU's: measured on CPU
    with tiny_llama, W freed 22 % of a microbatch's saved bytes).
    """
    h, a, g, d, f = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups,
                     cfg.head_dim, cfg.ffn_hidden_size)
    e, r = prec.matmul_bytes, prec.residual_bytes
    norms = 0 if prec.fused_elementwise else 2 * h * r
    layer = b * s * (e * (((a + 2 * g) * d + 2 * f) / tp + 2 * h) + norms)
    if spec.qk_norm and not prec.fused_elementwise:
        layer += b * s * (a + g) * d * r / tp
    split, _ = layer_params(spec, cfg)
    freed = b * s * (2 * h + f / tp) * e
    return float(layer), split / tp * e, freed
