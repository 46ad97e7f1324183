"""``python -m hetpipe.doctor cluster=NAME [+model=NAME] [overrides]``: can a job start on these nodes?

A mixed cluster fails late and far from the cause: a torch release hetpipe
does not support on one node, a NIC name that one node's image lacks
surfaces as a connect timeout minutes in, data that differs between the node feeding the inputs
and the node computing the loss trains on garbage without any error. The
doctor finds these before the job starts. Give it the job's own command line
(the same config groups and schema as ``hetpipe.pretrain``) and run it on
every node, one process per node::

    HETPIPE_NODE_RANK=K torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:PORT -m hetpipe.doctor cluster=... +model=... data=...

where K is the node's index in the cluster config's group order (torchrun's
c10d rendezvous ignores ``--node-rank`` and numbers nodes by host name; without
``HETPIPE_NODE_RANK`` the doctor takes that number). ``scripts/launch_cluster.sh``
with ``HETPIPE_DOCTOR=1`` does all this on every node before the job. Or run it
without torchrun to check this node alone. It prints a table of this node
(host, torch build, GPUs, NICs and the ones the config selects, RDMA devices,
whether GPU memory can be registered for RDMA - facts read from sysfs, not
verified on RDMA hardware) and, under torchrun, compares the nodes through the
rendezvous store: hetpipe version, each node's torch build (one line each:
any supported release, CUDA or ROCm, on any node - report.torch_lines
says from what evidence), config hash (the
resolved config minus the fields that may differ per node: NIC addresses and
interface names, data and tokenizer paths), data and tokenizer checksums, and
for every ordered pair of nodes and each selected NIC a TCP connect to the
peer's doctor (bound to the local NIC, as the channel dials) followed by
``doctor.bandwidth_s`` of traffic. Nodes exchange only their fact sheets and
test results; no process group is made, so a mismatch cannot hang the check.

Exit status: 0 when a job can start; 1 with one ``hetpipe doctor: blocker:``
line per thing to fix; 2 with the usual ``hetpipe: error:`` line when the
command line itself is bad. Loopback counts as undialable when the job spans
hosts: when the config gives a group several nodes, or when the nodes do not
share one network stack (boot id and network namespace differ), which is
also how emulated nodes in network namespaces are told apart.

The work is split by job: hetpipe/doctor/facts.py reads this node's fact
sheet (and documents the test hooks that fake a fact), hetpipe/doctor/probe.py
probes the peers' NICs, hetpipe/doctor/report.py turns sheets and probe
results into blockers and tables; this module finds the node's place, runs
them in order and exchanges sheets and results through the rendezvous store.
"""
from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

import hydra
import torch.distributed as dist
from omegaconf import DictConfig

from hetpipe.comm.nics import Nic
from hetpipe.doctor.config import DoctorConfig, DoctorSettings, register_doctor_config
from hetpipe.doctor.facts import fact_sheet
from hetpipe.doctor.probe import ProbeServer, describe_os_error, probe_peers
from hetpipe.doctor.report import blockers_of, format_cluster, format_node, multi_node_job, torch_lines, warnings_of
from hetpipe.errors import ConfigError, run_cli
from hetpipe.process.rank_env import under_torchrun
from hetpipe.schema.pretrain_config import resolve

_STORE_PREFIX = "hetpipe-doctor"


def node_place() -> tuple[int, int]:
    """(this node's index in the cluster config's group order, the number of nodes), under a launcher.

    torchrun's c10d rendezvous numbers the nodes (GROUP_RANK) by sorted host
    address, so an AMD node whose name sorts first would take the NVIDIA
    group's place, label and reference role; scripts/launch_cluster.sh
    exports the config's own index as HETPIPE_NODE_RANK. Launchers that set
    only the torch variables imply the node from equal node sizes.
    """
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", int(os.environ["WORLD_SIZE"]) // per_node))
    configured = os.environ.get("HETPIPE_NODE_RANK")
    if configured:
        if not configured.isdigit() or int(configured) >= nodes:
            raise ConfigError(f"HETPIPE_NODE_RANK={configured} is not a node index of this {nodes}-node job "
                              f"(0 to {nodes - 1})")
        return int(configured), nodes
    return int(os.environ.get("GROUP_RANK", int(os.environ["RANK"]) // per_node)), nodes


def run_doctor(cfg: DoctorConfig, raw: DictConfig) -> int:
    """Check this node and, under torchrun, all nodes; print the report; 0 or 1."""
    node, nodes, store, hosts_store = 0, 1, None, True
    if under_torchrun():
        # Every rank joins the store (without torchrun's agent store, rank 0
        # hosts it and waits for all ranks); one sheet per node is enough.
        store = next(dist.rendezvous("env://", timeout=timedelta(seconds=cfg.doctor.timeout_s)))[0]
        if int(os.environ["LOCAL_RANK"]) != 0:
            return 0
        node, nodes = node_place()
        # RANK follows torchrun's numbering, not the config's, and names the
        # process that hosts the store where torchrun's agent does not.
        hosts_store = int(os.environ["RANK"]) == 0
    sheet, nics = fact_sheet(cfg, raw, node, nodes)
    server = None
    if nics and all(n.name is not None for n in nics):  # a wildcard is no address to publish
        try:
            server = ProbeServer([n.address for n in nics], sheet["nonce"], cfg.doctor.timeout_s)
            sheet["endpoints"] = server.endpoints
        except OSError as exc:
            sheet["blockers"].append(f"cannot listen on {', '.join(n.address for n in nics)}: "
                                     f"{describe_os_error(exc)}")
    print(format_node(sheet), flush=True)
    sheets, pairs, missing = {node: sheet}, [], []
    try:
        if store is not None and nodes > 1:
            sheets, pairs, missing = compare_nodes(store, sheet, nics, server is not None, nodes, cfg.doctor,
                                                   hosts_store)
            print(format_cluster(sheets, pairs, cfg.doctor), flush=True)
    finally:
        if server:
            server.close()
    found = blockers_of(sheets, pairs, multi_node_job(cfg.cluster, sheets))
    found += [f"node {n} did not report within doctor.timeout_s={cfg.doctor.timeout_s:g} s: start the doctor on "
              "every node with the same rendezvous" for n in missing]
    for line in torch_lines(sheets):
        print(f"hetpipe doctor: {line}", flush=True)
    for line in warnings_of(sheets, pairs):
        print(f"hetpipe doctor: warning: {line}", flush=True)
    for line in found:
        print(f"hetpipe doctor: blocker: {line}", flush=True)
    print(f"hetpipe doctor: {len(found)} blocker{'s' * (len(found) != 1)}" if found else
          "hetpipe doctor: ok: a job can start", flush=True)
    return 1 if found else 0


def compare_nodes(store: dist.Store, sheet: dict, nics: list[Nic], listening: bool, nodes: int,
                  settings: DoctorSettings, hosts_store: bool) -> tuple[dict[int, dict], list[dict], list[int]]:
    """Exchange fact sheets through the rendezvous store, probe the peers' NICs,
    exchange the results: (sheets by node, all pair results, nodes that did not report)."""
    node = sheet["node"]
    sheets = _exchange(store, "sheet", node, list(range(nodes)), sheet, settings.timeout_s)
    pairs = probe_peers(sheet, nics, sheets, settings) if listening else []
    # Peers keep their listeners open until everyone has probed them, i.e. has published results.
    results = _exchange(store, "pairs", node, sorted(sheets), pairs, settings.timeout_s)
    # The store's host (rank 0, with launchers that have no agent store) leaves last.
    _exchange(store, "done", node, sorted(results), True, settings.timeout_s if hosts_store else 0)
    missing = [n for n in range(nodes) if n not in results]
    return sheets, [p for n in sorted(results) for p in results[n]], missing


def _exchange(store: dist.Store, kind: str, node: int, expected: list[int], value: Any,
              timeout_s: float) -> dict[int, Any]:
    """Publish ``value`` as this node's ``kind``; read what the ``expected`` nodes published within ``timeout_s``."""
    keys = {n: f"{_STORE_PREFIX}/{kind}/{n}" for n in expected}
    store.set(keys[node], json.dumps(value))
    if timeout_s > 0:
        try:
            store.wait(list(keys.values()), timedelta(seconds=timeout_s))
        except RuntimeError:  # DistStoreError on timeout: the caller sees who is missing
            pass
    return {n: json.loads(store.get(k)) for n, k in keys.items() if store.check([k])}


register_doctor_config()


@hydra.main(version_base=None, config_path="pkg://hetpipe.configs", config_name="doctor")
def main(cfg: DictConfig) -> None:
    # No require_supported_torch() here: an unsupported torch is one of the
    # doctor's blockers, reported on every node (report.blockers_of).
    code = run_cli(lambda: run_doctor(resolve(cfg, DoctorConfig), cfg))
    raise SystemExit(code)
