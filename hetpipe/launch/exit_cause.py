"""How a rank's process ended, in words: the signal that killed it (and whether the
OOM killer probably sent it), or its exit status.

A process killed by a signal cannot say why itself: only its parent learns the
signal, from the kernel (``waitid``). :func:`ending_of` asks without reaping
(``WNOWAIT``), so the elastic agent, which reaps its workers, still finds them.

SIGKILL is what the kernel's OOM killer sends, but also what ``kill -9``, a
scheduler or a dying node's supervisor sends; so an ending is "probably out of
memory" only with evidence that the OOM killer ran while the rank did: the
``oom_kill`` counter of the rank's memory cgroup (cgroup v2 ``memory.events``,
v1 ``memory.oom_control``), or, where no cgroup counter can be read, the
system-wide one in ``/proc/vmstat``. All of them are readable without
privileges. A torch ``OutOfMemoryError`` on a GPU is an exception, reported by
the rank itself.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC = Path("/proc")


@dataclass(frozen=True)
class Ending:
    """One rank's end: killed by ``signal`` (``core``: it dumped core), or exited with ``status``."""

    rank: int
    pid: int
    signal: Optional[int] = None
    status: Optional[int] = None
    core: bool = False

    @property
    def failed(self) -> bool:
        return self.signal is not None or self.status != 0

    @property
    def signal_name(self) -> str:
        assert self.signal is not None
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"

    def describe(self, oom: Optional[str] = None) -> str:
        """``rank 1 (pid 4242) was killed by SIGKILL, probably ...`` or ``... exited with status 7``."""
        who = f"rank {self.rank} (pid {self.pid})"
        if self.signal is None:
            return f"{who} exited with status {self.status}"
        how = f"{who} was killed by {self.signal_name}{' (core dumped)' if self.core else ''}"
        if oom is not None and self.signal == signal.SIGKILL:
            how += f", probably by the kernel's out-of-memory killer ({oom})"
        return how


def ending_of(pid: int, rank: int) -> Optional[Ending]:
    """How child ``pid`` ended, without reaping it; None while it runs or once it was reaped."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already (by the agent), or not our child
        return None
    if info is None or info.si_pid == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return Ending(rank, pid, status=info.si_status)
    return Ending(rank, pid, signal=info.si_status, core=info.si_code == os.CLD_DUMPED)


def ending_from_exitcode(rank: int, pid: int, exitcode: int) -> Ending:
    """An :class:`Ending` from a Popen-style exit code (negative: killed by that signal)."""
    return Ending(rank, pid, signal=-exitcode) if exitcode < 0 else Ending(rank, pid, status=exitcode)


class OomCounters:
    """The OOM-kill counters that cover process ``pid``, read when it starts, to
    tell later whether the OOM killer ran while it lived."""

    def __init__(self, pid: int, proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> None:
        self._counters = _cgroup_counters(pid, proc, cgroup_root)
        if not self._counters:  # no memory cgroup to read: the machine's own count
            self._counters = [(proc / "vmstat", "oom_kill", "the system's oom_kill count (/proc/vmstat)")]
        self._before = {path: _read_counter(path, key) for path, key, _ in self._counters}

    def evidence(self) -> Optional[str]:
        """``the oom_kill count of memory cgroup /job rose from 0 to 1``, or None."""
        for path, key, label in self._counters:
            before, now = self._before[path], _read_counter(path, key)
            if before is not None and now is not None and now > before:
                return f"{label} rose from {before} to {now}"
        return None


def _cgroup_counters(pid: int, proc: Path, root: Path) -> list[tuple[Path, str, str]]:
    """(file, counter, label) of ``pid``'s memory cgroup: v2 memory.events, v1 memory.oom_control.
    Inside a cgroup namespace the path that /proc shows is relative to the mount, so the
    mount's own file is the fallback."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":  # cgroup v2 (the unified hierarchy)
            base, name = root, "memory.events"
        elif "memory" in controllers.split(","):  # cgroup v1
            base, name = root / "memory", "memory.oom_control"
        else:
            continue
        for candidate, shown in ((base / rel / name, path), (base / name, "at the mount's root")):
            if _read_counter(candidate, "oom_kill") is not None:
                found.append((candidate, "oom_kill", f"the oom_kill count of memory cgroup {shown} ({name})"))
                break
    return found


def _read_counter(path: Path, key: str) -> Optional[int]:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return None
    return None
