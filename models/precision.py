"""Training precision: which dtype the weights, activations and gradients have.

``train.precision`` takes these values (a vendor group may run its own:
``cluster.groups[i].precision``):

``bf16`` (Megatron-LM's ``--bf16``)
    Forward and backward run on bf16 *working copies* of the weights; the
    activations, including the residual stream and the tensors crossing stage
    boundaries, are bf16. The parameters themselves stay fp32 and are the
    *main* weights: gradients accumulate into fp32 ``.grad`` over the
    microbatches, and clipping, the DP all-reduce, AdamW and checkpoints all
    see fp32, exactly as in the other modes. After every optimizer step the
    working copies are refreshed from the main weights (one cast per step, not
    one per microbatch as autocast does).
``fp8``
    ``bf16`` with the decoder layers' linears computing in FP8
    (:mod:`hetpipe.models.fp8`, torchao's float8 training, recipe
    ``train.fp8_recipe`` = ``tensorwise`` or ``rowwise``): each linear casts
    its bf16 input and the bf16 working copy of its weight to FP8 with dynamic
    scales, multiplies in FP8 and returns bf16, so activations, boundary
    messages and their gradients stay bf16 and the main weights, gradients,
    AdamW state and checkpoints stay fp32, exactly as in ``bf16`` (a run
    resumes in the other mode). On GPUs the decoder layers are compiled
    (torchao's casts and scales are fast only fused by ``torch.compile``).
    Needs a device whose catalog entry has an FP8 format
    (hetpipe/devices/catalog.py); the FP8 pair is that entry's.
``bf16-pure``
    No fp32 anywhere in the model's state: the parameters themselves are
    bf16, and so are their gradients (accumulated over the microbatches in
    bf16 by autograd) and AdamW's moments (torch keeps them in the
    parameter's dtype). 8 bytes per parameter instead of 18. This is what the
    ``torch.distributed.pipelining`` peer of the benchmarks runs ("bf16
    weights"), so the two can be compared at the same precision and memory.
    An update smaller than half a bf16 step of a weight (a relative 2^-9) is
    lost, so long runs drift from ``bf16``'s curve: use it for comparisons
    and short runs, ``bf16`` for real pretraining (the trainer prints a
    note). Under ``optimizer.distributed`` with DP > 1 the ZeRO-1 optimizer
    keeps fp32 main shards and moments of the bf16 parameters (Megatron's
    distributed optimizer), so only weights and gradients stay bf16.
``bf16-autocast``
    fp32 weights and residual stream; ``torch.autocast`` casts each matmul's
    inputs to bf16 (and re-casts every weight for every microbatch). Boundary
    activations are fp32. Slower and heavier on activations than ``bf16``;
    kept for comparisons with earlier runs.
``fp32``
    Everything fp32 (what CPU ranks run).
``auto``
    ``bf16`` on GPUs, ``fp32`` on CPUs.

Every mode computes RMSNorm statistics, RoPE tables and the loss in fp32.

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

Gradient-accumulation fusion (``train.grad_accumulation_fusion``, on by
default; Megatron-LM's ``--gradient-accumulation-fusion``): routed through the
cast, a weight gradient is produced in bf16, cast to fp32 in a kernel of its
own and added to ``.grad`` by another, for every parameter in every
microbatch: 12 % of a LLaMA-8B stage's kernel time in a 2xH200 profile. With fusion the
decoder layers' linear layers run through :class:`_LinearMainGrad`, whose
backward has the weight-gradient GEMM accumulate straight into the fp32
``.grad`` (``torch.addmm(..., out_dtype=float32)`` on CUDA, bf16 inputs with an
fp32 accumulator and output), and then runs the parameter's
post-accumulate-grad hooks itself, as autograd would have (the DP reducer
counts on them). Biases, norms, the embedding and the head keep the cast path,
and so do fp8's float8 linears (their backward's FP8 GEMMs return a bf16
weight gradient; :mod:`hetpipe.models.fp8`).
Compiled layers (``train.compile``) keep the cast path too: the fused
backward's side effects are not something to trace. In ``bf16-pure`` the same
function runs on the bf16 parameter itself (:func:`fuse_linear_grads`): its
GEMM adds into the bf16 ``.grad`` in place instead of autograd's new tensor
and add kernel.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hetpipe.models.fp8 import is_float8
from hetpipe.models.train_modes import PRECISIONS, WORKING_COPY_MODES, resolve_precision  # noqa: F401 - re-exported
from hetpipe.process.torch_compat import foreach_copy_, own_parameters, run_post_accumulate_grad_hooks

def activation_dtype(mode: str) -> torch.dtype:
    """dtype of the residual stream, hence of stage-boundary messages."""
    return torch.bfloat16 if mode in ("bf16", "fp8", "bf16-pure") else torch.float32


@torch.no_grad()
def cast_parameters(chunks: Sequence[nn.Module], dtype: torch.dtype) -> None:
    """Store every floating-point parameter of ``chunks`` in ``dtype`` (bf16-pure).

    Parameters only: buffers such as RoPE's inverse frequencies keep fp32. A
    parameter shared by two modules stays one tensor (``.data`` is swapped
    in place of the object)."""
    for chunk in chunks:
        for p in chunk.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def _accumulate_fp32_reference(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """grad += a @ b with bf16 inputs and fp32 accumulation, by upcasting (CPU; fallback)."""
    grad.add_(torch.mm(a.float(), b.float()))


def _accumulate_fp32_gemm(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """grad += a @ b in one GEMM: bf16 inputs, fp32 accumulator, in place."""
    torch.addmm(grad, a, b, out_dtype=torch.float32, out=grad)


def _accumulate_fp32_mm_add(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """grad += a @ b: an fp32-output GEMM, then one fp32 add."""
    grad.add_(torch.mm(a, b, out_dtype=torch.float32))


@functools.lru_cache(maxsize=None)
def accumulate_kernel(device_type: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """The fastest correct way to do ``grad(fp32) += a(bf16) @ b(bf16)`` here.

    Checked once per process on a small case against the upcast reference,
    since fp32-output GEMMs on bf16 inputs (and their in-place form) depend on
    the torch build.
    """
    if device_type != "cuda":
        return _accumulate_fp32_reference
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(64, 96, generator=gen).to("cuda", torch.bfloat16)
    b = torch.randn(96, 80, generator=gen).to("cuda", torch.bfloat16)
    start = torch.randn(64, 80, generator=gen).to("cuda")
    want = start.clone()
    _accumulate_fp32_reference(want, a, b)
    for kernel in (_accumulate_fp32_gemm, _accumulate_fp32_mm_add):
        got = start.clone()
        try:
            kernel(got, a, b)
        except (RuntimeError, TypeError):
            continue
        if torch.allclose(got, want, rtol=1e-5, atol=1e-4):
            return kernel
    return _accumulate_fp32_reference


def accumulate_main_grad(main: nn.Parameter, grad_out: torch.Tensor, inputs: torch.Tensor) -> None:
    """``main.grad += grad_out^T @ inputs``, then ``main``'s post-accumulate hooks: in fp32
    for an fp32 ``main`` (bf16), else in ``main``'s own dtype (bf16-pure), one GEMM whose
    epilogue adds the old gradient (an fp32 sum rounded once)."""
    if main.dtype != torch.float32:
        if main.grad is None:
            main.grad = torch.mm(grad_out.t(), inputs)
        else:
            main.grad.addmm_(grad_out.t(), inputs)
    else:
        if main.grad is None:
            main.grad = torch.zeros_like(main)
        accumulate_kernel(main.device.type)(main.grad, grad_out.t(), inputs)
    run_post_accumulate_grad_hooks(main)


# While a zero-bubble schedule's B runs (hetpipe.models.split_backward), the
# list its W will run: _LinearMainGrad queues its weight-gradient GEMM there
# instead of running it (Qi et al., "Zero Bubble Pipeline Parallelism", 2024).
_deferred_main_grads: Optional[list[Callable[[], None]]] = None


@contextlib.contextmanager
def deferring_main_grads(queue: list[Callable[[], None]]) -> Iterator[None]:
    """Inside the block, fused linears append their weight-gradient GEMM (and
    its hooks) to ``queue`` instead of running it."""
    global _deferred_main_grads
    previous, _deferred_main_grads = _deferred_main_grads, queue
    try:
        yield
    finally:
        _deferred_main_grads = previous


class _LinearMainGrad(torch.autograd.Function):
    """y = x @ w^T + b with w a bf16 working copy of the fp32 parameter ``main``
    (bf16), or ``main`` itself detached (bf16-pure); the weight gradient goes
    straight into ``main.grad``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                main: list[nn.Parameter]) -> torch.Tensor:
        # ``main`` comes wrapped in a list so that autograd does not make it an
        # input: an input would get an (empty) accumulation of its own, which
        # runs its hooks a second time.
        ctx.save_for_backward(x, weight)
        ctx.main = main[0]
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_2d = grad.reshape(-1, grad.shape[-1])
        if _deferred_main_grads is not None:
            _deferred_main_grads.append(functools.partial(accumulate_main_grad, ctx.main, grad_2d,
                                                          x.reshape(-1, x.shape[-1])))
        else:
            accumulate_main_grad(ctx.main, grad_2d, x.reshape(-1, x.shape[-1]))
        grad_bias = grad_2d.sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None


def _fused_linear_forward(module: nn.Linear, main: nn.Parameter, x: torch.Tensor) -> torch.Tensor:
    return _LinearMainGrad.apply(x, module.weight, module.bias, [main])


def _fused_own_weight_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _LinearMainGrad.apply(x, module.weight.detach(), module.bias, [module.weight])


def _decoder_linears(chunk: nn.Module) -> list[nn.Linear]:
    """The linears of ``chunk``'s decoder layers whose weight trains. Not the
    head's: the fused loss reads its weight directly, never calling forward.
    Not float8 ones (fp8): their own forward is the FP8 GEMM."""
    if not hasattr(chunk, "layers"):
        return []
    return [m for layer in chunk.layers.values() for m in layer.modules()
            if isinstance(m, nn.Linear) and m.weight.requires_grad and not is_float8(m)]


def fuse_linear_grads(chunks: Sequence[nn.Module]) -> None:
    """bf16-pure's gradient-accumulation fusion: the decoder layers' linears
    compute their weight gradient as one GEMM that adds into the bf16
    ``.grad`` in place (:class:`_LinearMainGrad`). Autograd's way is a GEMM
    into a new bf16 tensor and then an add kernel reading and writing every
    gradient for every microbatch: 4.8 % of a LLaMA-3-8B stage's kernel
    time in a 2xH100 profile (zb_v, seq 4096, docs/benchmarks.md), and a
    second rounding."""
    for chunk in chunks:
        for module in _decoder_linears(chunk):
            module.forward = functools.partial(_fused_own_weight_forward, module)


class Bf16Weights:
    """bf16 working copies of the fp32 parameters of some model chunks.

    ``swap(c)`` is a context manager that puts chunk ``c``'s working copies in
    place of its parameters for a forward; ``refresh()`` recasts the copies
    from the (updated) fp32 parameters and must run after each optimizer step
    (and after loading a checkpoint) - the trainer calls it at the start of
    each step. A parameter shared by two modules (tied embedding and head on
    one stage) gets one copy.
    """

    def __init__(self, chunks: Sequence[nn.Module], fuse_linear_grads: bool = False) -> None:
        self._copies: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        self._slots: list[list[tuple[nn.Module, str, torch.Tensor]]] = []
        # Per chunk: (linear module, the fused forward that replaces its own
        # inside swap()), made once rather than per microbatch.
        self._fused: list[list[tuple[nn.Linear, Callable[[torch.Tensor], torch.Tensor]]]] = []
        with torch.enable_grad():
            for chunk in chunks:
                fused = [(m, functools.partial(_fused_linear_forward, m, m.weight))
                         for m in (_decoder_linears(chunk) if fuse_linear_grads else [])]
                fused_ids = {id(m.weight) for m, _ in fused}
                slots = []
                for module in chunk.modules():
                    for name, p in own_parameters(module).items():
                        if p is None or not p.is_floating_point():
                            continue
                        if id(p) not in self._copies:
                            if p.requires_grad and id(p) not in fused_ids:
                                # Recorded by autograd: the backward of every
                                # use casts the gradient to fp32 and
                                # accumulates it into p.grad.
                                w = p.to(torch.bfloat16)
                            else:  # no gradient, or _LinearMainGrad delivers it
                                w = p.detach().to(torch.bfloat16)
                            self._copies[id(p)] = (p, w)
                        slots.append((module, name, self._copies[id(p)][1]))
                self._slots.append(slots)
                self._fused.append(fused)

    def copies(self) -> list[torch.Tensor]:
        return [w for _, w in self._copies.values()]

    @torch.no_grad()
    def refresh(self) -> None:
        """Recast every working copy from its fp32 parameter (one fused copy)."""
        if not self._copies:
            return
        params = [p.detach() for p, _ in self._copies.values()]
        copies = [w.detach() for _, w in self._copies.values()]
        foreach_copy_(copies, params)

    @contextlib.contextmanager
    def swap(self, chunk: int) -> Iterator[None]:
        """Chunk ``chunk``'s modules hold the bf16 copies inside the block."""
        saved, patched = [], []
        try:
            for module, name, w in self._slots[chunk]:
                slots = own_parameters(module)
                saved.append((module, name, slots[name]))
                slots[name] = w  # bypasses __setattr__'s Parameter check on purpose
            for module, forward in self._fused[chunk]:
                module.forward = forward
                patched.append(module)
            yield
        finally:
            for module in patched:
                del module.forward  # the instance attribute; nn.Linear.forward again
            for module, name, p in reversed(saved):
                own_parameters(module)[name] = p


def compute_context(mode: str, device_type: str, weights: Optional[Bf16Weights], chunk: int):
    """What wraps one chunk's forward in ``mode``: the weight swap (bf16, fp8), autocast
    (bf16-autocast) or nothing (fp32)."""
    if mode in WORKING_COPY_MODES and weights is not None:
        return weights.swap(chunk)
    if mode == "bf16-autocast":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
