"""Issue 42's kernels timed on one GPU, in one call: a decoder layer's
forward + backward with each attention kernel, and RMSNorm, SwiGLU and the
head's cross-entropy with torch.compile's kernels against liger's.

    python scripts/bench_attention.py                  # LLaMA-3-8B, seq 4096 and 8192, on cuda:0
    python scripts/bench_attention.py --seqs 8192 --iters 20

Attention rows (one LLaMA-3-8B decoder layer, bf16, elementwise work compiled
as train.fuse_elementwise=compile does, batch 1):
  cudnn       SDPA, cuDNN first (train.attention_backend=cudnn; auto without FA4)
  fa4         FlashAttention-4 (train.attention_backend=fa4)
  flash_det   SDPA's FlashAttention-2 with its deterministic backward (train.deterministic=true without FA4)
  fa4_det     FA4 with deterministic=True (train.deterministic=true with FA4)
  fa4_docs    FA4's varlen kernel over 4 packed documents (data.reset_attention_mask=true)
The *_det rows run under torch.use_deterministic_algorithms(True), as the mode does.
Kernel rows: RMSNorm over [seq, hidden], SwiGLU over [seq, 2 x ffn], and the
head's loss over [seq, hidden] x [vocab, hidden] (hetpipe's chunked loss with
its compiled chunk math against liger's fused linear cross-entropy), forward
+ backward, for compile and liger (train.fuse_elementwise=compile|liger).

Each row is the median of --iters timed runs after --warmup (CUDA events);
a kernel that is not installed gives a row saying so. Results and the command
go to docs/benchmarks.md. --device cpu --model tiny_llama runs the script's
own logic on a CPU (tests), skipping what needs a GPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts, for the *_det rows
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hetpipe.models import liger  # noqa: E402
from hetpipe.models.attention import Fa4Kernel, SdpaKernel, fa4_installed, sdpa_preference  # noqa: E402
from hetpipe.models.documents import DocumentRule, find_documents  # noqa: E402
from hetpipe.models.layers import (DecoderLayer, compile_pure, fuse_elementwise, model_rope_frequencies,  # noqa: E402
                                   rms_norm, rope_cos_sin, swiglu, use_attention_kernel)
from hetpipe.models.loss import fused_linear_cross_entropy  # noqa: E402
from hetpipe.models.model_config import model_preset  # noqa: E402

EOD = 1  # any id: the bench's tokens are made for it


def timed(fn, iters: int, warmup: int, device: torch.device) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            begin = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - begin))
    return statistics.median(times)


def attention_variants(device: torch.device) -> dict:
    """name -> (kernel, deterministic, packed documents), or a reason it cannot run here."""
    fa4 = device.type == "cuda" and fa4_installed()
    missing = "FA4 not installed or not on this device"
    return {"cudnn": (SdpaKernel(sdpa_preference("cudnn")), False, False),
            "fa4": (Fa4Kernel(), False, False) if fa4 else missing,
            "flash_det": (SdpaKernel(sdpa_preference("flash", True)), True, False),
            "fa4_det": (Fa4Kernel(deterministic=True), True, False) if fa4 else missing,
            "fa4_docs": (Fa4Kernel(), False, True) if fa4 else missing}


def layer_step(cfg, seq: int, kernel, packed: bool, device: torch.device, dtype: torch.dtype):
    """One decoder layer's forward + backward as a closure."""
    layer = DecoderLayer(cfg).to(device=device, dtype=dtype)
    fuse_elementwise(layer, device.type == "cuda")
    use_attention_kernel(layer, kernel)
    x = torch.randn(1, seq, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(model_rope_frequencies(cfg).to(device), seq, dtype)
    docs = None
    if packed:
        tokens = torch.zeros(1, seq, dtype=torch.long)
        tokens[0, [seq // 4 - 1, seq // 2 - 1, 3 * seq // 4 - 1]] = EOD
        docs = find_documents(tokens, DocumentRule(EOD, True, False)).to(device)
    grad = torch.randn_like(x)

    def step():
        layer(x, cos, sin, docs).backward(grad)
    return step


def attention_rows(cfg, seqs, args, device, dtype) -> list[str]:
    rows = []
    for seq in seqs:
        for name, variant in attention_variants(device).items():
            if isinstance(variant, str):
                rows.append(f"| layer fwd+bwd | {seq} | {name} | {variant} |")
                continue
            kernel, deterministic, packed = variant
            torch.use_deterministic_algorithms(deterministic)
            try:
                ms = timed(layer_step(cfg, seq, kernel, packed, device, dtype), args.iters, args.warmup, device)
            finally:
                torch.use_deterministic_algorithms(False)
            rows.append(f"| layer fwd+bwd | {seq} | {name} | {ms:.3f} |")
    return rows


def kernel_steps(cfg, seq: int, device: torch.device, dtype: torch.dtype) -> dict:
    """(op, kind) -> a forward + backward closure."""
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    x = torch.randn(seq, h, device=device, dtype=dtype, requires_grad=True)
    w = torch.ones(h, device=device, dtype=dtype, requires_grad=True)
    gate_up = torch.randn(seq, 2 * f, device=device, dtype=dtype, requires_grad=True)
    head = torch.randn(v, h, device=device, dtype=dtype, requires_grad=True) / h ** 0.5
    head = head.detach().requires_grad_(True)
    labels = torch.randint(0, v, (seq,), device=device)
    dy, dg = torch.randn_like(x), torch.randn(seq, f, device=device, dtype=dtype)
    eps = cfg.norm_epsilon
    return {
        ("rms_norm", "compile"): lambda: compile_pure(rms_norm)(x, w, eps).backward(dy),
        ("rms_norm", "liger"): lambda: liger.rms_norm(x, w, eps).backward(dy),
        ("swiglu", "compile"): lambda: compile_pure(swiglu)(gate_up).backward(dg),
        ("swiglu", "liger"): lambda: liger.swiglu(gate_up).backward(dg),
        ("cross_entropy", "compile"): lambda: fused_linear_cross_entropy(
            x, head, labels, compute_dtype=dtype, fused=True).backward(),
        ("cross_entropy", "liger"): lambda: liger.linear_cross_entropy(x, head, labels, dtype, -100).backward(),
    }


def kernel_rows(cfg, seqs, args, device, dtype) -> list[str]:
    rows = []
    can_liger = device.type == "cuda" and liger.liger_installed()
    for seq in seqs:
        for (op, kind), step in kernel_steps(cfg, seq, device, dtype).items():
            if kind == "liger" and not can_liger:
                rows.append(f"| {op} fwd+bwd | {seq} | {kind} | liger-kernel not installed or not on a GPU |")
                continue
            if kind == "compile" and device.type != "cuda":
                rows.append(f"| {op} fwd+bwd | {seq} | {kind} | compile timed on GPUs only |")
                continue
            rows.append(f"| {op} fwd+bwd | {seq} | {kind} | {timed(step, args.iters, args.warmup, device):.3f} |")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama8b")
    parser.add_argument("--seqs", default="4096,8192", help="comma-separated sequence lengths")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", choices=("attention", "kernels"), help="one of the two tables")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = model_preset(args.model)
    seqs = [int(s) for s in args.seqs.split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"bench_attention: {args.model} on {name}, torch {torch.__version__}, FA4 installed: {fa4_installed()}, "
          f"liger installed: {liger.liger_installed()}")
    print("| what | seq | kernel | ms (median) |\n| --- | --- | --- | --- |")
    started = time.perf_counter()
    for key, table in (("attention", attention_rows), ("kernels", kernel_rows)):
        if args.only and key != args.only:
            continue
        for row in table(cfg, seqs, args, device, dtype):
            print(row, flush=True)
    print(f"bench_attention: {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
