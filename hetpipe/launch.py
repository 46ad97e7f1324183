"""Start the ranks of a job: under torchrun use its environment, otherwise start
the local ranks through PyTorch's own elastic launcher.

No home-made process manager: for a cluster that fits on this machine,
``torch.distributed.launcher.api.elastic_launch`` (what ``torchrun
--standalone`` uses) spawns one worker per rank, sets RANK / LOCAL_RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT, watches them and tears all of them down
when one fails. A multi-node cluster is started with one torchrun per node.
A worker that fails on bad input prints its one ``hetpipe: error:`` line and
exits 2; the launcher then reports which rank failed, in one line.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import secrets
import sys
import uuid
from typing import Any, Callable

from hetpipe.cluster import ClusterConfig
from hetpipe.errors import ConfigError, HetpipeError, fail


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def rank_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) of this process (0, 1, 0 outside a launcher)."""
    if under_torchrun():
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    return 0, 1, 0


def _worker(fn: Callable[..., Any], args: tuple) -> Any:
    """Entry point of each spawned rank: bad input becomes one line and exit 2.

    ``HETPIPE_STACK_DUMP_S=N`` makes every rank print all its threads' stacks
    after N seconds - the quickest way to see where a hung job waits.
    """
    if os.environ.get("HETPIPE_STACK_DUMP_S"):
        faulthandler.dump_traceback_later(float(os.environ["HETPIPE_STACK_DUMP_S"]), exit=False)
    try:
        return fn(*args)
    except HetpipeError as exc:
        rank = os.environ.get("RANK", "?")
        print(f"hetpipe: error: [rank {rank}] {exc}", file=sys.stderr, flush=True)
        os._exit(2)  # skip interpreter teardown: peers may hold sockets to us


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
        return fn(*args)
    if world == 1:
        return fn(*args)
    if not cluster.single_node:
        raise ConfigError(f"cluster {cluster.name!r} spans several nodes: start it with one torchrun per "
                          "node (see scripts/launch_cluster.sh)")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The job token authenticates channel handshakes; children inherit it.
    os.environ.setdefault("HETPIPE_JOB_TOKEN", secrets.token_hex(16))
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
        if failure.exitcode == 2:
            raise SystemExit(2)  # the rank already printed its one-line error
        fail(f"rank {rank} failed with exit code {failure.exitcode} "
             f"({failure.message or 'see its output above'})", code=1)
    return results[0]
