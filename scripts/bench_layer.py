#!/usr/bin/env python3
"""Decoder layers alone, forward + backward at full size on one GPU: how fast
each way of running the elementwise work is, and how long it takes to compile.

A stage's layers run exactly as in training's bf16 mode: bf16 working copies
of the fp32 weights (hetpipe.models.precision.Bf16Weights, with gradient-accumulation
fusion where the trainer uses it), a bf16 input that needs a gradient (like a
received boundary activation), microbatches accumulated into fp32 gradients.
Variants:

  eager     plain PyTorch (train.fuse_elementwise=false, train.compile=false)
  fused     elementwise regions compiled (train.fuse_elementwise=true, the
            default on GPUs)
  compile   whole layers compiled (train.compile=true; no accumulation fusion)

Any variant takes a ``+BACKEND`` suffix (``fused+cudnn``, ``eager+flash``):
the SDPA backend the layers prefer (train.attention_backend; without a suffix,
torch's own choice), and a ``+recompute=MODE`` suffix (``fused+recompute=full``):
activation recomputation of every layer (train.recompute: none, selective or
full; see hetpipe/models/recompute.py), and a ``+split`` suffix (``fused+split``;
layers, eager or fused, no recomputation): besides the variant's own row, the
backward split of the zero-bubble schedules (hetpipe/models/split_backward.py)
timed phase by phase: F (forward), B (``backward_input``, the input gradient,
the fused linears' weight GEMMs queued) and W (``WeightBackward.run``, the
weight gradients), against F and the fused backward of the same layers, run
alternately in each iteration; (B+W)/fused is the price of splitting. A split
variant's compiled regions run without donated buffers (which forbid B's
retain_graph), in its fused-backward timings too. ``--unit head`` times the output head instead (final
norm, logits and the chunked cross-entropy with its gradients; Megatron's
logits FLOPs): ``eager`` is the eager loss, ``fused`` the compiled per-chunk
loss (what train.fuse_elementwise switches on there); a ``+chunkN`` suffix
sets the loss's tokens per chunk (default: hetpipe.models.loss's choice).

Prints, per variant: the first iteration's time (kernel loading and
compilation), milliseconds per layer and microbatch, TFLOP/s by Megatron's
formula (the layer's share, no logits; recomputation is not model FLOPs), the
activations a layer keeps per microbatch for its backward (counted with
saved-tensor hooks), peak memory (GPU) and the number of graphs
dynamo compiled (a number growing with --layers means recompilation per
layer). Without a GPU it runs on the CPU in fp32, as the trainer does there
(tiny shapes only: ``--model tiny_llama --seq-length 64``), with no peak
memory. ``--profile DIR`` writes one profiled iteration per variant
(profile_<variant>.txt, as train.profile_step does). Run with
TORCH_LOGS=recompiles,graph_breaks to see why dynamo recompiles.

  python scripts/bench_layer.py --model llama8b --seq-length 8192 --layers 4 --variants eager,fused,compile
  python scripts/bench_layer.py --model llama8b --variants fused,fused+cudnn,fused+flash
  python scripts/bench_layer.py --model llama8b --unit head --variants eager,fused,fused+chunk523
  python scripts/bench_layer.py --model llama8b --seq-length 8192 --layers 4 \
      --variants fused,fused+recompute=selective,fused+recompute=full
  python scripts/bench_layer.py --model llama8b --seq-length 8192 --layers 4 --variants fused+split
"""
from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from typing import Optional

import torch

from hetpipe.models import build_model
from hetpipe.models.model_config import model_preset
from hetpipe.models.layers import ATTENTION_BACKENDS, fuse_elementwise, set_attention_backend
from hetpipe.models.recompute import RECOMPUTE_MODES, set_recompute
from hetpipe.models.split_backward import backward_input
from hetpipe.partitioner.profile import saved_tensor_bytes, weight_storages
from hetpipe.models.precision import Bf16Weights, compute_context
from hetpipe.process.torch_compat import compiled_graph_count, donated_buffers_off, reset_compiler
from hetpipe.observe.profiling import profile_step

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


def split_variant(variant: str) -> tuple[str, str, Optional[int], str, bool]:
    """``fused+cudnn+chunk512+recompute=full`` -> ("fused", "cudnn", 512, "full", False);
    no backend suffix -> torch's own backend; no chunk suffix -> the loss's own
    chunk size (None); no recompute suffix -> none; ``+split`` -> True."""
    kind, *suffixes = variant.split("+")
    backend, chunk, recompute, split = "auto", None, "none", False
    for suffix in suffixes:
        if suffix.startswith("chunk") and suffix[5:].isdigit() and int(suffix[5:]) > 0:
            chunk = int(suffix[5:])
        elif suffix.startswith("recompute="):
            recompute = suffix[len("recompute="):]
        elif suffix == "split":
            split = True
        else:
            backend = suffix
    return kind, backend, chunk, recompute, split


def invalid_variant(variant: str, unit: str) -> bool:
    kind, backend, chunk, recompute, split = split_variant(variant)
    head = unit == "head"
    return (kind not in VARIANTS or backend not in ATTENTION_BACKENDS or recompute not in RECOMPUTE_MODES
            or (head and (kind == "compile" or recompute != "none" or split))
            or (not head and chunk is not None)
            or (kind == "compile" and (recompute != "none" or split))
            # Recomputation would rerun the forward in B and again for W's reruns.
            or (split and recompute != "none"))


class Stamps:
    """Points on the timeline the work runs on: CUDA events on a GPU (recorded
    without waiting for the GPU), the host clock on a CPU (where work is synchronous)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.points: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points.append(event)
        else:
            self.points.append(time.perf_counter())

    def phase_ms(self, phases: int) -> list[float]:
        """Milliseconds in each of the ``phases`` intervals between the ``phases + 1``
        marks of every round, summed over the rounds (after a synchronize)."""
        rounds = [self.points[i:i + phases + 1] for i in range(0, len(self.points), phases + 1)]
        if self.cuda:
            return [sum(r[k].elapsed_time(r[k + 1]) for r in rounds) for k in range(phases)]
        return [sum(r[k + 1] - r[k] for r in rounds) * 1e3 for k in range(phases)]


def run_variant(args, cfg, variant: str, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    reset_compiler()  # graphs are counted per variant
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    kind, backend, chunk_tokens, recompute, split = split_variant(variant)
    head = args.unit == "head"
    units = (cfg.num_units - 1, cfg.num_units) if head else (1, 1 + args.layers)
    chunk = build_model(cfg, seed=1, units=units, device=device)
    set_attention_backend(chunk, backend)
    set_recompute(chunk, recompute)
    if head:
        chunk.head.chunk_tokens = chunk_tokens
    if kind == "fused":
        fuse_elementwise(chunk)
    if kind == "compile":
        for layer in chunk.layers.values():
            layer.compile()
    # The trainer's precision: bf16 working copies on GPUs, fp32 on CPUs.
    precision = "bf16" if cuda else "fp32"
    weights = Bf16Weights([chunk], fuse_linear_grads=kind != "compile") if cuda else None
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (1, args.seq_length, cfg.hidden_size)
    dtype = torch.bfloat16 if cuda else torch.float32
    x = torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_()
    grad_y = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    labels = torch.randint(0, cfg.vocab_size, shape[:2], generator=gen, device=device)

    def forward() -> torch.Tensor:
        with compute_context(precision, device.type, weights, 0):
            return chunk(x, labels) if head else chunk(x)

    def backward(y: torch.Tensor) -> None:
        if head:
            y.backward()
        else:
            y.backward(grad_y)

    def iteration(microbatches: int) -> None:
        if weights is not None:
            weights.refresh()
        for _ in range(microbatches):
            backward(forward())

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    iteration(1)
    sync()
    first_s = time.perf_counter() - t0
    iteration(args.microbatches)  # warm
    sync()
    per_unit = 1 if head else args.layers
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        iteration(args.microbatches)
    if cuda:
        end.record()
        torch.cuda.synchronize()
        elapsed_ms = start.elapsed_time(end)
    else:
        elapsed_ms = (time.perf_counter() - t0) * 1e3
    ms = elapsed_ms / (args.iters * args.microbatches * per_unit)
    # One more microbatch, untimed, to count what the layers keep for the backward.
    with saved_tensor_bytes(weight_storages(chunk, weights)) as saved:
        y = forward()
    kept_mib = sum(saved.values()) / per_unit / 2**20
    backward(y)
    del y
    if args.profile:
        with profile_step(True, Path(args.profile), 0, 0):
            iteration(args.microbatches)
        report = Path(args.profile) / "profile_rank0.txt"
        report.rename(report.with_name(f"profile_{variant}.txt"))
    phases = time_split(args, forward, x, grad_y, weights, sync, cuda, per_unit) if split else None
    graphs = compiled_graph_count()
    result = {"variant": variant, "first_s": first_s, "ms_per_layer": ms,
              "tflops": (head_flops if head else layer_flops)(cfg, args.seq_length) / (ms * 1e-3) / 1e12,
              "kept_mib": kept_mib, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
              "graphs": graphs, "phases": phases}
    return result


def time_split(args, forward, x: torch.Tensor, grad_y: torch.Tensor, weights: Optional[Bf16Weights], sync,
               cuda: bool, per_unit: int) -> dict:
    """Milliseconds per layer and microbatch of F, B and W (split backward) and
    of F and the fused backward, each iteration running its microbatches
    fused and then split, so that clock and thermal drift hit both alike. W
    follows its own B at once: the cost of splitting, not a schedule's order."""
    fused, split = Stamps(cuda), Stamps(cuda)

    def microbatch_split(stamps: Stamps) -> None:
        stamps.mark()
        y = forward()
        stamps.mark()
        _, weight_backward = backward_input(y, grad_y, x)
        stamps.mark()
        weight_backward.run()
        stamps.mark()

    microbatch_split(Stamps(cuda))  # warm, untimed: B's and W's own kernels and graph walks
    sync()
    for _ in range(args.iters):
        if weights is not None:
            weights.refresh()
        for _ in range(args.microbatches):
            fused.mark()
            y = forward()
            fused.mark()
            y.backward(grad_y)
            fused.mark()
            del y
        for _ in range(args.microbatches):
            microbatch_split(split)
    sync()
    n = args.iters * args.microbatches * per_unit
    f_fused, backward = (ms / n for ms in fused.phase_ms(2))
    f, b, w = (ms / n for ms in split.phase_ms(3))
    return {"f_ms": f, "b_ms": b, "w_ms": w, "f_fused_ms": f_fused, "fused_backward_ms": backward}


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
    unknown = [v for v in variants if invalid_variant(v, args.unit)]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)} (not compile with "
                     f"--unit head), each optionally +BACKEND with BACKEND one of {', '.join(ATTENTION_BACKENDS[1:])},"
                     f" +recompute=MODE with MODE one of {', '.join(RECOMPUTE_MODES)} (layers, not compile),"
                     f" +split (layers, eager or fused, no recompute)"
                     f" and, with --unit head, +chunkN (N tokens per loss chunk)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = model_preset(args.model)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (fp32)"
    print(f"{name}, torch {torch.__version__}; {args.model}, seq {args.seq_length}, "
          f"{'the head' if args.unit == 'head' else f'{args.layers} layers'} x {args.microbatches} microbatches x {args.iters} timed iterations", flush=True)
    rows = []
    for variant in variants:
        # B keeps the graph for W (retain_graph), which compiled backwards
        # refuse when they reuse ("donate") saved buffers; the split variant's
        # fused-backward timings run under the same setting, so the two compare.
        donation = (donated_buffers_off() if split_variant(variant)[4]
                    else contextlib.nullcontext())
        with donation:
            rows.append(run_variant(args, cfg, variant, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the variant's model is gone
        print(rows[-1], flush=True)
    base = next((r for r in rows if r["variant"] == "eager"), rows[0])
    print(f"\n| variant | first iteration s | ms per {args.unit}-microbatch | TFLOP/s | vs {base['variant']} | "
          f"kept MiB per {args.unit} | peak GiB | graphs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        print(f"| {r['variant']} | {r['first_s']:.1f} | {r['ms_per_layer']:.2f} | {r['tflops']:.1f} | "
              f"{base['ms_per_layer'] / r['ms_per_layer']:.3f} | {r['kept_mib']:.1f} | {peak} | {r['graphs']} |")
    split_rows = [r for r in rows if r["phases"]]
    if split_rows:
        print("\nBackward split (zero-bubble B and W) against the fused backward, ms per layer-microbatch:")
        print("| variant | F ms | B ms | W ms | B+W ms | F ms (fused run) | fused backward ms | (B+W)/fused |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in split_rows:
            ph = r["phases"]
            bw = ph["b_ms"] + ph["w_ms"]
            print(f"| {r['variant']} | {ph['f_ms']:.2f} | {ph['b_ms']:.2f} | {ph['w_ms']:.2f} | {bw:.2f} | "
                  f"{ph['f_fused_ms']:.2f} | {ph['fused_backward_ms']:.2f} | {bw / ph['fused_backward_ms']:.3f} |")


if __name__ == "__main__":
    main()
