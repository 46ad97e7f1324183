"""``python -m MODULE ARGS`` for the suite, without importing torch once per command.

The suite runs about 200 commands (``python -m hetpipe.pretrain`` and ``hetpipe.plan``
mostly), and each fresh interpreter spent about 2 CPU-s importing torch, hydra and
hetpipe before doing anything (a two-rank run: 5.5 CPU-s in all, 2.4 forked). Here each
pytest worker starts one interpreter that imports them once (the zygote) and forks
it per command. The child is a process of its own, as ``subprocess.run`` would start
it: its standard input, output and error are the caller's pipes (passed over a Unix
socket), its environment, working directory and ``sys.argv`` are the command's, it
runs the module as ``__main__`` with :mod:`runpy` (as ``python -m`` does) and ends
as an interpreter ends (non-daemon threads joined, atexit handlers, exit status; an
uncaught exception prints its traceback and exits 1), less the modules' teardown. The ranks a launcher starts
are started by the hetpipe code under test as they always are, with one
difference below it: multiprocessing starts the ranks' fork server
(hetpipe.launch.local) as a fresh interpreter that imports torch and its compiler
again (3.6 CPU-s); in a forked command it is a fork of that command running the
server's own line, with only the descriptors the fresh one would have.

What it cannot mirror, the caller gets a fresh interpreter for: a command that is
not ``-m MODULE``, an environment other than the zygote's in anything but hetpipe's
own variables and those in RUN_TIME_ONLY (a variable read while importing, such as
PYTHONPATH or OMP_NUM_THREADS, would not take effect; one the test did not pass for
the command is also a warning, so a worker whose own environment drifted does not
quietly run everything fresh), a module
the zygote has imported already, or a zygote that printed anything while importing
(a warning it swallowed would be one the command's output lacks).
HETPIPE_TEST_FRESH_PYTHON=1 gives every command a fresh interpreter.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from typing import Iterable, Optional

from hetpipe.process.torch_compat import RANK_PRELOAD

# What a command's interpreter would import first (the ranks' fork server preloads the
# same, hetpipe.launch.local), never a module a command runs.
PRELOAD = (*RANK_PRELOAD, "hydra", "omegaconf", "hetpipe.training.trainer", "hetpipe.launch.local",
           "hetpipe.schema.pretrain_config", "hetpipe.partitioner.solver")

_ZYGOTE = r"""
import json, os, runpy, socket, sys
for name in sys.argv[2].split(","):
    __import__(name)

import multiprocessing.util
spawnv_passfds = multiprocessing.util.spawnv_passfds


def fork_the_fork_server(path, args, passfds):
    # multiprocessing starts its fork server as `python -c "from multiprocessing.forkserver
    # import main; main(...)"` (the module's docstring says why a fork runs that line here).
    if args[-2:-1] != ["-c"] or not args[-1].startswith("from multiprocessing.forkserver import"):
        return spawnv_passfds(path, args, passfds)
    pid = os.fork()
    if pid == 0:
        try:
            keep = sorted({0, 1, 2, *map(int, passfds)})
            for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
                os.closerange(low + 1, high)
            exec(args[-1], {"__name__": "__main__"})
        finally:
            os._exit(0)
    return pid


multiprocessing.util.spawnv_passfds = fork_the_fork_server


def end_as_an_interpreter_ends(main):
    # What an interpreter's end shows (the exit status, the traceback, non-daemon threads
    # joined, atexit handlers, flushed output), then os._exit: tearing the modules down
    # would write to every object the zygote imported, copying each page of the fork
    # (1.2 CPU-s a command, for nothing the command's caller could see).
    import atexit, threading, traceback
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
        if not isinstance(code, int) and code is not None:  # sys.exit("message")
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code or 0)
sys.stdout.flush(); sys.stderr.flush()
control = socket.socket(fileno=int(sys.argv[1]))
control.send(b'{"ready": true}')
while True:
    message, fds = socket.recv_fds(control, 1 << 20, 3)[:2]
    if not message:
        sys.exit(0)
    request = json.loads(message)
    if request["module"] in sys.modules:
        for fd in fds:
            os.close(fd)
        control.send(b'{"fresh": true}')
        continue
    pid = os.fork()
    if pid == 0:
        control.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["module"], *request["args"]]
        del request, fds, message, control
        end_as_an_interpreter_ends(lambda: runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True))
    for fd in fds:
        os.close(fd)
    control.send(json.dumps({"pid": pid}).encode())
    status = os.waitpid(pid, 0)[1]
    control.send(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())
"""


class Zygote:
    """One pre-imported interpreter per pytest worker; :meth:`run` is ``subprocess.run``'s
    ``capture_output=True, text=True`` for ``[sys.executable, "-m", MODULE, *ARGS]``,
    or None where a fresh interpreter is needed (see the module's docstring)."""

    def __init__(self, env: dict[str, str]):
        # Datagrams in order: a request and its descriptors arrive as one message.
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, str(theirs.fileno()), ",".join(PRELOAD)],
                                     env=env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        theirs.close()
        self.control = ours
        self.lock = threading.Lock()
        self.usable = self.control.recv(1 << 16) == b'{"ready": true}'
        if self.usable:  # anything printed while importing: commands must see it, so none come here
            selector = selectors.DefaultSelector()
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            self.usable = not selector.select(timeout=0.2)
            selector.close()

    def run(self, module: str, args: list[str], env: dict[str, str], cwd: str,
            timeout: float) -> Optional[subprocess.CompletedProcess]:
        if not self.usable or self.proc.poll() is not None or not self.lock.acquire(blocking=False):
            return None
        try:
            return self._run(module, args, env, cwd, timeout)
        finally:
            self.lock.release()

    def _run(self, module, args, env, cwd, timeout):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            request = {"module": module, "args": list(args), "env": env, "cwd": str(cwd)}
            socket.send_fds(self.control, [json.dumps(request).encode()], [null, out_w, err_w])
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        reply = json.loads(self.control.recv(1 << 16))
        if reply.get("fresh"):
            os.close(out_r), os.close(err_r)
            return None
        pid, deadline = reply["pid"], time.monotonic() + timeout
        stdout, stderr, timed_out = _read_until_eof(out_r, err_r, deadline)
        if timed_out:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile
                pass
        status = json.loads(self.control.recv(1 << 16))["status"]
        argv = [sys.executable, "-m", module, *args]
        if timed_out:
            raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(argv, status, stdout, stderr)


def _read_until_eof(out_r: int, err_r: int, deadline: float) -> tuple[str, str, bool]:
    """Both pipes to their end (every process holding them gone), as communicate() reads them;
    True where the deadline came first."""
    chunks = {out_r: [], err_r: []}
    selector = selectors.DefaultSelector()
    for fd in chunks:
        selector.register(fd, selectors.EVENT_READ)
    timed_out = False
    while selector.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for key, _ in selector.select(timeout=left):
            data = os.read(key.fd, 65536)
            if data:
                chunks[key.fd].append(data)
            else:
                selector.unregister(key.fd)
    selector.close()
    for fd in chunks:
        os.close(fd)
    text = [b"".join(chunks[fd]).decode(errors="replace") for fd in (out_r, err_r)]
    return text[0], text[1], timed_out


_zygote: Optional[Zygote] = None


def run_module(module: str, args: list[str], env: dict[str, str], cwd: str, timeout: float,
               usual_env: dict[str, str], passed: Iterable[str] = ()) -> Optional[subprocess.CompletedProcess]:
    """The command through this worker's zygote, or None: run it in a fresh interpreter.
    The zygote starts on first use with ``usual_env``, the environment commands get when
    no test changed it; a command with another one runs fresh, with a warning where the
    difference is not in the variables the test ``passed`` for this command."""
    global _zygote
    if os.environ.get("HETPIPE_TEST_FRESH_PYTHON") == "1":
        return None
    ours, usual = _at_import(env), _at_import(usual_env)
    if ours != usual:
        unasked = sorted(k for k in ours.keys() | usual.keys() if ours.get(k) != usual.get(k) and k not in passed)
        if unasked:
            warnings.warn(f"python -m {module} ran in a fresh interpreter: the environment differs from the "
                          f"zygote's in {', '.join(unasked)} (tests/cli_zygote.py)", stacklevel=3)
        return None
    if _zygote is None:
        _zygote = Zygote(usual_env)
    return _zygote.run(module, args, env, cwd, timeout)


# Set in a pytest worker's own environment by code that runs there, for that code's later
# use, and read by nothing the zygote imports: torch's inductor writes its cache directory
# the first time a test compiles in the worker (and reads the variable again at every
# compile) and, loading a compiled module, a pointer into the worker that the module reads
# (any process that loads one sets its own first); hetpipe's Mooncake check
# (comm/mooncake_mover.py, run while the tests are collected) sets the log level of
# Mooncake's library, which loads only where it is used; a trainer built in the worker
# sets c10d's P2P-serialization switch (hetpipe/process/known_warnings.py), read when an NCCL
# group is made. Until these were named here most commands of a full run started fresh.
RUN_TIME_ONLY = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
                           "MC_LOG_LEVEL", "TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING"})


def _at_import(env: dict[str, str]) -> dict[str, str]:
    """The variables an interpreter may read while importing: all but those above and
    hetpipe's own (HETPIPE_*), which hetpipe reads when it runs, never on import."""
    return {k: v for k, v in env.items() if k not in RUN_TIME_ONLY and not k.startswith("HETPIPE_")}
