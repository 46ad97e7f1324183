"""The attention core, softmax(QK^T / sqrt(d))V, and which kernel runs it
(``train.attention_backend``, the issue's ``model.attention_backend``).

Every decoder layer calls its kernel here and nowhere else: an
:class:`SdpaKernel` (torch's ``scaled_dot_product_attention`` with a backend
preference) or an :class:`Fa4Kernel` (FlashAttention-4, the CuTe DSL kernels
of the ``flash-attn-4`` package, for SM90 and SM100). ``auto`` takes FA4
where it is installed and the rank's GPU is SM90/SM100 (compute capability
9.x or 10.x), else SDPA's own choice; ROCm ranks always run SDPA's backends
(not verified on AMD hardware). An explicit ``fa4`` on a rank without it
stops before step 1 in one line naming the rank's device and what to
install. FA4 is imported only when a rank runs it.

Layouts: the layers hand over q [b, hq, s, d] and k, v [b, hkv, s, d] (SDPA's
layout; views of the projections' [b, s, h, d]). FA4 takes [b, s, h, d], so
it gets the transposed views, and grouped-query attention natively (query
head i reads KV head i // (hq / hkv), SDPA's ``enable_gqa`` mapping): no
repeat of K and V. Packed documents (:mod:`hetpipe.models.documents`) run
block-causal: FA4 through its varlen entry point over the flattened tokens
with one sequence per document, SDPA with a boolean block-causal mask.

Determinism (``train.deterministic``): FA4 runs with ``deterministic=True``
(its deterministic backward); SDPA keeps only backends with a deterministic
backward (:func:`sdpa_preference`).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hetpipe.errors import ConfigError
from hetpipe.models.documents import Documents
from hetpipe.models.train_modes import ATTENTION_BACKENDS, check_attention_backend  # noqa: F401 - re-exported

# Compute-capability majors FA4 ships kernels for: Hopper (SM90), Blackwell (SM100).
FA4_MAJORS = (9, 10)
FA4_INSTALL = "pip install --pre flash-attn-4==4.0.0b36 (or the hetpipe[kernels] extra)"


def sdpa_preference(backend: str, deterministic: bool = False) -> Optional[tuple]:
    """The SDPA backends to try, best first, for ``train.attention_backend``
    (None: torch's own order; ``fa4`` and ``auto`` take it where SDPA runs).
    The chosen one goes first and the others stay allowed behind it, so a
    rank whose build or GPU lacks it (cuDNN on ROCm, a shape the kernel
    refuses) runs the next one instead of failing: one setting serves every
    vendor group of a mixed cluster.

    ``deterministic`` (train.deterministic) keeps only backends whose backward
    is deterministic under ``torch.use_deterministic_algorithms(True)``, flash
    first where the choice was auto, fa4 or cudnn: flash's backward then takes
    FlashAttention-2's deterministic path, efficient's splits no keys (CUDA:
    torch forces ``num_splits_key=1``), math is plain ops; cuDNN's backward has
    no deterministic mode in torch 2.11-2.15 (torch skips it under the flag,
    and a cuDNN-only choice raises). ROCm builds also leave efficient out:
    torch's CK path for it passes ``deterministic=false`` whatever the flag
    (pytorch/pytorch#197771, open)."""
    check_attention_backend(backend)
    if deterministic:
        return _deterministic_sdpa(backend)
    if backend in ("auto", "fa4"):
        return None
    order = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return (order[backend],) + tuple(b for name, b in order.items() if name != backend)


def _deterministic_sdpa(backend: str) -> tuple:
    order = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "math": SDPBackend.MATH}
    if torch.version.hip:
        del order["efficient"]
    first = order.get(backend, SDPBackend.FLASH_ATTENTION)
    return (first,) + tuple(b for b in order.values() if b != first)


def fa4_functions():
    """FlashAttention-4's ``flash_attn_func`` and ``flash_attn_varlen_func``,
    imported on first use. Both return (out, lse). CPU tests replace this
    function with an SDPA reference of the same signatures."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    return flash_attn_func, flash_attn_varlen_func


def fa4_installed() -> bool:
    """Whether ``flash_attn.cute`` can be imported, found without importing it
    (``flash_attn`` may be FlashAttention-2's package, without ``cute``)."""
    spec = importlib.util.find_spec("flash_attn")
    places = (spec.submodule_search_locations or ()) if spec is not None else ()
    return any(os.path.exists(os.path.join(p, "cute", "interface.py")) for p in places)


@dataclass(frozen=True)
class DeviceFacts:
    """What the kernel choice reads of a rank's device. capability: CUDA's
    (major, minor) on NVIDIA GPUs, None on CPUs and ROCm GPUs."""
    name: str
    capability: Optional[tuple[int, int]]

    @classmethod
    def of(cls, device: torch.device) -> "DeviceFacts":
        if device.type != "cuda":
            return cls(device.type, None)
        name = torch.cuda.get_device_name(device)
        return cls(name, None if torch.version.hip else tuple(torch.cuda.get_device_capability(device)))


@dataclass(frozen=True)
class SdpaKernel:
    """torch's SDPA, trying ``backends`` in order (None: torch's own order)."""
    backends: Optional[tuple] = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 docs: Optional[Documents] = None) -> torch.Tensor:
        mask = docs.block_causal_mask() if docs is not None and docs.segments is not None else None
        gqa = q.shape[1] != k.shape[1]
        if self.backends is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        # The backward runs the kernel the forward picked (autograd records
        # the backend's own op), so only the forward needs the context.
        with sdpa_kernel(list(self.backends), set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)


@dataclass(frozen=True)
class Fa4Kernel:
    """FlashAttention-4, with its deterministic backward when ``deterministic``."""
    deterministic: bool = False

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 docs: Optional[Documents] = None) -> torch.Tensor:
        dense, varlen = fa4_functions()
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, s, h, d]
        scale = q.shape[-1] ** -0.5
        if docs is None or docs.cu_seqlens is None:
            out = dense(q, k, v, softmax_scale=scale, causal=True, deterministic=self.deterministic)[0]
            return out.transpose(1, 2)
        batch, seq, heads, dim = q.shape
        out = varlen(q.reshape(batch * seq, heads, dim), k.reshape(batch * seq, k.shape[2], dim),
                     v.reshape(batch * seq, v.shape[2], dim), cu_seqlens_q=docs.cu_seqlens,
                     cu_seqlens_k=docs.cu_seqlens, max_seqlen_q=docs.max_seqlen, max_seqlen_k=docs.max_seqlen,
                     softmax_scale=scale, causal=True, deterministic=self.deterministic)[0]
        return out.view(batch, seq, heads, dim).transpose(1, 2)


Kernel = Union[SdpaKernel, Fa4Kernel]


def choose_kernel(backend: str, deterministic: bool, device: DeviceFacts, installed: bool,
                  rank: int = 0, half: bool = True) -> Kernel:
    """The kernel a rank on ``device`` runs for ``train.attention_backend=backend``
    (``installed``: FA4 is; ``half``: attention computes in bf16/fp16, the only
    dtypes FA4 takes); ConfigError for an ``fa4`` the rank cannot run."""
    check_attention_backend(backend)
    sm_ok = device.capability is not None and device.capability[0] in FA4_MAJORS
    fallback = SdpaKernel(sdpa_preference(backend, deterministic))
    if backend == "fa4":
        if not sm_ok:
            raise ConfigError(f"train.attention_backend=fa4: rank {rank}'s device ({device.name}) is not an SM90 "
                              "or SM100 NVIDIA GPU, which FlashAttention-4 needs; train.attention_backend=auto "
                              "runs SDPA's best there")
        if not installed:
            raise ConfigError(f"train.attention_backend=fa4: FlashAttention-4 (flash_attn.cute) is not installed "
                              f"for rank {rank} ({device.name}): {FA4_INSTALL}")
        if not half:
            raise ConfigError("train.attention_backend=fa4: FlashAttention-4 computes in bf16/fp16, and "
                              "train.precision=fp32 attends in fp32; use a bf16 precision or another backend")
        return Fa4Kernel(deterministic)
    if backend == "auto" and sm_ok and installed and half:
        return Fa4Kernel(deterministic)
    return fallback
