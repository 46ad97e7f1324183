"""Starting test ranks and collecting their results, shared by the multi-process tests.

:data:`CTX` starts each rank as a fork of one server per pytest worker that
imported torch and hetpipe once (multiprocessing's forkserver, as
hetpipe.launch.local starts a job's ranks), not as a fresh interpreter that
imports them again: a spawned rank spent about 2.6 CPU-s before running its
target (docs/benchmarks.md, "The suite's time"). A rank runs its target in the
environment of the test that started it, as a spawned one would.

Each child puts ``(rank, "ok", value)`` or ``(rank, "error", traceback)`` on a
queue; :func:`collect` starts the processes, waits for every rank within one
deadline, fails with the child's traceback, and always reaps the children.
"""
from __future__ import annotations

import multiprocessing
import os
import queue
import time
from typing import Any, Callable, Sequence

import pytest

from hetpipe.process.torch_compat import RANK_PRELOAD

# What the ranks' server imports before it forks the first rank.
PRELOAD = [*RANK_PRELOAD, "torch.distributed", "hetpipe.training.trainer"]


def _in_env(env: dict[str, str], target: Callable[..., Any], *args: Any) -> Any:
    os.environ.clear()
    os.environ.update(env)
    return target(*args)


class RankContext:
    """``Process`` and ``Queue`` as a multiprocessing context offers them, for ranks
    forked from a server that preloaded :data:`PRELOAD`."""

    def __init__(self) -> None:
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)

    def Queue(self) -> Any:  # noqa: N802 - multiprocessing's name
        return self._ctx.Queue()

    def Process(self, target: Callable[..., Any], args: tuple = (), daemon: bool = True) -> Any:  # noqa: N802
        return self._ctx.Process(target=_in_env, args=(dict(os.environ), target, *args), daemon=daemon)


CTX = RankContext()


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
