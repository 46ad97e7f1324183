"""Start the ranks of a job: under torchrun use its environment, otherwise start
the local ranks through PyTorch's own elastic launcher.

No home-made process manager: for a cluster that fits on this machine,
``torch.distributed.launcher.api.elastic_launch`` (what ``torchrun
--standalone`` uses) spawns one worker per rank, sets RANK / LOCAL_RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT, watches them and tears all of them down
when one fails. A multi-node cluster is started with one torchrun per node,
through ``python -m hetpipe.launch`` (what scripts/launch_cluster.sh runs):
torchrun itself, except that a failure is one line instead of torchrun's
traceback and error box.

Every rank runs under :func:`hetpipe.job_watch.stop_rank`: a rank that fails
prints its one ``hetpipe: error:`` line and exits 2, and so does every other
rank of the job, with the same cause (a lost node, a dead NIC, bad input); the
launcher then adds nothing, or one line for a rank that died without one.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import uuid
from typing import Any, Callable, Optional, Sequence

from hetpipe.cluster import ClusterConfig
from hetpipe.errors import EXIT_BAD_INPUT, EXIT_LOST_PEER, ConfigError, fail
from hetpipe.job_secret import provide_local_secret


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def rank_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) of this process (0, 1, 0 outside a launcher)."""
    if under_torchrun():
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    return 0, 1, 0


def _worker(fn: Callable[..., Any], args: tuple) -> Any:
    """One rank: a failure ends it (and the job) with one line and exit 2 (:func:`stop_rank`).

    ``HETPIPE_STACK_DUMP_S=N`` makes every rank print all its threads' stacks
    after N seconds - the quickest way to see where a hung job waits.
    """
    # Not at the top: job_watch imports torch, and main() must set TORCH_CPP_LOG_LEVEL before torch loads.
    from hetpipe.job_watch import stop_rank

    if os.environ.get("HETPIPE_STACK_DUMP_S"):
        faulthandler.dump_traceback_later(float(os.environ["HETPIPE_STACK_DUMP_S"]), exit=False)
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - stop_rank prints a bug's traceback itself
        stop_rank(exc)


def launch(cluster: ClusterConfig, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` on every rank of ``cluster``; returns rank 0's result.

    Under torchrun (or another launcher that sets the torch env) this process
    is one rank and runs ``fn`` directly. A one-rank cluster runs in-process.
    Otherwise the local ranks are spawned with the elastic launcher.
    """
    world = cluster.world_size
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ConfigError(f"torchrun started {os.environ['WORLD_SIZE']} ranks but cluster "
                              f"{cluster.name!r} has {world}")
        return _worker(fn, args)
    if world == 1:
        return fn(*args)
    if not cluster.single_node:
        raise ConfigError(f"cluster {cluster.name!r} spans several nodes: start it with one torchrun per "
                          "node (see scripts/launch_cluster.sh)")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The job secret authenticates channel handshakes: the configured one, or a
    # fresh one that only these children inherit (never through the store).
    provide_local_secret(os.environ)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=f"hetpipe-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.2,
        start_method="spawn")
    # The elastic agent logs state changes and a failed rank's traceback; a
    # failure is reported below in one line (and bad input by the rank itself).
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        results = elastic_launch(config, _worker)(fn, args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode in (EXIT_BAD_INPUT, EXIT_LOST_PEER):
            raise SystemExit(failure.exitcode)  # the rank already printed its one-line error
        fail(f"rank {rank} failed with exit code {failure.exitcode} "
             f"({failure.message or 'see its output above'})", code=1)
    return results[0]


def _this_node() -> str:
    """``node 1 of 2`` from launch_cluster.sh's variables, for the launcher's own lines."""
    node, nodes = os.environ.get("HETPIPE_NODE_RANK"), os.environ.get("HETPIPE_NNODES")
    return f"node {node} of {nodes}" if node and nodes else "this node"


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m hetpipe.launch TORCHRUN_ARGS...``: torchrun with one-line failures.

    Exit 2 (bad input) or 3 (a lost node, link or peer) when the first rank to
    fail printed its own line (the others then printed the same, or were
    stopped by the agent); otherwise one line for the
    rank that died without one (a signal, a bug's traceback above), or for a
    rendezvous that did not complete, and exit 1.
    """
    # c10d's C++ warnings carry a C++ backtrace (30 lines); an agent's store
    # client writes one when node 0's agent, which hosts the store, leaves
    # first, as it does when a job fails. The level is read when torch loads,
    # so the ranks, which inherit the environment restored below, keep the
    # user's.
    users_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    import torch  # noqa: F401

    if users_level is None:
        del os.environ["TORCH_CPP_LOG_LEVEL"]
    else:
        os.environ["TORCH_CPP_LOG_LEVEL"] = users_level
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousError,
        RendezvousTimeoutError,
    )
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    # The agent logs each failed rank and re-raises with an error box; the
    # ranks have said why already, or the lines below do.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode in (EXIT_BAD_INPUT, EXIT_LOST_PEER):
            raise SystemExit(failure.exitcode)  # the rank already printed its one line
        how = (f"was killed by {signal.Signals(-failure.exitcode).name}" if failure.exitcode < 0
               else f"exited with status {failure.exitcode}")
        fail(f"{_this_node()}: rank {rank} {how} without saying why (see its output above)", code=1)
    except RendezvousTimeoutError:
        conf = dict(item.split("=", 1) for item in args.rdzv_conf.split(",") if "=" in item)
        fail(f"{_this_node()}: not all {args.nnodes} nodes joined the rendezvous at {args.rdzv_endpoint} within "
             f"{conf.get('join_timeout', 600)} s: did every node start, and can it reach that address?", code=1)
    except RendezvousConnectionError:
        fail(f"{_this_node()}: lost the rendezvous store at {args.rdzv_endpoint}: node 0, which hosts it, is "
             "gone or unreachable", code=1)
    except RendezvousError as exc:
        fail(f"{_this_node()}: the rendezvous at {args.rdzv_endpoint} failed: {exc}", code=1)
    except SignalException as exc:
        fail(f"{_this_node()}: stopped by {exc.sigval.name}", code=128 + exc.sigval.value)


if __name__ == "__main__":
    main()
