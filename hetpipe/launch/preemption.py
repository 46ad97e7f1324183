"""Preemption: a signal asks the run to stop; every rank finishes its step,
a checkpoint is written, and the job exits 0.

Slurm preempts a job by sending SIGTERM to its processes and SIGKILL after
``KillWait`` (30 s by default); ``sbatch --signal=USR1@120`` sends SIGUSR1
that long before the time limit. The signal reaches ranks at different
moments (a launcher forwards it, a scheduler signals every process), so a
rank only notes it; the ranks agree on the stop through the step's gradient
exchange (every rank's flag rides on it, :class:`hetpipe.training.gradients.ClipResult`),
which puts every rank's stop after the same step.

Under a launcher (:mod:`hetpipe.launch`), each rank leaves a marker in
``$HETPIPE_PREEMPT_DIR`` once its checkpoint is committed, which is how the
launcher tells "preempted and saved" (exit 0) from "killed by the signal".
"""
from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any, Optional, Sequence

PREEMPT_DIR_ENV = "HETPIPE_PREEMPT_DIR"
# The local launcher's directory for the whole launch: its ranks, forked from a
# server started before any attempt (hetpipe.launch.local), inherit no per-attempt
# variable and use <it>/attempt<N> instead.
LAUNCH_DIR_ENV = "HETPIPE_LAUNCH_DIR"


def marker_dir(attempt: int) -> Optional[Path]:
    """Where this rank of restart ``attempt`` leaves its preemption marker, if its launcher asked for one."""
    if os.environ.get(PREEMPT_DIR_ENV):
        return Path(os.environ[PREEMPT_DIR_ENV])
    if os.environ.get(LAUNCH_DIR_ENV):
        return Path(os.environ[LAUNCH_DIR_ENV]) / f"attempt{attempt}"
    return None


class PreemptionWatch:
    """Notes the configured signals (handlers installed on the main thread only)."""

    def __init__(self, signal_names: Sequence[str]) -> None:
        self.received: Optional[str] = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set there; tests driving a rank from a thread
        for name in signal_names:
            number = getattr(signal, name)
            self._previous[number] = signal.signal(number, self._note)

    def _note(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.received is not None

    def close(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()


def write_marker(rank: int, attempt: int, step: int, checkpoint: Optional[Path], signal_name: str) -> None:
    """Tell this rank's launcher that it saved and stops on purpose (if it asked)."""
    directory = marker_dir(attempt)
    if directory is None:
        return
    path = directory / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, "step": step, "signal": signal_name,
                               "checkpoint": str(checkpoint) if checkpoint else None}) + "\n")
    os.replace(tmp, path)
