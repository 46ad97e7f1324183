"""End the ranks of a failing attempt that hang, so the job ends when its cause is known.

When a rank fails, torch stops the others with SIGTERM and waits 30 s before
SIGKILL (``ProcessContext.join`` for the local launcher's ranks, the
subprocess context's ``close`` under torchrun), inside the agent's poll of
its workers. A rank that is stopped (SIGSTOP, a debugger) or stuck where
Python never runs its handlers does not act on SIGTERM, so a job whose rank
froze printed its cause at deadline + 2 s and exited 30 s later
(``deadline_s=20``: the line at 22 s, exit 3 at 54 s).

:class:`HungRanks` watches one attempt's workers beside that poll. Once the
attempt is failing - a verdict is posted in the job's store, or a rank died
(:mod:`hetpipe.launch.job_watch`, :mod:`hetpipe.launch.agent`) - nothing is
left to save: it SIGKILLs a stopped rank at once and any other still there
after a grace. A preemption, which has no verdict, keeps torch's timeout for
the ranks' checkpoints. The launcher leaves the ranks it killed out of the
job's cause: their death is its doing, not the failure.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

# /proc/PID/stat's states of a process that cannot act on SIGTERM until someone
# continues it: stopped by a signal, or by a tracer.
STOPPED_STATES = ("T", "t")
# Exited (a zombie until its parent reaps it) or gone.
GONE_STATES = ("Z", "X", "x")
# Asking whether the attempt is failing costs a store request: four a second,
# as every rank's own watch asks (job_watch._POLL_S).
_ENDING_POLL_S = 0.25
# Once it is, the ranks' states are read from /proc, twenty times a second.
_KILL_POLL_S = 0.05


class HungRanks(threading.Thread):
    """Once ``failing()`` is true, SIGKILL each of ``pids`` that is stopped at once and any
    still running ``grace_s`` later (see the module)."""

    def __init__(self, pids: Sequence[int], failing: Callable[[], bool], grace_s: float, attempt: int) -> None:
        super().__init__(daemon=True, name=f"hetpipe-hung-ranks-{attempt}")
        self._pids = list(pids)
        self._failing = failing
        self._grace_s = grace_s
        self._closed = threading.Event()
        self.killed: set[int] = set()  # read by the agent when it names the cause

    def close(self) -> None:
        self._closed.set()

    def run(self) -> None:
        while not self._failing():
            if self._closed.wait(_ENDING_POLL_S) or not self._running():
                return
        until = time.monotonic() + self._grace_s
        while self._running() and not self._closed.is_set():
            late = time.monotonic() >= until
            for pid in self._running():
                if (late or process_state(pid) in STOPPED_STATES) and _kill(pid):
                    self.killed.add(pid)
            time.sleep(_KILL_POLL_S)

    def _running(self) -> list[int]:
        return [pid for pid in self._pids if pid not in self.killed and process_state(pid) not in GONE_STATES]


def process_state(pid: int, proc: Path = Path("/proc")) -> str:
    """The state letter of ``pid`` (``R``, ``S``, ``T``, ``Z``...), or ``X`` once it is gone."""
    try:
        return (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def _kill(pid: int) -> bool:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
        return True
    return False
