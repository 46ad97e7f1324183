"""Start hetpipe on emulated nodes exactly as a user starts it on each node of a cluster.

Each node is a network namespace of tests/emulated_nodes.py; inside it the
node runs ``scripts/launch_cluster.sh`` with the variables a user sets
(NODE_RANK, RDZV_ENDPOINT = node 0's address, HETPIPE_JOB_TOKEN) and nothing
else: the NICs, torchrun's --local-addr and gloo's interfaces all come from
the cluster config (cpu_2node: NICs by subnet). Shared by
tests/test_two_nodes.py and tests/test_node_faults.py.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from cli_zygote import python_shim
from conftest import REPO, USUAL_ENV
from emulated_nodes import emu

LAUNCHER = REPO / "scripts" / "launch_cluster.sh"
# A job small enough for two cores, whose activations (4 x 256 x 128 fp32 =
# 512 KiB) are large enough to be striped over both NICs (two 256 KiB pieces).
JOB = ["cluster=cpu_2node", "+model=tiny_llama", "train.seq_length=256", "train.micro_batch_size=4",
       "train.global_batch_size=8", "train.log_interval=1", "logging.progress=false"]
# What a user's shell may hold that would place the node differently.
_FOREIGN = ("SLURM_", "KUBERNETES_", "NODE_RANK", "NNODES", "RDZV_", "MASTER_", "HETPIPE_", "GLOO_", "NCCL_")


@dataclass
class NodeRun:
    """One node's launch_cluster.sh: its process and its merged stdout/stderr."""

    rank: int
    proc: subprocess.Popen
    log: Path
    ended: Optional[float] = None  # time.monotonic() when it exited, from wait_all

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def errors(self) -> list[str]:
        return [line for line in self.output().splitlines() if line.startswith("hetpipe: error: ")]


def plain_env() -> dict[str, str]:
    """This process's environment without anything that would place a node or pick its NICs."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN)}


def start_nodes(nodes: emu.EmulatedNodes, args: list[str], tmp_path: Path, *, deadline_s: float = 15.0,
                rdzv_timeout_s: Optional[float] = None, python: Optional[dict[int, str]] = None,
                only: Optional[Sequence[int]] = None, doctor: bool = False,
                env: Optional[dict[str, str]] = None, forked: bool = True) -> list[NodeRun]:
    """launch_cluster.sh ``args`` on every node (or the nodes ``only`` lists); node k's
    run dir is ``tmp_path/run<k>``. torchrun's rendezvous waits ``rdzv_timeout_s``
    (default: the deadline) for the other node; ``python`` replaces the
    interpreter on some nodes (PYTHON, as launch_cluster.sh reads it).
    launch_cluster.sh's pre-flight doctor is off unless ``doctor``: its bandwidth
    probes would add traffic to the NIC counters these tests read, and fault
    tests time the job alone (tests/test_doctor.py and test_scheduler_env.py run it).
    ``env`` joins every node's environment last (an injected fault, hetpipe.process.faults);
    ``forked``: the launchers fork from this worker's zygote (tests/cli_zygote.py), else
    they are fresh interpreters."""
    default_python = python_shim(USUAL_ENV) if forked else sys.executable
    extra, env = env or {}, plain_env()
    env.update(PYTHONUNBUFFERED="1", HETPIPE_JOB_TOKEN=secrets.token_hex(32),
               RDZV_ENDPOINT=f"{nodes[0].addrs['eth1']}:29400",
               HETPIPE_RDZV_TIMEOUT_S=f"{rdzv_timeout_s or deadline_s:g}", HETPIPE_DOCTOR="1" if doctor else "0")
    runs = []
    for node in nodes.nodes:
        if only is not None and node.rank not in only:
            continue
        log = tmp_path / f"node{node.rank}.log"
        node_env = {**env, "NODE_RANK": str(node.rank), "PYTHON": (python or {}).get(node.rank, default_python),
                    **extra}
        with log.open("w") as out:
            proc = emu.run_in(node, ["bash", str(LAUNCHER), *args, f"cluster.transport.deadline_s={deadline_s}",
                                     f"hydra.run.dir={tmp_path / f'run{node.rank}'}"],
                              env=node_env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        runs.append(NodeRun(node.rank, proc, log))
    return runs


def wait_for(what: str, ready: Callable[[], bool], runs: list[NodeRun], timeout: float = 120.0) -> None:
    """Poll ``ready`` until it holds; fail with the nodes' output if a node ends first or time runs out."""
    until = time.monotonic() + timeout
    while not ready():
        ended = [run for run in runs if run.proc.poll() is not None]
        if ended or time.monotonic() > until:
            raise AssertionError(f"no {what} " + ("before a node ended" if ended else f"within {timeout:g} s") +
                                 "".join(f"\n--- node {r.rank}:\n{r.output()[-2500:]}" for r in runs))
        time.sleep(0.1)


def wait_all(runs: list[NodeRun], timeout: float) -> list[int]:
    """Every launcher's exit status, each one's exit time noted as it happens; a
    launcher still running after ``timeout`` s fails the test with its output."""
    until = time.monotonic() + timeout
    while any(run.ended is None for run in runs):
        for run in runs:
            if run.ended is None and run.proc.poll() is not None:
                run.ended = time.monotonic()
        if time.monotonic() > until:
            late = [run for run in runs if run.ended is None]
            raise AssertionError(f"still running after {timeout:g} s:" + "".join(
                f"\n--- node {r.rank}:\n{r.output()[-2500:]}" for r in late))
        time.sleep(0.05)
    return [run.proc.returncode for run in runs]


def node_pids(node: emu.Node) -> list[int]:
    """Every process of the node: its launcher and its ranks."""
    out = subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def kill_node(node: emu.Node) -> None:
    """SIGKILL every process of the node - its launcher, its ranks - as a node that dies takes all of them."""
    for pid in node_pids(node):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def training(run_dir: Path, steps: int = 2) -> Callable[[], bool]:
    """True once node 0 (hetpipe rank 0) has logged ``steps`` steps."""
    return lambda: len(metrics(run_dir)) >= steps
