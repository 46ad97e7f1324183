"""Output projection + cross-entropy without a [tokens, vocab] fp32 logit tensor.

With LLaMA-3's 128256-token vocabulary, one microbatch of 8192 tokens has
4.2 GB of fp32 logits, plus the bf16 logits autocast produces, the saved
log-softmax and their gradients: several times the memory of a decoder layer's
activations, all of it on the last pipeline stage. :func:`fused_linear_cross_entropy`
processes the tokens in chunks instead, and for each chunk computes the
logits, the loss *and* the gradients (softmax - one-hot) straight away, so the
logits of one chunk are all that ever exists. The gradients with respect to the
hidden states and the projection weight are kept from the forward pass, and
backward only scales them by the incoming gradient. Peak extra memory is
O(chunk_tokens x vocab) plus one gradient buffer the size of the weight.

This is the idea of Liger-Kernel's fused linear cross-entropy
(https://github.com/linkedin/Liger-Kernel, ``LigerFusedLinearCrossEntropyFunction``;
Hsu et al., "Liger Kernel: Efficient Triton Kernels for LLM Training", 2024),
written here in plain PyTorch ops: the GEMMs dominate, and cuBLAS runs those.

Fused chunk math (``fused=True``; the head sets it with the decoder layers'
``train.fuse_elementwise``): per chunk, the loss and the logit gradient
(softmax - one-hot, scaled) are computed by one ``torch.compile``d function,
which Inductor turns into a row reduction and one pointwise kernel reading
the low-precision logits; the eager path makes about ten full passes over
fp32 copies of them (on an H200 these took half of LLaMA-3-8B's head time).

Precision: the logit GEMMs run in ``compute_dtype`` (bf16 under autocast on a
GPU, the inputs' dtype otherwise); log-softmax, the loss and the softmax
gradient are fp32; the weight gradient accumulates over chunks in fp32 and is
returned in the dtype of the weight given (fp32 master weights get an fp32
gradient, not a bf16-rounded one).
"""
from __future__ import annotations

from typing import Optional

import torch

from hetpipe.models.layers import compile_pure

# Budgets for one chunk's logit-sized tensors when chunk_tokens is not given.
# Eager chunk math keeps fp32 scores (4 bytes per logit); the fused path keeps
# the low-precision logits and their gradient (2 x 2 bytes) and nothing in
# fp32, so it affords more tokens per chunk. Few, large chunks matter for
# speed: every chunk reads and writes the fp32 [V, h] weight-gradient buffer
# once (2.1 GB each way for LLaMA-3's head), and a chunk's GEMMs run below
# peak when its token count is small or not a multiple of the GEMM tile.
DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024
FUSED_CHUNK_BYTES = 2 * 1024 * 1024 * 1024
CHUNK_ALIGN = 128
IGNORE_INDEX = -100


def auto_chunk_tokens(num_tokens: int, vocab_size: int, budget_bytes: int = DEFAULT_CHUNK_BYTES,
                      bytes_per_logit: int = 4) -> int:
    """Tokens per chunk: as few chunks as keep one chunk's ``vocab_size x
    bytes_per_logit`` bytes per token within ``budget_bytes``, of equal size
    rounded up to a multiple of 128 tokens (the GEMM tile) when the chunk is
    larger than that. At least 1, at most ``num_tokens``."""
    limit = max(1, budget_bytes // (vocab_size * bytes_per_logit))
    chunks = max(1, -(-num_tokens // limit))
    size = -(-num_tokens // chunks)
    if size > CHUNK_ALIGN:
        size = -(-size // CHUNK_ALIGN) * CHUNK_ALIGN
    return max(1, min(num_tokens, size))


class FusedLinearCrossEntropy(torch.autograd.Function):
    """loss = mean over non-ignored tokens of CE(hidden @ weight.T, labels).

    Gradients are computed in :meth:`forward`; :meth:`backward` multiplies the
    saved ones by ``grad_output`` in place, so the graph can be backpropagated
    once (a second backward through it raises).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                chunk_tokens: int, compute_dtype: torch.dtype, ignore_index: int,
                want_hidden_grad: bool, want_weight_grad: bool, fused: bool) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            loss, grad_hidden, grad_weight = _forward_and_grads(
                hidden, weight, labels, chunk_tokens, compute_dtype, ignore_index,
                want_hidden_grad, want_weight_grad, fused)
        ctx.has_hidden_grad = grad_hidden is not None
        ctx.has_weight_grad = grad_weight is not None
        saved = [g for g in (grad_hidden, grad_weight) if g is not None]
        ctx.save_for_backward(*saved)
        ctx.used = False
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        if ctx.used:
            raise RuntimeError("fused_linear_cross_entropy: its gradients were already consumed by an earlier "
                               "backward (retain_graph=True is not supported)")
        ctx.used = True
        saved = list(ctx.saved_tensors)
        grad_hidden = saved.pop(0) if ctx.has_hidden_grad else None
        grad_weight = saved.pop(0) if ctx.has_weight_grad else None
        # In place: the buffers belong to this graph node alone.
        for grad in (grad_hidden, grad_weight):
            if grad is not None:
                grad.mul_(grad_output.to(grad.dtype))
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


# (device type, dtype) -> whether addmm with an fp32 ``out`` over low-precision
# inputs works here (CUDA, torch >= 2.8, and only where the fp32 ``self`` is allowed).
_FP32_OUT_ADDMM: dict[tuple[str, torch.dtype], bool] = {}


def _fp32_out_addmm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Probe once per (device type, dtype): ``torch.addmm(acc_fp32, a, b,
    out_dtype=float32, out=acc_fp32)`` with bf16/fp16 ``a``, ``b`` accumulates
    into the fp32 buffer inside the GEMM's epilogue, with no low-precision
    [V, h] temporary, and with ``beta=0`` overwrites it without reading it
    (NaN left in the buffer must not show). Older torch builds lack the
    overload or refuse an fp32 ``self``; any error, or a result not exact to
    fp32, means no."""
    key = (device.type, dtype)
    if key not in _FP32_OUT_ADDMM:
        ok = False
        if device.type == "cuda":
            try:
                # Small integers over powers of two: exact in bf16/fp16 and
                # every product sum exact in fp32, so a right answer is exact.
                a = ((torch.arange(8 * 24, device=device).reshape(8, 24) % 7) - 3).to(dtype) / 4
                b = ((torch.arange(8 * 16, device=device).reshape(8, 16) % 5) - 2).to(dtype) / 8
                product = a.t().float() @ b.float()
                acc = torch.full((24, 16), 0.1, dtype=torch.float32, device=device)
                expected = acc + product
                torch.addmm(acc, a.t(), b, out_dtype=torch.float32, out=acc)
                ok = bool(torch.allclose(acc, expected, rtol=1e-6, atol=1e-7))
                acc.fill_(float("nan"))
                torch.addmm(acc, a.t(), b, beta=0, out_dtype=torch.float32, out=acc)
                ok = ok and bool(torch.equal(acc, product))
            except (TypeError, RuntimeError, NotImplementedError):
                ok = False
        _FP32_OUT_ADDMM[key] = ok
    return _FP32_OUT_ADDMM[key]


def _accumulate_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, overwrite: bool = False) -> None:
    """acc (fp32) += a @ b, for a and b in fp32 or a low-precision dtype;
    ``overwrite``: acc = a @ b, without reading acc (it may hold garbage)."""
    if a.dtype == torch.float32:
        if overwrite:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
    elif _fp32_out_addmm_works(acc.device, a.dtype):
        torch.addmm(acc, a, b, beta=0 if overwrite else 1, out_dtype=torch.float32, out=acc)
    elif overwrite:
        acc.copy_(a @ b)
    else:
        # The GEMM accumulates in fp32 internally; its [V, h] result is
        # rounded once, and the sum over chunks stays fp32.
        acc += a @ b


def _chunk_loss_and_grad(logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor,
                         inv_count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's summed loss and d(mean loss)/d(logits) in the logits' dtype,
    as a pure function of the chunk (what ``fused=True`` compiles).

    logits [n, V]; target [n] (ignored rows hold any valid index); valid [n].
    """
    scores = logits.float()
    lse = torch.logsumexp(scores, dim=-1)
    target_score = scores.gather(1, target.unsqueeze(1)).squeeze(1)
    loss = torch.where(valid, lse - target_score, torch.zeros_like(lse)).sum()
    one_hot = torch.arange(scores.shape[1], device=scores.device).unsqueeze(0) == target.unsqueeze(1)
    scale = (valid.to(torch.float32) * inv_count).unsqueeze(1)
    grad = (torch.exp(scores - lse.unsqueeze(1)) - one_hot.to(torch.float32)) * scale
    return loss, grad.to(logits.dtype)


def _forward_and_grads(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                       compute_dtype: torch.dtype, ignore_index: int, want_hidden_grad: bool,
                       want_weight_grad: bool, fused: bool = False):
    num_tokens = hidden.shape[0]
    labels = labels.to(hidden.device)
    valid = labels != ignore_index
    # Mean over the tokens that count, like F.cross_entropy (NaN if none do).
    count = valid.sum().to(torch.float32)
    inv_count = 1.0 / count.clamp(min=1.0)
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))

    w = weight.to(compute_dtype)  # a no-op when the weight already is in compute_dtype
    need_grads = want_hidden_grad or want_weight_grad
    grad_hidden = torch.empty_like(hidden) if want_hidden_grad else None
    grad_weight = None
    if want_weight_grad:
        # The first chunk's GEMM overwrites it (no zero-fill, no read).
        alloc = torch.empty if num_tokens else torch.zeros
        grad_weight = alloc(weight.shape, dtype=torch.float32, device=weight.device)
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)

    for start in range(0, num_tokens, chunk_tokens):
        stop = min(start + chunk_tokens, num_tokens)
        h = hidden[start:stop].to(compute_dtype)
        if fused and need_grads:
            logits = h @ w.t()                    # [n, V] in compute_dtype
            chunk_loss, grad_logits = compile_pure(_chunk_loss_and_grad)(
                logits, safe_labels[start:stop], valid[start:stop], inv_count)
            del logits
            loss_sum += chunk_loss
        else:
            grad_logits = _eager_chunk(h, w, safe_labels[start:stop], valid[start:stop], inv_count,
                                       loss_sum, need_grads)
        if grad_logits is None:
            continue
        if grad_hidden is not None:
            if grad_hidden.dtype == grad_logits.dtype:
                torch.mm(grad_logits, w, out=grad_hidden[start:stop])  # contiguous rows: written in place
            else:
                grad_hidden[start:stop] = grad_logits @ w
        if grad_weight is not None:
            _accumulate_fp32(grad_weight, grad_logits.t(), h, overwrite=start == 0)
        del grad_logits

    loss = loss_sum / count
    if grad_weight is not None and grad_weight.dtype != weight.dtype:
        grad_weight = grad_weight.to(weight.dtype)
    return loss, grad_hidden, grad_weight


def _eager_chunk(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk_valid: torch.Tensor,
                 inv_count: torch.Tensor, loss_sum: torch.Tensor, need_grads: bool) -> Optional[torch.Tensor]:
    """One chunk in eager ops, in place where possible: adds the chunk's losses
    to ``loss_sum`` and returns the logit gradient (in ``h``'s dtype), or None."""
    logits = h @ w.t()                        # [n, V] in compute_dtype
    scores = logits.float()                   # fp32 (the same tensor when already fp32)
    del logits
    target = labels.unsqueeze(1)
    lse = torch.logsumexp(scores, dim=-1)
    target_score = scores.gather(1, target).squeeze(1)
    loss_sum += torch.where(chunk_valid, lse - target_score, torch.zeros_like(lse)).sum()
    if not need_grads:
        return None
    # d(mean CE)/d(logits) = (softmax - onehot) / count, zero on ignored rows; in place.
    probs = scores.sub_(lse.unsqueeze(1)).exp_()
    probs.scatter_add_(1, target, torch.full_like(target_score, -1.0).unsqueeze(1))
    probs.mul_((chunk_valid.to(torch.float32) * inv_count).unsqueeze(1))
    return probs.to(h.dtype)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               chunk_tokens: Optional[int] = None, compute_dtype: Optional[torch.dtype] = None,
                               ignore_index: int = IGNORE_INDEX, fused: bool = False) -> torch.Tensor:
    """Mean cross-entropy of ``hidden [N, h] @ weight[V, h].T`` against ``labels [N]``.

    Equals ``F.cross_entropy(F.linear(hidden, weight).float(), labels,
    ignore_index=ignore_index)`` (mean over the non-ignored tokens; NaN if all
    are ignored) without materialising the [N, V] logits: tokens go through in
    chunks of ``chunk_tokens`` (default: equal chunks, multiples of 128 tokens,
    as few as keep one chunk's fp32 logits within 256 MiB, or, on the fused
    path, its low-precision logits and their gradient within 2 GiB). ``compute_dtype`` is the dtype of the logit GEMMs
    (default: ``hidden``'s); the function runs with autocast disabled, so the
    caller chooses it (see ``Head.forward``). Gradients come back in the dtypes
    of ``hidden`` and ``weight``. ``fused`` computes each chunk's loss and
    logit gradient with one compiled function (see the module docstring).
    """
    if hidden.ndim != 2 or weight.ndim != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"fused_linear_cross_entropy wants hidden [N, h], weight [V, h], labels [N]; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[1]} != weight's {weight.shape[1]}")
    compute_dtype = compute_dtype or hidden.dtype
    grad_on = torch.is_grad_enabled()
    if chunk_tokens is None:
        if fused and grad_on and (hidden.requires_grad or weight.requires_grad):
            chunk_tokens = auto_chunk_tokens(hidden.shape[0], weight.shape[0], FUSED_CHUNK_BYTES,
                                             2 * compute_dtype.itemsize)
        else:
            chunk_tokens = auto_chunk_tokens(hidden.shape[0], weight.shape[0])
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be positive")
    return FusedLinearCrossEntropy.apply(
        hidden, weight, labels, int(chunk_tokens), compute_dtype, int(ignore_index),
        grad_on and hidden.requires_grad, grad_on and weight.requires_grad, fused)
