"""liger-kernel's Triton kernels for RMSNorm, SwiGLU and the head's
cross-entropy (``train.fuse_elementwise=liger``; package ``liger-kernel``, the
hetpipe[kernels] extra). Triton runs them on CUDA and ROCm GPUs.

Each function here computes what its counterpart in hetpipe.models.layers or
hetpipe.models.loss computes, through liger's functional API
(``liger_kernel.transformers.functional``), imported on first call:
RMSNorm in fp32 then scaled in the input's dtype (liger's "llama" casting,
Hugging Face's order), silu(gate) * up, and the mean cross-entropy over
labels other than -100 without a [tokens, vocab] logit tensor, its weight
gradient accumulated in fp32.
"""
from __future__ import annotations

import importlib.util

import torch

LIGER_INSTALL = "pip install liger-kernel (or the hetpipe[kernels] extra)"


def liger_installed() -> bool:
    """Whether liger-kernel can be imported, found without importing it."""
    return importlib.util.find_spec("liger_kernel") is not None


def _functional():
    from liger_kernel.transformers import functional
    return functional


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # in_place=False: the incoming gradient may be shared (the residual stream's).
    return _functional().liger_rms_norm(x, weight, eps, casting_mode="llama", in_place=False)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return _functional().liger_swiglu(gate, up)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         compute_dtype: torch.dtype, ignore_index: int) -> torch.Tensor:
    """Mean CE of hidden [n, h] @ weight.T against labels [n]; the GEMMs in ``compute_dtype``."""
    return _functional().liger_fused_linear_cross_entropy(
        hidden.to(compute_dtype), weight.to(compute_dtype), labels, ignore_index=ignore_index,
        reduction="mean", accum_dtype=torch.float32)
