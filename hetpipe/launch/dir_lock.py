"""One live job per directory: an advisory lock file in a run or checkpoint directory.

A job owns a directory through ``<dir>/.hetpipe.lock``: the file names the
owner (host, boot id, pid, job id, since when) and the owning process holds an
exclusive ``fcntl.flock`` on it, which the kernel releases however the process
ends. The owner removes the file when it releases the directory (and at exit);
a killed owner leaves it behind, stale.

Another job is refused while the owner may be alive. A lock is taken over
only when its owner is provably gone: written on this machine (the same boot
id) and its flock free - or, on a filesystem without flock, its pid dead. A
lock written on another host (or before this host rebooted) whose flock is
free cannot be checked from here, since flock need not reach across the
hosts of a shared filesystem: it is refused and named, with the way out
(delete the file by hand, or ``checkpoint.break_lock=true``).

Ranks of one job share its id (:func:`job_id`: torchrun's rendezvous id and
store address, the same on every node), so a rank that finds its own job's
lock - a shared save directory, or another rank holding the run directory -
joins it instead of being refused.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from hetpipe.errors import ConfigError, HetpipeError

LOCK_NAME = ".hetpipe.lock"
# This process's job when no launcher names one (the local launcher, a one-rank run),
# by pid: a forked process is another job.
_LOCAL_JOBS: dict[int, str] = {}
# How long a rank waits for a lock's owner to write its name (it takes the flock first).
_NAMELESS_WAIT_S = 2.0


class DirectoryInUse(HetpipeError):
    """Another job, alive or not provably gone, owns the directory."""


@dataclass(frozen=True)
class Owner:
    """Who holds a lock, as its file says."""

    host: str
    boot: str  # the kernel's boot id: the same machine and boot, unlike a host name
    pid: int
    job: str
    since: str

    @classmethod
    def me(cls) -> Owner:
        return cls(socket.gethostname(), _boot_id(), os.getpid(), job_id(), time.strftime("%Y-%m-%d %H:%M:%S"))

    @classmethod
    def parse(cls, text: str) -> Optional[Owner]:
        """The owner a lock file names; None for an empty or unreadable one."""
        try:
            fields = json.loads(text)
            return cls(str(fields["host"]), str(fields.get("boot", "")), int(fields["pid"]), str(fields["job"]),
                       str(fields["since"]))
        except (ValueError, KeyError, TypeError):
            return None

    def names(self) -> str:
        return f"job {self.job} (host {self.host}, pid {self.pid}, since {self.since})"

    def on_this_machine(self) -> bool:
        """Written by this machine in its current boot (the host name where a boot id is missing)."""
        mine = _boot_id()
        return self.boot == mine if self.boot and mine else self.host == socket.gethostname()

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # another user's process
        return True


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


def job_id() -> str:
    """The job this process belongs to: under torchrun its rendezvous id and store address
    (every rank of every node shares them, and no two live jobs do), else this process's own."""
    run_id, addr = os.environ.get("TORCHELASTIC_RUN_ID"), os.environ.get("MASTER_ADDR")
    if run_id and addr:
        return f"{run_id}@{addr}:{os.environ.get('MASTER_PORT', '')}"
    return _LOCAL_JOBS.setdefault(os.getpid(), uuid.uuid4().hex[:12])


@dataclass
class _Held:
    path: Path
    fd: Optional[int]  # None: joined a lock another rank of this job holds
    owner: Owner


# Directories this process owns or joined, by resolved path.
_held: dict[Path, _Held] = {}


def acquire(directory: Path, what: str, setting: str, break_lock: bool = False) -> bool:
    """Make ``directory`` (created if missing) this job's, or raise :class:`DirectoryInUse`
    naming its owner. ``what`` names the directory in lines ("run directory"), ``setting``
    the option that chooses another. False when this process holds it already."""
    key = Path(os.path.abspath(directory))
    if key in _held:
        return False
    try:
        key.mkdir(parents=True, exist_ok=True)
        held = None
        while held is None:
            held = _try(key / LOCK_NAME, f"{what} {key}", setting, break_lock)
    except OSError as exc:
        raise ConfigError(f"cannot lock {what} {key}: {exc.strerror or exc}") from None
    if not _held:
        atexit.register(release_all)
    _held[key] = held
    return True


def release(directory: Path) -> None:
    """Give ``directory`` up: its lock file goes if it still names this process."""
    held = _held.pop(Path(os.path.abspath(directory)), None)
    if held is None or held.fd is None:
        return
    with contextlib.suppress(OSError):  # a forked child inherits the record, not the lock
        if held.owner.pid == os.getpid() and _read(held.fd) == held.owner and _same_file(held.fd, held.path):
            held.path.unlink()
    os.close(held.fd)


def release_all() -> None:
    for directory in list(_held):
        release(directory)


def _try(path: Path, label: str, setting: str, break_lock: bool) -> Optional[_Held]:
    """One attempt at ``path``: the held lock, or None when its owner removed it meanwhile."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        locked = _flock(fd)
        if locked and not _same_file(fd, path):
            os.close(fd)
            return None
        owner = _read(fd, wait=locked is False)
        if owner is not None and owner.job == job_id():
            return _join(fd, path, locked, owner)
        _judge(owner, locked, path, label, setting, break_lock)
        me = Owner.me()
        _write(fd, me)
        return _Held(path, fd, me)
    except BaseException:
        os.close(fd)
        raise


def _join(fd: int, path: Path, locked: Optional[bool], owner: Owner) -> _Held:
    """This job's own lock: another of its ranks holds it (and will remove it), or a rank
    of an earlier attempt of the job left it, which this process now holds in its place."""
    if locked is False:
        os.close(fd)
        return _Held(path, None, owner)
    me = Owner.me()
    _write(fd, me)
    return _Held(path, fd, me)


def _judge(owner: Optional[Owner], locked: Optional[bool], path: Path, label: str, setting: str,
           break_lock: bool) -> None:
    """Refuse a lock whose owner may be alive; say so when taking over one that is gone."""
    if owner is None:
        if locked is False:
            raise DirectoryInUse(f"{label} is locked by a process that has not named itself; wait for it to end "
                                 f"or choose another {setting} (lock file {path})")
        return  # a fresh lock file, or one cut short before its owner wrote its name
    if locked is False or (owner.on_this_machine() and locked is None and owner.alive()):
        raise DirectoryInUse(f"{label} is in use by {owner.names()}: wait for it to end or choose another "
                             f"{setting} (lock file {path})")
    if owner.on_this_machine():
        print(f"hetpipe: note: {label} was locked by {owner.names()}, which is gone; taking it over", flush=True)
    elif break_lock:
        print(f"hetpipe: note: {label}: breaking the lock of {owner.names()} (checkpoint.break_lock=true)",
              flush=True)
    else:
        raise DirectoryInUse(f"{label} is locked by {owner.names()}, which cannot be checked from host "
                             f"{socket.gethostname()}: if that job has ended, delete {path} or add "
                             "checkpoint.break_lock=true")


def _flock(fd: int) -> Optional[bool]:
    """True: this process now holds ``fd``'s flock; False: another does; None: no flock here."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


def _same_file(fd: int, path: Path) -> bool:
    """``path`` is still the file ``fd`` opened (an owner releasing it removes the name first)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _read(fd: int, wait: bool = False) -> Optional[Owner]:
    """The owner ``fd``'s file names; with ``wait``, give a new owner time to write its name."""
    until = time.monotonic() + (_NAMELESS_WAIT_S if wait else 0.0)
    while True:
        owner = Owner.parse(os.pread(fd, 4096, 0).decode(errors="replace"))
        if owner is not None or time.monotonic() >= until:
            return owner
        time.sleep(0.05)


def _write(fd: int, owner: Owner) -> None:
    data = (json.dumps(asdict(owner)) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)
