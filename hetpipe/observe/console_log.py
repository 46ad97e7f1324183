"""The run's console, kept in its run directory as ``pretrain.log``.

What a user sees of a run - the launcher's lines, every rank's (the local
launcher's ranks print through its standard output and error, which their
fork server inherited), warnings and tracebacks - is copied into the run
directory, so that a job run under Slurm or nohup, or one that scrolled
away, can be read afterwards. Hydra's own ``pretrain.log`` holds only what
goes through ``logging``, which hetpipe does not use: it stayed empty.

:func:`start` runs first in ``python -m hetpipe.pretrain``, before the
ranks' fork server starts (hetpipe.launch.local.prestart): standard output
and error become pipes read by a small process of their own, the tee, which
writes every byte on to where it was going and into the log. Output from
before the run directory is known is held (up to :data:`_HELD_BYTES`) until
:func:`keep_in` names the file; a hydra multirun names one per job. The tee
is a process, not a thread, so it outlives a launcher that leaves at once
(``os._exit``, a kill) and still writes its ranks' last lines; it ignores the
stop signals a scheduler or Ctrl-C send to the whole job, and ends when
every writer has closed its end. Under torchrun each process is a rank whose
console is torchrun's, and nothing is kept here.
"""
from __future__ import annotations

import array
import atexit
import fcntl
import os
import select
import signal
import sys
import termios
import time
from pathlib import Path
from typing import Optional

# Output held before the run directory is known: a run's start-up lines, far below this.
_HELD_BYTES = 1 << 20
# The tee ignores these: they reach every process of a job (Slurm's stop, a terminal's Ctrl-C),
# and the tee must write the lines the job prints on its way out.
_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# How long, at most, a launcher that ends waits for the tee to read what is left (it ends as soon as
# the ranks and their fork server are gone, which the launcher sees to first).
_DRAIN_S = 2.0
# What the tee takes to write on a read it made (64 KiB at most) once the pipe is empty.
_WRITE_S = 0.02

_tee: Optional[tuple[int, int]] = None  # (the tee's pid, the write end of its control pipe)


def start() -> None:
    """Route this process's standard output and error through the tee (see the module);
    once per process, and not under torchrun."""
    global _tee
    if _tee is not None or "TORCHELASTIC_RUN_ID" in os.environ:
        return
    out, err, control = os.pipe(), os.pipe(), os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd in (out[1], err[1], control[1]):
            os.close(fd)
        _run_tee(out[0], err[0], control[0])
    for fd in (out[0], err[0], control[0]):
        os.close(fd)
    os.dup2(out[1], 1)
    os.dup2(err[1], 2)
    os.close(out[1])
    os.close(err[1])
    _tee = (pid, control[1])
    atexit.register(drain)  # registered first, run last: after the fork server is stopped


def keep_in(path: Path) -> None:
    """From now on the console goes (also) to ``path``, appended, with what was held so far."""
    if _tee is not None:
        os.write(_tee[1], f"{path}\n".encode())


def drain() -> None:
    """A launcher that ends: wait (briefly) until the tee has read what it was handed, so
    that a terminal's prompt does not come before the job's last line. Not until the tee
    ends: helpers this process started (multiprocessing's resource tracker) hold the pipes
    until it is gone, and waiting for them cost every run the whole of :data:`_DRAIN_S`."""
    if _tee is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    until = time.monotonic() + _DRAIN_S
    while time.monotonic() < until and _unread(1) + _unread(2) and os.waitpid(_tee[0], os.WNOHANG) == (0, 0):
        time.sleep(0.01)
    time.sleep(_WRITE_S)  # the tee's last read, written on
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)


def _unread(fd: int) -> int:
    """Bytes written into the pipe ``fd`` and not read yet (Linux answers FIONREAD on either end)."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, count)
    except OSError:
        return 0
    return count[0]


# -- the tee process -----------------------------------------------------------------------------


def _run_tee(out: int, err: int, control: int) -> None:
    """Copy ``out`` and ``err`` to fds 1 and 2 and into the log ``control`` names; never returns."""
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    _close_others({0, 1, 2, out, err, control})
    log: Optional[int] = None
    held = bytearray()
    reading = {control, out, err}
    pending = b""
    while out in reading or err in reading:
        ready, _, _ = select.select(sorted(reading), [], [])
        for fd in sorted(ready, key=lambda f: f != control):  # a new log before the output after it
            data = os.read(fd, 1 << 16)
            if not data:
                reading.discard(fd)
            elif fd == control:
                pending += data
                while b"\n" in pending:
                    path, _, pending = pending.partition(b"\n")
                    log = _open_log(log, path, held)
            else:
                _write(1 if fd == out else 2, data)
                if log is not None:
                    _write(log, data)
                elif len(held) < _HELD_BYTES:
                    held += data
    os._exit(0)


def _open_log(previous: Optional[int], path: bytes, held: bytearray) -> Optional[int]:
    """The new log, with what was held written first; the previous one closed."""
    if previous is not None:
        os.close(previous)
    try:
        log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        return None  # the run goes on; its console is not kept
    _write(log, bytes(held))
    held.clear()
    return log


def _write(fd: int, data: bytes) -> None:
    """All of ``data`` to ``fd``; a reader that went away (``| head``) is no reason to stop."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        pass


def _close_others(keep: set[int]) -> None:
    """Close every descriptor the tee inherited but ``keep``: it must not hold a launcher's
    sockets or pipes open after the launcher is gone."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
