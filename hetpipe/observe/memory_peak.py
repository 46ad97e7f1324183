"""What holds a GPU rank's memory at its peak (``train.memory_snapshot_step=N``).

The planner predicts each stage's peak (partitioner/schedule_model.py); when a
run's measured peak is above that, the question is which tensors were alive at
the moment of the peak. Step ``N`` runs with the CUDA caching allocator's
history on (Python frames only, hetpipe/process/torch_compat.py, as
torchtitan's ``profiling.enable_memory_snapshot``), and each GPU rank writes
to the run directory:

* ``memory_snapshot_rank<r>.pickle``: the allocator's snapshot, for
  https://pytorch.org/memory_viz;
* ``memory_peak_rank<r>.txt``: the step's peak of allocated bytes, the bytes
  that were allocated before the step and still are at the peak (weights,
  gradients, optimizer state), and the step's own allocations alive at the
  peak grouped by where they were made: the engine's action (its frame in
  hetpipe/training/engine.py) and the innermost frame of hetpipe's code.

Recording slows the step (a Python stack per allocation); benchmarks should
not time it. CPU ranks have no allocator history and write nothing.
"""
from __future__ import annotations

import contextlib
import pickle
from pathlib import Path
from typing import Iterator, Optional

import torch

from hetpipe.process.torch_compat import allocator_snapshot, record_allocator_history

GIB = 2**30
# Frames of these files are the library's, not a place a user can act on.
_LIBRARY = ("/torch/", "/contextlib.py", "/threading.py", "<frozen", "/functools.py")
_ENGINE = "training/engine.py"
# A step's allocator history: far more than a LLaMA-3-8B PP2 step at seq 8192
# makes (each entry is a few hundred bytes without C++ frames).
_MAX_ENTRIES = 2_000_000


@contextlib.contextmanager
def memory_snapshot_step(enabled: bool, run_dir: Path, rank: int, step: int) -> Iterator[None]:
    """Record the block's (one training step's) allocations on a CUDA rank when ``enabled``."""
    if not enabled or not torch.cuda.is_available():
        yield
        return
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    record_allocator_history(_MAX_ENTRIES)
    try:
        yield
        torch.cuda.synchronize()
        snapshot = allocator_snapshot()
    finally:
        record_allocator_history(None)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"memory_snapshot_rank{rank}.pickle").write_bytes(pickle.dumps(snapshot))
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    (run_dir / f"memory_peak_rank{rank}.txt").write_text(peak_report(trace, before, rank, step))


def peak_report(trace: list[dict], before: int, rank: int, step: int) -> str:
    """The text report of one step's allocator ``trace`` (the snapshot's
    device_traces entry: alloc and free_requested events with size and
    frames), ``before`` the bytes allocated when it began."""
    live: dict[int, dict] = {}
    freed_old = level = peak = 0
    at_peak: dict[int, dict] = {}
    old_at_peak = before
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            level += event["size"]
        elif event["action"] == "free_requested":
            level -= event["size"]
            if live.pop(event["addr"], None) is None:
                freed_old += event["size"]  # allocated before the step
        if level > peak:
            peak, at_peak, old_at_peak = level, dict(live), before - freed_old
    groups: dict[tuple[str, str], list[int]] = {}
    for event in at_peak.values():
        entry = groups.setdefault(_where(event.get("frames", [])), [0, 0])
        entry[0] += event["size"]
        entry[1] += 1
    lines = [f"rank {rank}, step {step}: peak allocated {(before + peak) / GIB:.2f} GiB; "
             f"{before / GIB:.2f} GiB allocated when the step began, {old_at_peak / GIB:.2f} GiB of it still "
             f"at the peak; {peak / GIB:.2f} GiB allocated in the step and alive at the peak "
             f"({len(at_peak)} blocks)", "", "the step's blocks alive at the peak, by where they were made:",
             f"  {'GiB':>8} {'blocks':>6}  engine action | innermost hetpipe frame"]
    for (action, frame), (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {size / GIB:8.3f} {count:6d}  {action} | {frame}")
    return "\n".join(lines) + "\n"


def _where(frames: list[dict]) -> tuple[str, str]:
    """(the engine's frame, the innermost frame of hetpipe's code) of an allocation's stack."""
    own = [f for f in frames if not any(part in f["filename"] for part in _LIBRARY)]
    engine = next((f["name"] for f in own if f["filename"].endswith(_ENGINE)), "-")
    return engine, _describe(own[0]) if own else "-"


def _describe(frame: dict) -> str:
    path = frame["filename"]
    cut: Optional[int] = None
    for root in ("/hetpipe/", "/models/", "/comm/", "/partitioner/"):
        index = path.rfind(root)
        if index >= 0 and (cut is None or index < cut):
            cut = index
    return f"{path[cut + 1:] if cut is not None else path}:{frame['line']} {frame['name']}"
