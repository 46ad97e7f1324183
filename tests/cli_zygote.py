"""``python -m MODULE ARGS`` for the suite, without importing torch once per command.

The suite runs about 300 commands (``python -m hetpipe.pretrain`` and ``hetpipe.plan``
mostly, and the torchrun agents of emulated nodes), and each fresh interpreter spent
about 2 CPU-s importing torch, hydra and hetpipe before doing anything (a two-rank run:
5.5 CPU-s in all, 2.4 forked). Here each pytest worker starts one interpreter that
imports them once (the zygote) and forks it per command; it serves commands on a Unix
socket, each connection one command, many at once (a waiter forked per command reports
its pid and exit status). The command is a process of its own, as ``subprocess.run``
would start it: its standard input, output and error are the caller's (passed over the
socket), its environment, working directory and ``sys.argv`` are the command's, it
runs the module as ``__main__`` with :mod:`runpy` (as ``python -m`` does) and ends as
an interpreter ends (non-daemon threads joined, atexit handlers, exit status; an
uncaught exception prints its traceback and exits 1), less the modules' teardown.
Scripts get the zygote through :func:`python_shim`, an executable they take for
``python`` (PYTHON): its commands run forked too, with the shim's process standing for
them (tests/zygote_client.py), inside the shim's network and mount namespaces when it
runs in an emulated node (``ip netns exec``). The ranks a launcher starts are started
by the hetpipe code under test as they always are, with one difference below it:
multiprocessing starts the ranks' fork server (hetpipe.launch.local,
hetpipe.launch.fork_server) as a fresh interpreter that imports torch and its compiler
again (3.6 CPU-s); in a forked command it is a fork of that command running the
server's own line, with only the descriptors the fresh one would have.

What it cannot mirror, the caller gets a fresh interpreter for: a command that is
neither ``-m MODULE`` nor a script by path (the shim's), an environment other than
the zygote's in anything but hetpipe's own variables and those in RUN_TIME_ONLY (a
variable read while importing, such as PYTHONPATH or OMP_NUM_THREADS, would not take
effect; one the test did not pass for the command is also a warning, so a worker
whose own environment drifted does not quietly run everything fresh), a module the
zygote has imported already, or a zygote that printed anything while importing (a
warning it swallowed would be one the command's output lacks).
HETPIPE_TEST_FRESH_PYTHON=1 gives every command a fresh interpreter.
"""
from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Iterable, Optional

from hetpipe.process.torch_compat import RANK_PRELOAD

# What a command's interpreter would import first (the ranks' fork server preloads the
# same, hetpipe.launch.local), never a module a command runs.
PRELOAD = (*RANK_PRELOAD, "hydra", "omegaconf", "hetpipe.training.trainer", "hetpipe.launch.local",
           "hetpipe.schema.pretrain_config", "hetpipe.partitioner.solver")

_ZYGOTE = r"""
import json, os, runpy, signal, socket, sys
for name in sys.argv[3].split(","):
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
            # The others become /dev/null, not closed: objects of this fork that own one (a
            # socket of a torchrun agent, say) would close its number again when collected,
            # by then a descriptor the server received for a rank.
            keep, null = {0, 1, 2, *map(int, passfds)}, os.open(os.devnull, os.O_RDWR)
            for fd in map(int, os.listdir("/proc/self/fd")):
                if fd not in keep and fd != null:
                    os.dup2(null, fd)
            exec(args[-1], {"__name__": "__main__"})
        finally:
            os._exit(0)
    return pid


multiprocessing.util.spawnv_passfds = fork_the_fork_server
RUN_TIME_ONLY = frozenset(json.loads(sys.argv[4]))


def at_import(env):
    return {k: v for k, v in env.items() if k not in RUN_TIME_ONLY and not k.startswith("HETPIPE_")}


OURS = at_import(os.environ)


def why_fresh(request):
    # What this interpreter cannot mirror: a module imported already (runpy would run a
    # second copy of it), or a variable an interpreter may read while importing.
    module = sys.modules.get(request.get("module", ""))
    if module is not None and not hasattr(module, "__path__"):
        return ["the module is imported already"]
    if module is not None and request["module"] + ".__main__" in sys.modules:  # a package runs its __main__
        return ["the module is imported already"]
    theirs, script_only = at_import(request["env"]), set(request.get("script_only", ()))
    return sorted(k for k in OURS.keys() | theirs.keys() if OURS.get(k) != theirs.get(k) and k not in script_only)


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


def enter_namespaces(fds):
    # A caller inside an emulated node (`ip netns exec`) sends its network and mount
    # namespaces: the command joins them, as if started there (only a one-thread process
    # may join a mount namespace: this fork is one).
    import ctypes
    setns = ctypes.CDLL(None, use_errno=True).setns
    for fd, name in zip(fds, ("net", "mnt")):
        if os.fstat(fd).st_ino != os.stat(f"/proc/self/ns/{name}").st_ino and setns(fd, 0) != 0:
            raise OSError(ctypes.get_errno(), f"setns({name})")


def run_command(request, fds):
    enter_namespaces(fds[3:])
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request.get("script")
    sys.argv = [script or request["module"], *request["args"]]
    if script is None:
        end_as_an_interpreter_ends(lambda: runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True))
    else:
        end_as_an_interpreter_ends(lambda: run_script(script))


def run_script(path):
    # As `python SCRIPT` runs it (runpy.run_path would change sys.argv[0] and __file__):
    # its directory first on sys.path, its absolute path as __file__, in a new __main__.
    import builtins, importlib.machinery, types
    path = os.path.abspath(path)
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__, main.__cached__ = path, builtins, None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    with open(path, "rb") as source:
        code = compile(source.read(), path, "exec")
    exec(code, main.__dict__)


def wait_for(pid, conn):
    # The caller's end closing first (a shim killed, a test gone) SIGKILLs the command: it
    # would otherwise run on unseen, on the suite's CPU.
    conn.send(json.dumps({"pid": pid}).encode())
    import select
    ended = os.pidfd_open(pid)
    if ended not in select.select([ended, conn], [], [])[0]:
        os.kill(pid, signal.SIGKILL)
    status = os.waitpid(pid, 0)[1]
    try:
        conn.send(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())
    except OSError:  # the caller is gone (killed with its node, say)
        pass


def serve(conn):
    # One connection, one command: the request with its descriptors, then from a waiter
    # forked for it, the command's pid and its exit status; many run at once.
    message, fds = socket.recv_fds(conn, 1 << 20, 5)[:2]
    request = json.loads(message)
    why = why_fresh(request)
    if why or os.fork() != 0:
        if why:
            conn.send(json.dumps({"fresh": why}).encode())
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the waiter waits; its command inherits the default
    listener.close(), control.close()
    pid = os.fork()
    if pid == 0:
        conn.close()
        run_command(request, fds)
    for fd in fds:
        os.close(fd)
    wait_for(pid, conn)
    os._exit(0)


import gc
gc.freeze()  # what was imported lives on: a command's collections skip it and leave its pages shared
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters are reaped as they end
sys.stdout.flush(); sys.stderr.flush()
control = socket.socket(fileno=int(sys.argv[1]))
listener = socket.socket(fileno=int(sys.argv[2]))
control.send(b'{"ready": true}')
import selectors
selector = selectors.DefaultSelector()
selector.register(control, selectors.EVENT_READ)
selector.register(listener, selectors.EVENT_READ)
while True:
    for key, _ in selector.select():
        if key.fileobj is control:  # the pytest worker is gone, or done
            sys.exit(0)
        serve(listener.accept()[0])
"""


class Zygote:
    """One pre-imported interpreter per pytest worker, serving commands on a Unix socket
    (:attr:`path`): :meth:`run` is ``subprocess.run``'s ``capture_output=True, text=True``
    for ``[sys.executable, "-m", MODULE, *ARGS]``, or None where a fresh interpreter is
    needed (see the module's docstring); :func:`python_shim` hands it to scripts."""

    def __init__(self, env: dict[str, str]):
        self.dir = tempfile.mkdtemp(prefix="hetpipe-zygote-")
        atexit.register(shutil.rmtree, self.dir, ignore_errors=True)
        self.path = os.path.join(self.dir, "socket")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(self.path)
        listener.listen(64)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = [theirs.fileno(), listener.fileno()]
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, *map(str, fds), ",".join(PRELOAD),
                                      json.dumps(sorted(RUN_TIME_ONLY))],
                                     env=env, pass_fds=fds, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        theirs.close(), listener.close()
        self.control = ours
        self.usable = self.control.recv(1 << 16) == b'{"ready": true}'
        if self.usable:  # anything printed while importing: commands must see it, so none come here
            selector = selectors.DefaultSelector()
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            self.usable = not selector.select(timeout=0.2)
            selector.close()

    def run(self, module: str, args: list[str], env: dict[str, str], cwd: str, timeout: float,
            passed: Iterable[str] = ()) -> Optional[subprocess.CompletedProcess]:
        if not self.usable or self.proc.poll() is not None:
            return None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            request = {"module": module, "args": list(args), "env": env, "cwd": str(cwd)}
            socket.send_fds(conn, [json.dumps(request).encode()], [null, out_w, err_w])
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        with conn:
            reply = json.loads(conn.recv(1 << 16))
            if "fresh" in reply:
                os.close(out_r), os.close(err_r)
                _warn_unasked(module, reply["fresh"], passed)
                return None
            return _finish(conn, reply["pid"], [sys.executable, "-m", module, *args], out_r, err_r, timeout)


def _warn_unasked(module: str, differing: list[str], passed: Iterable[str]) -> None:
    """A command the test did not ask to differ ran fresh: say which variables differed,
    so a worker whose own environment drifted does not quietly run everything fresh."""
    unasked = [k for k in differing if k not in passed and k != "the module is imported already"]
    if unasked:
        warnings.warn(f"python -m {module} ran in a fresh interpreter: the environment differs from the "
                      f"zygote's in {', '.join(unasked)} (tests/cli_zygote.py)", stacklevel=4)


def _finish(conn: socket.socket, pid: int, argv: list[str], out_r: int, err_r: int,
            timeout: float) -> subprocess.CompletedProcess:
    stdout, stderr, timed_out = _read_until_eof(out_r, err_r, time.monotonic() + timeout)
    if timed_out:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended meanwhile
            pass
    status = json.loads(conn.recv(1 << 16))["status"]
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


def _the_zygote(usual_env: dict[str, str]) -> Zygote:
    global _zygote
    if _zygote is None:
        _zygote = Zygote(usual_env)
    return _zygote


def run_module(module: str, args: list[str], env: dict[str, str], cwd: str, timeout: float,
               usual_env: dict[str, str], passed: Iterable[str] = ()) -> Optional[subprocess.CompletedProcess]:
    """The command through this worker's zygote, or None: run it in a fresh interpreter.
    The zygote starts on first use with ``usual_env``, the environment commands get when
    no test changed it; a command with another one runs fresh, with a warning where the
    difference is not in the variables the test ``passed`` for this command."""
    if os.environ.get("HETPIPE_TEST_FRESH_PYTHON") == "1":
        return None
    return _the_zygote(usual_env).run(module, args, env, cwd, timeout, passed)


SHIM = """#!{python} -S
# `python` for a script a test runs (its PYTHON): `-m MODULE` and `SCRIPT` run forked from
# this worker's zygote (tests/cli_zygote.py), anything else in {python}.
import sys
sys.path.insert(0, {tests!r})
import zygote_client
zygote_client.main({path!r}, {python!r}, {script_only!r}, sys.argv[1:])
"""


def python_shim(usual_env: dict[str, str], script_only: Iterable[str] = ()) -> str:
    """An executable that scripts and tests can take for ``python`` (PYTHON=...): it runs
    ``-m MODULE ARGS`` and ``SCRIPT ARGS`` through this worker's zygote, from any process,
    in an emulated node too (tests/zygote_client.py); the interpreter itself where a fresh one is needed
    or with HETPIPE_TEST_FRESH_PYTHON=1. ``script_only``: variables the test sets for the
    script itself, which its commands inherit but never read while importing."""
    if os.environ.get("HETPIPE_TEST_FRESH_PYTHON") == "1":
        return sys.executable
    zygote, script_only = _the_zygote(usual_env), sorted(script_only)
    shim = os.path.join(zygote.dir, "python-" + "-".join(script_only) if script_only else "python")
    if not os.path.exists(shim):
        with open(shim + ".tmp", "w") as f:
            f.write(SHIM.format(python=sys.executable, tests=os.path.dirname(os.path.abspath(__file__)),
                                path=zygote.path, script_only=script_only))
        os.chmod(shim + ".tmp", 0o755)
        os.replace(shim + ".tmp", shim)
    return shim


# Set in a pytest worker's own environment by code that runs there, for that code's later
# use, and read by nothing the zygote imports: torch's inductor writes its cache directory
# the first time a test compiles in the worker (and reads the variable again at every
# compile) and, loading a compiled module, a pointer into the worker that the module reads
# (any process that loads one sets its own first); hetpipe's Mooncake check
# (comm/mooncake_mover.py, run while the tests are collected) sets the log level of
# Mooncake's library, which loads only where it is used; a trainer built in the worker
# sets c10d's P2P-serialization switch (hetpipe/process/known_warnings.py), read when an NCCL
# group is made. Until these were named here most commands of a full run started fresh.
# Scripts run with the zygote's python (python_shim) add what bash puts in a child's
# environment (_, SHLVL, PWD, OLDPWD), the interpreter they were given (PYTHON), and what
# scripts/launch_cluster.sh reads to place a node (NODE_RANK, RDZV_ENDPOINT); hydra's
# HYDRA_FULL_ERROR is read when a command fails. torchrun puts TORCHRUN_WORKER_ENV in
# each worker's environment (torch.distributed.elastic's local agent), read when the
# worker makes its process group; PYTHON_EXEC is the python it starts them with (torchrun).
# scripts/bench_pp2_llm.py sets PYTORCH_CUDA_ALLOC_CONF, read when CUDA's allocator starts.
TORCHRUN_WORKER_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                       "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                       "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                       "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE",
                       "TORCH_NCCL_ASYNC_ERROR_HANDLING")
RUN_TIME_ONLY = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
                           "MC_LOG_LEVEL", "TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING",
                           "_", "SHLVL", "PWD", "OLDPWD", "PYTHON", "NODE_RANK", "RDZV_ENDPOINT", "HYDRA_FULL_ERROR",
                           "PYTHON_EXEC", "PYTORCH_CUDA_ALLOC_CONF", *TORCHRUN_WORKER_ENV})
