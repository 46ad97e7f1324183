"""Collecting results from spawned test ranks, shared by the multi-process tests.

Each child puts ``(rank, "ok", value)`` or ``(rank, "error", traceback)`` on a
queue; :func:`collect` starts the processes, waits for every rank within one
deadline, fails with the child's traceback, and always reaps the children.
"""
from __future__ import annotations

import queue
import time
from typing import Any, Sequence

import pytest


def collect(procs: Sequence[Any], results: Any, timeout: float) -> dict[int, Any]:
    for proc in procs:
        proc.start()
    world = len(procs)
    out: dict[int, Any] = {}
    try:
        until = time.monotonic() + timeout
        while len(out) < world:
            try:
                rank, status, value = results.get(timeout=max(until - time.monotonic(), 0.1))
            except queue.Empty:
                pytest.fail(f"ranks {sorted(set(range(world)) - set(out))} gave no result in {timeout} s")
            assert status == "ok", f"rank {rank} failed:\n{value}"
            out[rank] = value
    finally:
        for proc in procs:
            proc.join(10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
    return out
