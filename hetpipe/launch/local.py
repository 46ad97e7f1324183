"""Start the ranks of a job: under torchrun use its environment, otherwise start
the local ranks through PyTorch's own elastic launcher (the local launcher).

No home-made process manager: for a cluster that fits on this machine,
``torch.distributed.launcher.api.elastic_launch`` (what ``torchrun
--standalone`` uses) spawns one worker per rank, sets RANK / LOCAL_RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT, watches them, tears all of them down
when one fails and restarts them ``max_restarts`` times (``train.max_restarts``).
A multi-node cluster is started with one torchrun per node, through ``python
-m hetpipe.launch`` (what scripts/launch_cluster.sh runs, :mod:`hetpipe.launch.torchrun`):
torchrun itself, except that a failure is one line instead of torchrun's traceback and error
box. Both run torch's agent with hetpipe's additions (:mod:`hetpipe.launch.agent`):
the root cause of a failure, a line per restart, preemption.

Every rank runs under :func:`hetpipe.launch.job_watch.stop_rank`: a rank that fails
ends the job with one ``hetpipe: error:`` line per node (the first of the
node's ranks to stop prints it; every rank ends with its cause's exit status): 1 a crashed rank (an exception; a
rank killed by a signal, whose line its launcher writes), 2 bad input, 3 a
lost node, NIC or link, 4 a device out of memory (never restarted). The
launcher exits with that status, adding one line only for a rank that could
not say why itself.
"""
from __future__ import annotations

import faulthandler
import multiprocessing
import os
import sys
import threading
import uuid
from typing import Any, Callable, MutableMapping, Optional, Sequence

from hetpipe.devices.cluster import ClusterConfig
from hetpipe.errors import ConfigError, HetpipeError
from hetpipe.launch.fd_limit import Need, ensure_fd_limit, launcher_need, raise_fd_limit_early, rank_need
from hetpipe.launch.fork_server import restore_signals, start_fork_server, stop_fork_server
from hetpipe.launch.job_secret import provide_local_secret
from hetpipe.process.rank_env import restart_attempt, under_torchrun


def _worker(fn: Callable[..., Any], args: tuple, env: Optional[dict[str, str]] = None,
            fds: Optional[Need] = None) -> Any:
    """One rank: a failure ends it (and the job) with one line and its status (:func:`stop_rank`);
    so does an open-file limit below ``fds``, the descriptors it needs. ``env`` joins its
    environment first (a forked rank has the fork server's, not the launcher's).

    ``HETPIPE_STACK_DUMP_S=N`` makes every rank print all its threads' stacks
    after N seconds - the quickest way to see where a hung job waits.
    """
    # Not at the top: job_watch imports torch, and a CLI imports this module for prestart() before torch.
    from hetpipe.launch.job_watch import stop_rank

    os.environ.update(env or {})
    restore_signals()
    _share_cores()
    if os.environ.get("HETPIPE_STACK_DUMP_S"):
        faulthandler.dump_traceback_later(float(os.environ["HETPIPE_STACK_DUMP_S"]), exit=False)
    try:
        if fds is not None:
            ensure_fd_limit(fds)
        result = fn(*args)
    except Exception as exc:  # noqa: BLE001 - stop_rank prints a bug's traceback itself
        stop_rank(exc)
    if multiprocessing.parent_process() is not None and _left_preemption_marker():
        # A rank spawned by the local launcher hands its result to torch's
        # wrapper, which then waits for the agent to read it - but an agent
        # stopping on a signal reads nothing, and kills the rank after its
        # shutdown timeout (measured: 30 s from SIGTERM to exit, for a save of
        # well under a second). An agent that got no signal (the scheduler
        # signalled the ranks only) does read it, and waits for it: so the
        # result is handed over, and the rank leaves by itself shortly after
        # if nobody takes it. The launcher needs only the marker.
        threading.Timer(_PREEMPTED_EXIT_S, _exit_now, args=(0,)).start()
    return result


def _share_cores() -> None:
    """Give each local rank its share of the cores for torch's intra-op threads.

    Every rank otherwise takes all of them: four CPU ranks on two cores,
    each with two threads spinning in OpenMP barriers, ran 20 tiny_llama steps
    in 41.1 s instead of 17.1 s (same losses, bitwise). torchrun does the
    like (OMP_NUM_THREADS=1 for several ranks a node); a value the user set wins.
    """
    import torch

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if "OMP_NUM_THREADS" not in os.environ and local > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local))


# Long enough for a running agent to read a result (it polls every 0.2 s).
_PREEMPTED_EXIT_S = 2.0


def _exit_now(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _left_preemption_marker() -> bool:
    from hetpipe.launch.preemption import marker_dir

    directory = marker_dir(restart_attempt())
    return directory is not None and (directory / f"rank{os.environ.get('RANK', '0')}.json").is_file()


def launch(cluster: ClusterConfig, fn: Callable[..., Any], *args: Any, max_restarts: int = 0,
           env: Optional[dict[str, str]] = None) -> Any:
    """Run ``fn(*args)`` on every rank of ``cluster``, with ``env`` in its environment
    before ``fn`` starts (train.deterministic's variables); returns rank 0's result.

    Under torchrun (or another launcher that sets the torch env) this process
    is one rank and runs ``fn`` directly; torchrun's ``--max-restarts`` must
    then be ``max_restarts``. A one-rank cluster without restarts runs
    in-process. Otherwise the local ranks are spawned with the elastic
    launcher, which restarts all of them up to ``max_restarts`` times when one
    fails. A failure ends this process with its cause in one line and its
    status; a preemption signal (SIGTERM, SIGUSR1...) that every rank saved a
    checkpoint on ends it with status 0 (hetpipe/launch/agent.py).
    """
    world = cluster.world_size
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ConfigError(f"torchrun started {os.environ['WORLD_SIZE']} ranks but cluster "
                              f"{cluster.name!r} has {world}")
        started = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
        if started is not None and int(started) != max_restarts:
            raise ConfigError(f"train.max_restarts={max_restarts} but torchrun was started with --max-restarts "
                              f"{started}: make them equal (launch_cluster.sh takes HETPIPE_MAX_RESTARTS, "
                              "or train.max_restarts from its command line)")
        return _worker(fn, args, env, rank_need(cluster, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if world == 1 and max_restarts == 0:
        # No fd check: one process held 9 descriptors at most (a python that starts at all has them).
        stop_fork_server()  # started early (prestart) for a job that needs no ranks: free its core
        os.environ.update(env or {})
        return fn(*args)
    if not cluster.single_node:
        raise ConfigError(f"cluster {cluster.name!r} spans several nodes: start it with one torchrun per "
                          "node (see scripts/launch_cluster.sh)")
    ensure_fd_limit(launcher_need(world))  # before the launch opens anything: a limit too low is one line
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from hetpipe.launch.agent import HANDLED_SIGNALS, agent_run, quiet_torch_launcher

    # The job secret authenticates channel handshakes: the configured one, or a
    # fresh one that only these children inherit (never through the store).
    provide_local_secret(os.environ)
    _gloo_on_loopback(os.environ)
    start_fork_server()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=f"hetpipe-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=max_restarts, monitor_interval=0.2,
        start_method="forkserver", signals_to_handle=HANDLED_SIGNALS)
    quiet_torch_launcher()
    return agent_run(lambda: elastic_launch(config, _worker)(fn, args, env, rank_need(cluster, world)))[0]


def prestart(argv: Sequence[str]) -> None:
    """Start the fork server as a CLI starts, before it imports torch itself.

    The server imports torch, hydra and hetpipe (about 2 CPU-s); started by
    :func:`launch` it did so after this process had imported the same, and
    the launch waited for it (1.9 s of a two-rank cpu_mixed run's 4.7 s in
    the launcher). Started first, the two imports run side by side on two
    cores. A job that turns out to need no local ranks (one rank, or this
    process being a torchrun rank) stops it again; argv that only prints
    (--help, --cfg) or leaves the job on the one-rank default cluster does not
    start it."""
    if under_torchrun() or prints_only(argv) or _one_rank_default(argv):
        return
    try:
        provide_local_secret(os.environ)  # the ranks inherit the server's environment
    except HetpipeError:
        return  # launch() meets it again and says it in one line, exit 2
    if not raise_fd_limit_early(launcher_need(2)):
        return  # too low for any local launch: launch() says so, or runs a one-rank job without a server
    _gloo_on_loopback(os.environ)
    start_fork_server()


def prints_only(argv: Sequence[str]) -> bool:
    """Whether the command line only prints (--help, --cfg...): no job, no run directory."""
    return any(a.split("=")[0] in _PRINT_ONLY for a in argv)


def _gloo_on_loopback(env: MutableMapping[str, str]) -> None:
    """Local ranks' gloo listens on loopback unless the user chose an interface: gloo binds the
    address the host name resolves to, which on many hosts is a NIC's (the launcher's stores
    listen on loopback too: hetpipe.launch.store_bind)."""
    from hetpipe.comm.nics import list_interfaces

    loopback = next((i.name for i in list_interfaces() if "127.0.0.1" in i.ipv4), None)
    if loopback and not env.get("GLOO_SOCKET_IFNAME"):
        env["GLOO_SOCKET_IFNAME"] = loopback


_PRINT_ONLY = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc")
# What can make a job more than one local rank: the cluster (its group, or any of its keys),
# restarts (one rank with restarts runs under the elastic agent), or another config file.
_MAY_SPAWN = ("cluster", "+cluster", "++cluster", "train.max_restarts", "+train.max_restarts",
              "++train.max_restarts", "--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd")


def _one_rank_default(argv: Sequence[str]) -> bool:
    """True when the command line leaves the job on the default cluster (``single``: one
    rank) without restarts, so it trains in this process and a server would only be
    stopped again: started anyway it spent about 2 CPU-s importing (a third of a short
    one-rank run's CPU). A guess the other way only costs the overlap: launch() starts
    the server itself."""
    keys = [a.split("=")[0] for a in argv]
    return not any(k in _MAY_SPAWN or k.split(".")[0] in _MAY_SPAWN for k in keys)


