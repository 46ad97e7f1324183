"""``python -m hetpipe.launch TORCHRUN_ARGS...``: torchrun with one-line failures.

What scripts/launch_cluster.sh runs on every node of a multi-node job. It is
torchrun's own ``run`` under hetpipe's agent (:mod:`hetpipe.launch.agent`);
only the way a failure is reported differs.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional, Sequence

from hetpipe.errors import fail


def _this_node() -> str:
    """``node 1 of 2`` from launch_cluster.sh's variables, for the launcher's own lines."""
    node, nodes = os.environ.get("HETPIPE_NODE_RANK"), os.environ.get("HETPIPE_NNODES")
    return f"node {node} of {nodes}" if node and nodes else "this node"


def _parse_args(argv: list[str]) -> Any:
    """torchrun's own command line (``torch.distributed.run.parse_args``), under the
    program name it had when this was hetpipe/launch.py: argparse takes the name
    from sys.argv[0], now hetpipe/launch/__main__.py, for its usage and error lines."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "launch.py"
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m hetpipe.launch TORCHRUN_ARGS...``: torchrun with one-line failures.

    A failed job exits with its ranks' status - 1 a crashed rank, 2 bad
    input, 3 a lost node, link or peer, 4 a device out of memory - after
    their lines; a rank that could not say why (killed by a signal) gets
    this node's line, and so does a rendezvous that did not complete (exit
    1). SIGTERM, SIGUSR1 and the
    other signals torchrun forwards end it with 0 if every local rank saved a
    checkpoint on it, else 128 + the signal (hetpipe/launch/agent.py).
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
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousError,
        RendezvousTimeoutError,
    )
    from torch.distributed.run import run

    # Like torch itself, only now: the agent imports torch at its top.
    from hetpipe.launch.agent import HANDLED_SIGNALS, agent_run, quiet_torch_launcher
    from hetpipe.process.torch_compat import require_supported_torch

    require_supported_torch()

    args = _parse_args(list(sys.argv[1:] if argv is None else argv))
    # SIGUSR1/SIGUSR2 too (train.preemption_signals): unhandled, either would
    # kill this launcher and leave its ranks running.
    handled = args.signals_to_handle.split(",")
    args.signals_to_handle = ",".join(handled + [s for s in HANDLED_SIGNALS.split(",") if s not in handled])
    quiet_torch_launcher()
    node = os.environ.get("HETPIPE_NNODES", "1") != "1"
    try:
        agent_run(lambda: run(args), node=f"{_this_node()}: " if node else "")
    except RendezvousTimeoutError:
        conf = dict(item.split("=", 1) for item in args.rdzv_conf.split(",") if "=" in item)
        fail(f"{_this_node()}: not all {args.nnodes} nodes joined the rendezvous at {args.rdzv_endpoint} within "
             f"{conf.get('join_timeout', 600)} s: did every node start, and can it reach that address?", code=1)
    except RendezvousConnectionError:
        fail(f"{_this_node()}: lost the rendezvous store at {args.rdzv_endpoint}: node 0, which hosts it, is "
             "gone or unreachable", code=1)
    except RendezvousError as exc:
        fail(f"{_this_node()}: the rendezvous at {args.rdzv_endpoint} failed: {exc}", code=1)
