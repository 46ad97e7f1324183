"""One-step GPU profile (``train.profile_step=N``): where a step's time goes.

Megatron-LM has ``--profile`` (nsys ranges) and torchtitan a torch.profiler
schedule that writes traces; a pipeline rank's question is usually simpler:
how much of the step its GPU was busy, and with what. Step ``N`` runs under
``torch.profiler`` on every GPU rank, and each writes
``profile_rank<r>.txt`` to the run directory:

* the step's wall time and the time at least one kernel ran (the union over
  all streams), so the rest is the GPU waiting (pipeline bubble, boundary
  receives, host work); and the same union without communication kernels,
  which on an NCCL/RCCL boundary occupy the GPU while they wait;
* kernel time by class (GEMM, attention, communication, copies, other -
  mostly elementwise and reductions), summed over streams (overlapping
  kernels count twice);
* the 25 kernels with the most time.

The profiled step is slower than the others (the profiler records every
launch); benchmarks should not time it.
"""
from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path
from typing import Iterator

import torch

_CLASSES = (
    ("communication", re.compile(r"nccl|rccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul|_mm_", re.I)),
    ("copies", re.compile(r"^Memcpy|^Memset|memcpy|memset", re.I)),
)


def kernel_class(name: str) -> str:
    for label, pattern in _CLASSES:
        if pattern.search(name):
            return label
    return "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@contextlib.contextmanager
def profile_step(enabled: bool, run_dir: Path, rank: int, step: int) -> Iterator[None]:
    """Profile the block (one training step) on a CUDA rank when ``enabled``."""
    if not enabled or not torch.cuda.is_available():
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - start) * 1e6
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    write_report(run_dir / f"profile_rank{rank}.txt", rank, step, wall_us,
                 [(e.name, e.time_range.start, e.time_range.end) for e in kernels])


def write_report(path: Path, rank: int, step: int, wall_us: float,
                 kernels: list[tuple[str, float, float]]) -> None:
    """The text report from (name, start_us, end_us) of every kernel of the step."""
    busy = _union_us([(a, b) for _, a, b in kernels])
    # NCCL/RCCL kernels occupy the GPU while they wait for their peer, so "busy"
    # counts a boundary's waits; the compute union leaves them out.
    computing = _union_us([(a, b) for name, a, b in kernels if kernel_class(name) != "communication"])
    by_class: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for name, a, b in kernels:
        by_class[kernel_class(name)] = by_class.get(kernel_class(name), 0.0) + (b - a)
        entry = by_name.setdefault(name, [0.0, 0])
        entry[0] += b - a
        entry[1] += 1
    lines = [f"rank {rank}, step {step}: wall {wall_us / 1e3:.1f} ms, GPU busy (any stream) {busy / 1e3:.1f} ms "
             f"({100 * busy / wall_us:.1f} %), {len(kernels)} kernels",
             f"GPU computing (communication kernels left out) {computing / 1e3:.1f} ms "
             f"({100 * computing / wall_us:.1f} %)", "",
             "kernel time by class (summed over streams):"]
    for label, t in sorted(by_class.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {label:<14} {t / 1e3:10.1f} ms  {100 * t / wall_us:5.1f} % of wall")
    lines += ["", "top kernels:"]
    for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]:
        lines.append(f"  {t / 1e3:10.1f} ms  {n:6d}x  {name[:150]}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
