"""Activation recomputation: a second forward in the backward instead of keeping activations.

A stage's memory is mostly activations kept from each microbatch's forward
until its backward (LLaMA-3-8B at 8192 tokens: about 1.1 GB per layer and
microbatch in bf16, times the microbatches 1F1B keeps in flight). The modes
(``train.recompute``, per pipeline stage; Megatron-LM's
``--recompute-granularity``):

``none``
    Every layer keeps its activations.
``selective``
    The attention core - softmax(QK^T)V, the attention kernel's call
    (SDPA or FlashAttention-4, hetpipe.models.attention) - runs under
    checkpointing and reruns in the backward from the q, k, v it keeps; the
    projections, RoPE, norms and MLP keep theirs. This is Megatron's
    selective granularity (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models"), aimed at the 5as/h x sbh
    bytes of attention scores, softmax and dropout mask. SDPA's fused kernels
    (cuDNN, flash, memory-efficient, and torch's CPU flash kernel) never keep
    those: the core keeps only its inputs, its output (which the output
    projection keeps anyway) and its log-sum-exp, so selective frees only
    the latter (4 bytes per head and token). It frees real memory where SDPA
    runs its math backend, which keeps the s x s probabilities.
``full``
    A decoder layer keeps only its input and reruns its whole forward (TP
    collectives included) in the backward: the first ``num_layers`` layers of
    the stage (``train.recompute_num_layers``, all by default), Megatron's
    ``--recompute-method block``. Costs one more forward per layer (a third
    more compute).

Both run ``torch.utils.checkpoint`` without reentrancy, so the autograd graph
is the forward's own and only saved tensors are rebuilt: the gradients are
the same bit for bit (deterministic kernels assumed). The RNG state is
stashed at the forward and the rerun runs under it inside
``torch.random.fork_rng``, so no RNG stream advances or changes (the models
have no dropout today; a future one would draw the same mask twice).

The bf16 working copies (:class:`hetpipe.models.precision.Bf16Weights`) stand in for
the parameters only while the engine runs a forward; the rerun happens in the
backward, outside that window. A full-recompute layer therefore records, at
its forward, which tensors its modules held (the bf16 copies) and which
linear forwards were replaced (the gradient-accumulation-fusion path) and
puts them back for the rerun: the rerun saves what the forward's graph
expects, and that graph's nodes - ``_LinearMainGrad`` among them - run the
backward, accumulating each weight gradient into ``.grad`` once. The
attention core holds no parameters and needs none of this.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hetpipe.errors import ConfigError
from hetpipe.models.layers import Attention, DecoderLayer
from hetpipe.models.train_modes import RECOMPUTE_MODES, check_recompute  # noqa: F401 - re-exported
from hetpipe.process.torch_compat import own_parameters


# What a module holds at one moment: its parameter table and its instance forward (if replaced).
_ModuleState = list[tuple[nn.Module, dict[str, Optional[torch.Tensor]], Any]]


def set_recompute(chunk: nn.Module, mode: str, num_layers: Optional[int] = None) -> None:
    """Recompute the first ``num_layers`` decoder layers of ``chunk`` (None: all)
    in ``mode``; the others, and every layer for ``none``, keep their activations.

    Call it on the chunk the trainer runs (after tensor-parallel sharding);
    it may be called again to change the mode.
    """
    if mode not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute mode {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    layers = [m for m in chunk.modules() if isinstance(m, DecoderLayer)]
    count = len(layers) if num_layers is None else num_layers
    for i, layer in enumerate(layers):
        layer_mode = mode if i < count else "none"
        if layer_mode == "full":
            layer.forward = functools.partial(_full_recompute_forward, layer)
        else:
            layer.__dict__.pop("forward", None)
        for module in layer.modules():
            if isinstance(module, Attention):
                module.recompute_core = layer_mode == "selective"


def _full_recompute_forward(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, docs=None) -> torch.Tensor:
    at_forward = _state(layer)

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), _installed(at_forward)

    # preserve_rng_state: the rerun sees the forward's RNG state (see the module docstring).
    return checkpoint(type(layer).forward, layer, x, cos, sin, docs, use_reentrant=False, preserve_rng_state=True,
                      context_fn=contexts)


def _state(layer: nn.Module) -> _ModuleState:
    return [(m, dict(own_parameters(m)), m.__dict__.get("forward")) for m in layer.modules()]


def _install(state: _ModuleState) -> None:
    for module, params, forward in state:
        own_parameters(module).update(params)  # as Bf16Weights.swap does: no Parameter check
        if forward is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = forward


@contextlib.contextmanager
def _installed(state: _ModuleState) -> Iterator[None]:
    """The modules hold what they held at the forward inside the block."""
    current = _state(state[0][0])
    try:
        _install(state)
        yield
    finally:
        _install(current)

