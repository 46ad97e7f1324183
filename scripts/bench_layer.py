#!/usr/bin/env python3
"""Decoder layers alone, forward + backward at full size on one GPU: how fast
each way of running the elementwise work is, and how long it takes to compile.

A stage's layers run exactly as in training's bf16 mode: bf16 working copies
of the fp32 weights (hetpipe.precision.Bf16Weights, with gradient-accumulation
fusion where the trainer uses it), a bf16 input that needs a gradient (like a
received boundary activation), microbatches accumulated into fp32 gradients.
Variants:

  eager     plain PyTorch (train.fuse_elementwise=false, train.compile=false)
  fused     elementwise regions compiled (train.fuse_elementwise=true, the
            default on GPUs)
  compile   whole layers compiled (train.compile=true; no accumulation fusion)

Any variant takes a ``+BACKEND`` suffix (``fused+cudnn``, ``eager+flash``):
the SDPA backend the layers prefer (train.attention_backend; without a suffix,
torch's own choice). ``--unit head`` times the output head instead (final
norm, logits and the chunked cross-entropy with its gradients; Megatron's
logits FLOPs): ``eager`` is the eager loss, ``fused`` the compiled per-chunk
loss (what train.fuse_elementwise switches on there); a ``+chunkN`` suffix
sets the loss's tokens per chunk (default: hetpipe.models.loss's choice).

Prints, per variant: the first iteration's time (kernel loading and
compilation), milliseconds per layer and microbatch, TFLOP/s by Megatron's
formula (the layer's share, no logits), peak memory and the number of graphs
dynamo compiled (a number growing with --layers means recompilation per
layer). ``--profile DIR`` writes one profiled iteration per variant
(profile_<variant>.txt, as train.profile_step does). Run with
TORCH_LOGS=recompiles,graph_breaks to see why dynamo recompiles.

  python scripts/bench_layer.py --model llama8b --seq-length 8192 --layers 4 --variants eager,fused,compile
  python scripts/bench_layer.py --model llama8b --variants fused,fused+cudnn,fused+flash
  python scripts/bench_layer.py --model llama8b --unit head --variants eager,fused,fused+chunk523
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional

import torch

from hetpipe.models import build_model
from hetpipe.models.model_config import model_preset
from hetpipe.models.layers import ATTENTION_BACKENDS, fuse_elementwise, set_attention_backend
from hetpipe.precision import Bf16Weights
from hetpipe.profiling import profile_step

VARIANTS = ("eager", "fused", "compile")


def layer_flops(cfg, seq_length: int) -> float:
    """Megatron's formula for one layer, one sequence, forward + backward (no logits)."""
    h = cfg.hidden_size
    attention = (1 + cfg.num_query_groups / cfg.num_attention_heads + seq_length / h) \
        * cfg.num_attention_heads * cfg.head_dim / h
    return 12.0 * seq_length * h * h * (attention + cfg.ffn_hidden_size / h * 1.5)


def head_flops(cfg, seq_length: int) -> float:
    """Megatron's logits term for one sequence, forward + backward."""
    return 6.0 * seq_length * cfg.hidden_size * cfg.vocab_size


def split_variant(variant: str) -> tuple[str, str, Optional[int]]:
    """``fused+cudnn+chunk512`` -> ("fused", "cudnn", 512); no backend suffix ->
    torch's own backend; no chunk suffix -> the loss's own chunk size (None)."""
    kind, *suffixes = variant.split("+")
    backend, chunk = "auto", None
    for suffix in suffixes:
        if suffix.startswith("chunk") and suffix[5:].isdigit() and int(suffix[5:]) > 0:
            chunk = int(suffix[5:])
        else:
            backend = suffix
    return kind, backend, chunk


def run_variant(args, cfg, variant: str) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    torch.cuda.reset_peak_memory_stats()
    kind, backend, chunk_tokens = split_variant(variant)
    head = args.unit == "head"
    units = (cfg.num_units - 1, cfg.num_units) if head else (1, 1 + args.layers)
    chunk = build_model(cfg, seed=1, units=units, device="cuda")
    set_attention_backend(chunk, backend)
    if head:
        chunk.head.chunk_tokens = chunk_tokens
    if kind == "fused":
        fuse_elementwise(chunk)
    if kind == "compile":
        for layer in chunk.layers.values():
            layer.compile()
    weights = Bf16Weights([chunk], fuse_linear_grads=kind != "compile")
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, args.seq_length, cfg.hidden_size)
    x = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
    grad_y = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, cfg.vocab_size, shape[:2], generator=gen, device="cuda")

    def iteration(microbatches: int) -> None:
        weights.refresh()
        for _ in range(microbatches):
            with weights.swap(0):
                y = chunk(x, labels) if head else chunk(x)
            if head:
                y.backward()
            else:
                y.backward(grad_y)

    t0 = time.perf_counter()
    iteration(1)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    iteration(args.microbatches)  # warm
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        iteration(args.microbatches)
    end.record()
    torch.cuda.synchronize()
    per_unit = 1 if head else args.layers
    ms = start.elapsed_time(end) / (args.iters * args.microbatches * per_unit)
    if args.profile:
        with profile_step(True, Path(args.profile), 0, 0):
            iteration(args.microbatches)
        report = Path(args.profile) / "profile_rank0.txt"
        report.rename(report.with_name(f"profile_{variant}.txt"))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    result = {"variant": variant, "first_s": first_s, "ms_per_layer": ms,
              "tflops": (head_flops if head else layer_flops)(cfg, args.seq_length) / (ms * 1e-3) / 1e12,
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "graphs": graphs}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama8b")
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--unit", choices=("layer", "head"), default="layer",
                        help="time decoder layers (--layers of them) or the output head with its loss")
    parser.add_argument("--profile", default=None, help="directory for one profiled iteration per variant")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if split_variant(v)[0] not in VARIANTS
               or split_variant(v)[1] not in ATTENTION_BACKENDS
               or (args.unit == "head" and split_variant(v)[0] == "compile")
               or (args.unit != "head" and split_variant(v)[2] is not None)]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)} (not compile with "
                     f"--unit head), each optionally +BACKEND with BACKEND one of {', '.join(ATTENTION_BACKENDS[1:])}"
                     f" and, with --unit head, +chunkN (N tokens per loss chunk)")
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA (or ROCm) GPU")
    cfg = model_preset(args.model)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.model}, seq {args.seq_length}, "
          f"{'the head' if args.unit == 'head' else f'{args.layers} layers'} x {args.microbatches} microbatches x {args.iters} timed iterations", flush=True)
    rows = []
    for variant in variants:
        rows.append(run_variant(args, cfg, variant))
        torch.cuda.empty_cache()  # the variant's model is gone
        print(rows[-1], flush=True)
    base = next((r for r in rows if r["variant"] == "eager"), rows[0])
    print(f"\n| variant | first iteration s | ms per {args.unit}-microbatch | TFLOP/s | vs {base['variant']} | peak GiB | graphs |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['variant']} | {r['first_s']:.1f} | {r['ms_per_layer']:.2f} | {r['tflops']:.1f} | "
              f"{base['ms_per_layer'] / r['ms_per_layer']:.3f} | {r['peak_gib']:.1f} | {r['graphs']} |")


if __name__ == "__main__":
    main()
