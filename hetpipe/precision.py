"""Training precision: which dtype the weights, activations and gradients have.

``train.precision`` takes four values:

``bf16`` (Megatron-LM's ``--bf16``)
    Forward and backward run on bf16 *working copies* of the weights; the
    activations, including the residual stream and the tensors crossing stage
    boundaries, are bf16. The parameters themselves stay fp32 and are the
    *main* weights: gradients accumulate into fp32 ``.grad`` over the
    microbatches, and clipping, the DP all-reduce, AdamW and checkpoints all
    see fp32, exactly as in the other modes. After every optimizer step the
    working copies are refreshed from the main weights (one cast per step, not
    one per microbatch as autocast does).
``bf16-autocast``
    fp32 weights and residual stream; ``torch.autocast`` casts each matmul's
    inputs to bf16 (and re-casts every weight for every microbatch). Boundary
    activations are fp32. Slower and heavier on activations than ``bf16``;
    kept for comparisons with earlier runs.
``fp32``
    Everything fp32 (what CPU ranks run).
``auto``
    ``bf16`` on GPUs, ``fp32`` on CPUs.

How the working copies are wired (:class:`Bf16Weights`): each fp32 parameter
``p`` gets ``w = p.to(bfloat16)`` made once, with autograd recording the cast,
so the gradient of anything computed from ``w`` flows back through the cast
into ``p.grad`` (as fp32, accumulated there by autograd, which is what DP
gradient hooks and views into flat gradient buffers rely on). The cast node
keeps no tensors, so every microbatch's backward can pass through it. While a
chunk runs its forward, ``w`` stands in for ``p`` in the owning module's
parameter table; outside that window the modules hold their fp32 parameters,
so ``named_parameters()``, ``state_dict()`` and optimizers never see ``w``.
Memory per parameter: 4 (main) + 4 (grad) + 8 (AdamW) + 2 (working copy)
bytes, the 18 bytes of Megatron's bf16 mode.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from hetpipe.errors import ConfigError

PRECISIONS = ("auto", "bf16", "bf16-autocast", "fp32")


def resolve_precision(precision: str, device_type: str) -> str:
    """The mode a rank on ``device_type`` runs for ``train.precision``."""
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision={precision!r} must be one of {', '.join(PRECISIONS)}")
    if precision == "auto":
        return "fp32" if device_type == "cpu" else "bf16"
    return precision


def activation_dtype(mode: str) -> torch.dtype:
    """dtype of the residual stream, hence of stage-boundary messages."""
    return torch.bfloat16 if mode == "bf16" else torch.float32


class Bf16Weights:
    """bf16 working copies of the fp32 parameters of some model chunks.

    ``swap(c)`` is a context manager that puts chunk ``c``'s working copies in
    place of its parameters for a forward; ``refresh()`` recasts the copies
    from the (updated) fp32 parameters and must run after each optimizer step
    (and after loading a checkpoint) - the trainer calls it at the start of
    each step. A parameter shared by two modules (tied embedding and head on
    one stage) gets one copy.
    """

    def __init__(self, chunks: Sequence[nn.Module]) -> None:
        self._copies: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        self._slots: list[list[tuple[nn.Module, str, torch.Tensor]]] = []
        with torch.enable_grad():
            for chunk in chunks:
                slots = []
                for module in chunk.modules():
                    for name, p in module._parameters.items():
                        if p is None or not p.is_floating_point():
                            continue
                        if id(p) not in self._copies:
                            # Recorded by autograd when p requires grad: the
                            # backward of every use casts the gradient to fp32
                            # and accumulates it into p.grad.
                            w = p.to(torch.bfloat16) if p.requires_grad else p.detach().to(torch.bfloat16)
                            self._copies[id(p)] = (p, w)
                        slots.append((module, name, self._copies[id(p)][1]))
                self._slots.append(slots)

    def copies(self) -> list[torch.Tensor]:
        return [w for _, w in self._copies.values()]

    @torch.no_grad()
    def refresh(self) -> None:
        """Recast every working copy from its fp32 parameter (one fused copy)."""
        if not self._copies:
            return
        params = [p.detach() for p, _ in self._copies.values()]
        copies = [w.detach() for _, w in self._copies.values()]
        torch._foreach_copy_(copies, params)

    @contextlib.contextmanager
    def swap(self, chunk: int) -> Iterator[None]:
        """Chunk ``chunk``'s modules hold the bf16 copies inside the block."""
        saved = []
        try:
            for module, name, w in self._slots[chunk]:
                saved.append((module, name, module._parameters[name]))
                module._parameters[name] = w  # bypasses __setattr__'s Parameter check on purpose
            yield
        finally:
            for module, name, p in reversed(saved):
                module._parameters[name] = p


def compute_context(mode: str, device_type: str, weights: Optional[Bf16Weights], chunk: int):
    """What wraps one chunk's forward in ``mode``: the weight swap (bf16), autocast
    (bf16-autocast) or nothing (fp32)."""
    if mode == "bf16" and weights is not None:
        return weights.swap(chunk)
    if mode == "bf16-autocast":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
