"""The server a node's ranks fork from, with torch and hetpipe imported once.

The local launcher (hetpipe.launch.local) forks its ranks from it, and so does
a torchrun node's agent (hetpipe.launch.agent) for ``-m hetpipe.pretrain``,
which torch would otherwise start as a fresh interpreter per rank, each
importing torch, its compiler and hetpipe again. :func:`node_rank` is such a
rank of a torchrun node.
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

from hetpipe.process.rank_env import ATTEMPT_ENV


# What the ranks of a torchrun node run (scripts/launch_cluster.sh: ``python -m hetpipe.launch ...
# -m hetpipe.pretrain ARGS``): hetpipe.launch.agent forks them from the node's server.
RANK_MODULE = "hetpipe.pretrain"


def node_rank_argv(entrypoint: Any, args: Sequence[Any]) -> Optional[list[str]]:
    """The command line of ``RANK_MODULE`` where torchrun would start each rank as
    ``python -u -m hetpipe.pretrain ARGS`` (its worker spec's entrypoint and args), else None."""
    python = os.environ.get("PYTHON_EXEC", sys.executable)  # torchrun's choice of interpreter
    if entrypoint != python or tuple(args[:3]) != ("-u", "-m", RANK_MODULE):
        return None
    return [str(a) for a in args[3:]]


def node_rank(attempt: str, *argv: str) -> None:
    """One rank of a torchrun node, forked from the node's server: ``python -m hetpipe.pretrain
    ARGS`` as torchrun would have started it, in the agent's ``attempt`` (its environment
    reaches a forked rank only as torch's own variables, so the attempt comes as an argument).
    Its ``RANK`` is ``HETPIPE_FIRST_RANK + LOCAL_RANK`` where launch_cluster.sh numbers the
    nodes in the cluster config's order (torchrun numbers them by address)."""
    restore_signals()  # before the module's own start: a stop signal must act from here on
    os.environ[ATTEMPT_ENV] = attempt
    if os.environ.get("HETPIPE_FIRST_RANK"):
        os.environ["RANK"] = str(int(os.environ["HETPIPE_FIRST_RANK"]) + int(os.environ["LOCAL_RANK"]))
    sys.argv = [RANK_MODULE, *argv]
    try:
        runpy.run_module(RANK_MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise


def fork_node_ranks(kwargs: dict[str, Any]) -> Optional[list[str]]:
    """Where torchrun would start each rank as a fresh ``python -u -m hetpipe.pretrain ARGS``
    (``kwargs``: those its agent is built with), have the agent fork them from one server per
    node that imported torch and hetpipe once (:func:`node_rank`; what the local launcher
    does): the node's ranks then share that import instead of each paying it
    (docs/benchmarks.md, "The suite's time").
    Returns the ranks' ARGS, or None where the ranks start as torchrun starts them."""
    spec = kwargs.get("spec")
    argv = None if spec is None or "start_method" not in kwargs else node_rank_argv(spec.entrypoint, spec.args)
    if argv is None:
        return None
    start_fork_server()
    spec.entrypoint = node_rank
    kwargs["start_method"] = "forkserver"
    return argv


def start_fork_server() -> None:
    """Start the server this node's ranks fork from, with torch and hetpipe imported.

    Spawned ranks each imported torch, the compiler torch's optimizer loads and
    hetpipe (about 3.5 CPU-s a rank); forked from one server that imported them
    once, a two-rank cpu_mixed job of two steps took 7 CPU-s instead of 11 on
    two cores. The server starts here, before the elastic agent sets an
    attempt's variables: every rank inherits the server's environment, so a
    local rank takes its attempt from TORCHELASTIC_RESTART_COUNT (one node: the
    rendezvous round), a torchrun node's from :func:`node_rank`'s argument,
    and each its preemption directory from HETPIPE_LAUNCH_DIR
    (hetpipe.launch.preemption.marker_dir): one directory for this process's
    launches (hydra's multirun launches several; the server lives on), emptied
    before each. Nothing in the server runs a kernel or a thread, which is
    what makes forking it safe."""
    from hetpipe.launch.preemption import LAUNCH_DIR_ENV
    from hetpipe.process.torch_compat import RANK_PRELOAD

    if not os.environ.get(LAUNCH_DIR_ENV):
        os.environ[LAUNCH_DIR_ENV] = tempfile.mkdtemp(prefix="hetpipe-launch-")
        atexit.register(shutil.rmtree, os.environ[LAUNCH_DIR_ENV], ignore_errors=True)
    for entry in Path(os.environ[LAUNCH_DIR_ENV]).iterdir():
        shutil.rmtree(entry, ignore_errors=True)
    context = multiprocessing.get_context("forkserver")
    # Not hetpipe.pretrain: a rank runs the main module anew (runpy warns when it is loaded already).
    context.set_forkserver_preload([*RANK_PRELOAD, "hydra", "hetpipe.training.trainer", "hetpipe.launch.local"])
    # A scheduler's stop signal may reach every process of the job (Slurm
    # signals the whole step): the server must outlive it, or the agent reads
    # every rank as ended at once (status 255) and reports them unsaved while
    # they still save (seen: exit 143 and no checkpoint, where spawned ranks
    # saved and the launcher exited 0). So the server starts with those
    # signals ignored - an ignored signal stays ignored across exec - and each
    # rank restores them before anything else (restore_signals).
    ignored = [s for s in _SERVER_IGNORES if signal.getsignal(s) == signal.SIG_DFL]
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in ignored}
    os.environ[_SERVER_IGNORES_ENV] = ",".join(s.name for s in ignored)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        del os.environ[_SERVER_IGNORES_ENV]
    atexit.register(stop_fork_server)  # registered again per launch: the server may have been restarted


def stop_fork_server() -> None:
    """At exit, SIGKILL the fork server (its ranks are over, it holds no state).

    It holds this process's stdout and stderr (its ranks print through
    them), and left to leave by itself once it saw this process gone it took
    0.7-1.1 s more to tear down the torch it imported: a two-rank cpu_mixed
    run's output ended that long after the launcher had exited, and whoever
    reads the output to its end (a pipe, a test) waited for it too."""
    if "hetpipe.process.torch_compat" not in sys.modules:  # no run got as far as torch: leave it be
        return
    pid = sys.modules["hetpipe.process.torch_compat"].fork_server_pid()
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


# The launcher's stop signals but SIGINT, which the fork server ignores itself
# (and which an interpreter started with it ignored would not turn into KeyboardInterrupt).
_SERVER_IGNORES = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_SERVER_IGNORES_ENV = "HETPIPE_FORK_SERVER_IGNORES"


def restore_signals() -> None:
    """In a rank forked from the server: the stop signals it ignored act again."""
    for name in filter(None, os.environ.pop(_SERVER_IGNORES_ENV, "").split(",")):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
