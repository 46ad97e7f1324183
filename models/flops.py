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
head size d, SwiGLU hidden f and vocabulary V. Norms (QK-norm included)
are elementwise and count nothing. The formula is the model family's
(:mod:`hetpipe.models.families.dense`); this is its entry point.
"""
from __future__ import annotations

from hetpipe.models.families import spec_of
from hetpipe.models.model_config import ModelConfig


def megatron_model_flops(cfg: ModelConfig, batch_size: int, seq_length: int) -> float:
    """Model FLOPs of one training step over ``batch_size`` sequences of ``seq_length``."""
    return spec_of(cfg).model_flops(cfg, batch_size, seq_length)
