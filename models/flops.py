"""Model FLOPs per training step, by Megatron-LM's formula.

Megatron (``num_floating_point_operations`` in megatron/training/training.py)
counts forward + backward (3x forward) multiply-adds (2 FLOPs each) of every
matrix multiply, GQA- and SwiGLU-aware, with full (not causal-halved) attention
scores and the logit layer; recomputation is *not* counted. Using the same
formula lets our TFLOP/s per GPU be compared with published Megatron numbers:

    12 * B * s * L * h^2 * ( (1 + g/a + s/h) * (a*d/h)
                             + (f/h) * 3/2
                             + V / (2*L*h) )

with B samples of length s, L layers, hidden h, a heads, g query groups,
head size d, SwiGLU hidden f and vocabulary V.
"""
from __future__ import annotations

from hetpipe.models.model_config import ModelConfig


def megatron_model_flops(cfg: ModelConfig, batch_size: int, seq_length: int) -> float:
    """Model FLOPs of one training step over ``batch_size`` sequences of ``seq_length``."""
    h, L = cfg.hidden_size, cfg.num_layers
    query_projection_ratio = cfg.num_attention_heads * cfg.head_dim / h
    attention = (1 + cfg.num_query_groups / cfg.num_attention_heads + seq_length / h) \
        * query_projection_ratio
    mlp = cfg.ffn_hidden_size / h * 1.5  # SwiGLU: three matrices instead of two
    logits = cfg.vocab_size / (2 * L * h)
    return 12.0 * batch_size * seq_length * L * h * h * (attention + mlp + logits)
