"""This node's place in a multi-node job, derived from whoever started it.

A multi-node hetpipe job is one ``torchrun`` per node. Each needs the same
facts: how many nodes, which node this is *in the cluster config's group order*
(the pipeline order: ranks are numbered group by group), how many ranks it
runs, which vendor group those ranks belong to, and where the rendezvous is.
A user's plain variables (``NODE_RANK``, ``RDZV_ENDPOINT``), a Slurm
heterogeneous job (one component per vendor partition) and Kubernetes (one pod
group per vendor) state these facts in three different ways; this module turns
each into the same ``HETPIPE_*`` variables, which ``scripts/launch_cluster.sh``
evals and hands to torchrun. The functions are pure over a mapping of
environment variables, so tests feed them what Slurm or Kubernetes would set.
The Slurm and Kubernetes paths are not run on a real scheduler by this project.

Why ``HETPIPE_FIRST_RANK`` exists: torchrun's c10d rendezvous ignores
``--node-rank`` (torch warns that it is only used by the static backend) and
numbers the nodes by their sorted host address, so an AMD node whose name
sorts first would get the NVIDIA group's ranks. launch_cluster.sh therefore
sets each worker's ``RANK`` to ``HETPIPE_FIRST_RANK + LOCAL_RANK``, which
follows the cluster config whatever the host names are.

    python -m hetpipe.launch.scheduler_env [--scheduler auto|env|slurm|k8s] [--cluster NAME] [-- OVERRIDES...]
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Mapping, Optional, Sequence

import yaml
from omegaconf import OmegaConf

from hetpipe.devices.cluster import ClusterConfig, GroupConfig
from hetpipe.comm.nics import check_dialable, resolve_local_nics, selection_setting
from hetpipe.errors import ConfigError, config_error_from, run_cli
# The token-file rules live in job_secret (one implementation); read_token_file stays importable from here.
from hetpipe.launch.job_secret import check_secret_strength, find_job_secret, read_token_file  # noqa: F401

SCHEDULERS = ("auto", "env", "slurm", "k8s")
# torch's own default for a c10d rendezvous endpoint without a port.
DEFAULT_RDZV_PORT = 29400


@dataclass(frozen=True)
class NodeLaunch:
    """What one node's torchrun needs, in the cluster config's terms."""

    scheduler: str
    cluster: str
    nnodes: int
    node_rank: int
    nproc_per_node: int
    # Global rank of this node's local rank 0 in the cluster config's order.
    first_rank: int
    group: str
    vendor: str
    rdzv_endpoint: str
    rdzv_id: str
    # Told to torchrun (--rdzv-conf is_host=...) instead of letting it guess
    # from host names, which fails behind DNS aliases such as a Kubernetes
    # headless service.
    rdzv_is_host: bool

    def exports(self) -> dict[str, str]:
        return {
            "HETPIPE_CLUSTER": self.cluster,
            "HETPIPE_NNODES": str(self.nnodes),
            "HETPIPE_NODE_RANK": str(self.node_rank),
            "HETPIPE_NPROC_PER_NODE": str(self.nproc_per_node),
            "HETPIPE_FIRST_RANK": str(self.first_rank),
            "HETPIPE_GROUP": self.group,
            "HETPIPE_VENDOR": self.vendor,
            "HETPIPE_RDZV_ENDPOINT": self.rdzv_endpoint,
            "HETPIPE_RDZV_ID": self.rdzv_id,
            "HETPIPE_RDZV_IS_HOST": "1" if self.rdzv_is_host else "0",
        }

    def shell(self) -> str:
        """``export`` lines for a POSIX shell's eval."""
        return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in self.exports().items())

    def summary(self) -> str:
        last = self.first_rank + self.nproc_per_node - 1
        return (f"hetpipe: node {self.node_rank} of {self.nnodes} ({self.scheduler}): group {self.group} "
                f"({self.vendor}), ranks {self.first_rank}-{last} of cluster {self.cluster}; rendezvous "
                f"{self.rdzv_endpoint} id {self.rdzv_id}{' (hosted here)' if self.rdzv_is_host else ''}")


@dataclass(frozen=True)
class _Slot:
    """One node of the multi-node layout: the ``index``-th node of ``group``."""

    group: GroupConfig
    index: int
    first_rank: int


def node_layout(cluster: ClusterConfig) -> list[_Slot]:
    """Every node of ``cluster`` in node-rank order: group by group, as ranks are numbered."""
    slots: list[_Slot] = []
    rank = 0
    for group in cluster.groups:
        for index in range(group.nodes):
            slots.append(_Slot(group, index, rank))
            rank += group.ranks_per_node
    return slots


def _multi_node(scheduler: str, cluster: ClusterConfig, node_rank: int, endpoint: str, rdzv_id: str) -> NodeLaunch:
    slots = node_layout(cluster)
    slot = slots[node_rank]
    return NodeLaunch(scheduler, cluster.name, len(slots), node_rank, slot.group.ranks_per_node, slot.first_rank,
                      slot.group.name, slot.group.vendor, endpoint, rdzv_id, node_rank == 0)


def _one_host(scheduler: str, cluster: ClusterConfig, rdzv_id: str) -> NodeLaunch:
    """Every rank of the cluster on this machine (cpu_mixed, gpu2_mixed, ...)."""
    # Port 0: the store picks a free port, as torchrun --standalone does.
    return NodeLaunch(scheduler, cluster.name, 1, 0, cluster.world_size, 0,
                      ",".join(g.name for g in cluster.groups), ",".join(g.vendor for g in cluster.groups),
                      "127.0.0.1:0", rdzv_id, True)


def _int(env: Mapping[str, str], name: str, minimum: int = 0) -> Optional[int]:
    """``env[name]`` as an int of at least ``minimum``; None if unset or empty."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} must be at least {minimum}")
    return value


def _endpoint(value: str, name: str) -> str:
    """``host[:port]`` (IPv6 in brackets) as ``host:port``, the port defaulting to 29400."""
    host, port = value.strip(), str(DEFAULT_RDZV_PORT)
    match = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d+))?", host)
    if not match:
        raise ConfigError(f"{name}={value!r} is not host[:port]")
    if match.group(1):
        host, port = f"[{match.group(1)}]", match.group(2) or port
    else:
        host, port = match.group(3), match.group(4) or port
    if not 0 < int(port) < 65536:
        raise ConfigError(f"{name}={value!r}: port {port} is outside 1..65535")
    return f"{host}:{port}"


def _rdzv_id(env: Mapping[str, str], default: str) -> str:
    return env.get("RDZV_ID", "").strip() or default


def _check_nproc(env: Mapping[str, str], launch: NodeLaunch) -> NodeLaunch:
    nproc = _int(env, "NPROC_PER_NODE", minimum=1)
    if nproc is not None and nproc != launch.nproc_per_node:
        raise ConfigError(f"NPROC_PER_NODE={nproc} but cluster {launch.cluster!r} runs "
                          f"{launch.nproc_per_node} ranks on node {launch.node_rank} (group {launch.group})")
    return launch


def from_env(env: Mapping[str, str], cluster: ClusterConfig) -> NodeLaunch:
    """From the user's own variables: ``NODE_RANK``, ``NNODES``, ``RDZV_ENDPOINT``
    (or ``MASTER_ADDR`` [+ ``MASTER_PORT``]), ``RDZV_ID``, ``NPROC_PER_NODE``.

    Without ``NODE_RANK`` (or with ``NNODES=1``) the whole cluster runs on this
    machine. Otherwise ``NNODES`` defaults to, and must equal, the cluster's
    node count, and node ``NODE_RANK`` runs that node of the group order.
    """
    total = len(node_layout(cluster))
    node_rank = _int(env, "NODE_RANK")
    nnodes = _int(env, "NNODES", minimum=1)
    rdzv_id = _rdzv_id(env, f"hetpipe-{cluster.name}")
    if nnodes == 1 or (nnodes is None and node_rank is None):
        if node_rank:
            raise ConfigError(f"NODE_RANK={node_rank} but NNODES=1")
        return _check_nproc(env, _one_host("env", cluster, rdzv_id))
    if nnodes is not None and nnodes != total:
        raise ConfigError(f"NNODES={nnodes} but cluster {cluster.name!r} has {total} nodes "
                          f"({_node_counts(cluster)}); use NNODES=1 to run all of it on one machine")
    if node_rank is None:
        raise ConfigError(f"NODE_RANK is not set: give each of the {total} nodes its index "
                          f"in cluster {cluster.name!r}'s group order ({_node_counts(cluster)})")
    if node_rank >= total:
        raise ConfigError(f"NODE_RANK={node_rank} but cluster {cluster.name!r} has {total} nodes "
                          f"({_node_counts(cluster)})")
    if env.get("RDZV_ENDPOINT", "").strip():
        endpoint = _endpoint(env["RDZV_ENDPOINT"], "RDZV_ENDPOINT")
    elif env.get("MASTER_ADDR", "").strip():
        port = _int(env, "MASTER_PORT", minimum=1) or DEFAULT_RDZV_PORT
        endpoint = _endpoint(f"{env['MASTER_ADDR'].strip()}:{port}", "MASTER_ADDR")
    else:
        raise ConfigError("RDZV_ENDPOINT is not set: give every node node 0's host:port (or MASTER_ADDR)")
    return _check_nproc(env, _multi_node("env", cluster, node_rank, endpoint, rdzv_id))


def _node_counts(cluster: ClusterConfig) -> str:
    return " + ".join(f"{g.name} {g.nodes}" for g in cluster.groups)


# One comma-separated item of a Slurm host list: literal text and [ranges].
_HOST_ITEM = r"(?:[^,\[\]]+|\[[^\[\]]*\])+"


def expand_hostlist(spec: str) -> list[str]:
    """Slurm's compressed host list (``gpu-[01-03,07],login1``, ``r[1-2]n[1-2]``)
    as host names in Slurm's order, without needing ``scontrol``; zero padding
    follows each range's start."""
    spec = spec.strip()
    if not re.fullmatch(rf"{_HOST_ITEM}(?:,{_HOST_ITEM})*", spec):
        raise ConfigError(f"{spec!r} is not a Slurm host list")
    hosts: list[str] = []
    for item in re.findall(_HOST_ITEM, spec):
        names = [""]
        for literal, ranges in re.findall(r"([^\[\]]+)|\[([^\[\]]*)\]", item):
            parts = [literal] if literal else _expand_ranges(ranges, spec)
            names = [name + part for name in names for part in parts]
        hosts.extend(names)
    return hosts


def _expand_ranges(ranges: str, spec: str) -> list[str]:
    out = []
    for part in ranges.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not match:
            raise ConfigError(f"{spec!r} has a bad range {part!r}")
        lo, hi = match.group(1), match.group(2) or match.group(1)
        if int(hi) < int(lo):
            raise ConfigError(f"{spec!r} has a descending range {part!r}")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def _hosts(env: Mapping[str, str], name: str) -> list[str]:
    value = env.get(name, "").strip()
    if not value:
        raise ConfigError(f"{name} is not set")
    try:
        return expand_hostlist(value)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def from_slurm(env: Mapping[str, str], cluster: ClusterConfig) -> NodeLaunch:
    """From a Slurm job step that runs one task per node (``srun --ntasks-per-node=1``).

    A heterogeneous job has one component per cluster group, in the cluster
    config's order: component K's nodes (``SLURM_JOB_NODELIST_HET_GROUP_K``)
    run group K. The node is found by ``SLURMD_NODENAME`` in those lists (a
    task launched with ``srun --het-group=K`` is told nothing more direct),
    node 0 is the first node of component 0 and hosts the rendezvous, and the
    rendezvous id is ``SLURM_JOB_ID``, the heterogeneous job leader's id on
    every component. Where Slurm's node names do not resolve to the nodes'
    addresses (a NodeAddr that differs from the NodeName), set RDZV_ENDPOINT.
    A plain (not heterogeneous) job fits a one-group cluster, or a cluster
    that runs on one machine.
    """
    job_id = env.get("SLURM_JOB_ID", "").strip()
    if not job_id:
        raise ConfigError("SLURM_JOB_ID is not set: not inside a Slurm job")
    rdzv_id = _rdzv_id(env, job_id)
    het_size = _int(env, "SLURM_HET_SIZE", minimum=1)
    if het_size is None:
        hosts = _hosts(env, "SLURM_JOB_NODELIST")
        if len(hosts) == 1:
            return _check_slurm_gpus(env, _one_host("slurm", cluster, rdzv_id))
        if len(cluster.groups) > 1:
            raise ConfigError(f"SLURM_HET_SIZE is not set but cluster {cluster.name!r} has groups "
                              f"{', '.join(g.name for g in cluster.groups)}: submit a heterogeneous job with "
                              "one component per group (scripts/slurm/hetpipe_hetjob.sbatch)")
        components = [hosts]
        names = ["SLURM_JOB_NODELIST"]
    else:
        if het_size != len(cluster.groups):
            raise ConfigError(f"SLURM_HET_SIZE={het_size} but cluster {cluster.name!r} has "
                              f"{len(cluster.groups)} groups, one job component each")
        names = [f"SLURM_JOB_NODELIST_HET_GROUP_{k}" for k in range(het_size)]
        components = [_hosts(env, name) for name in names]
    for group, hosts, name in zip(cluster.groups, components, names):
        if len(hosts) != group.nodes:
            raise ConfigError(f"{name} has {len(hosts)} nodes but group {group.name!r} of cluster "
                              f"{cluster.name!r} has {group.nodes}")
    node = env.get("SLURMD_NODENAME", "").strip()
    if not node:
        raise ConfigError("SLURMD_NODENAME is not set: start launch_cluster.sh through srun, one task per node")
    found = [(k, hosts.index(node)) for k, hosts in enumerate(components) if node in hosts]
    if len(found) != 1:
        where = "none" if not found else ", ".join(names[k] for k, _ in found)
        raise ConfigError(f"SLURMD_NODENAME={node} must be in exactly one job component's node list; "
                          f"found in {where}")
    component, index = found[0]
    node_rank = sum(g.nodes for g in cluster.groups[:component]) + index
    if env.get("RDZV_ENDPOINT", "").strip():
        endpoint = _endpoint(env["RDZV_ENDPOINT"], "RDZV_ENDPOINT")
    else:
        port = _int(env, "HETPIPE_RDZV_PORT", minimum=1) or DEFAULT_RDZV_PORT
        endpoint = _endpoint(f"{components[0][0]}:{port}", names[0])
    return _check_slurm_gpus(env, _multi_node("slurm", cluster, node_rank, endpoint, rdzv_id))


def _check_slurm_gpus(env: Mapping[str, str], launch: NodeLaunch) -> NodeLaunch:
    gpus = _int(env, "SLURM_GPUS_ON_NODE")
    # Unset or 0: no GPUs were asked for (CPU ranks); nothing to compare.
    if gpus and gpus < launch.nproc_per_node:
        raise ConfigError(f"SLURM_GPUS_ON_NODE={gpus} but node {launch.node_rank} (group {launch.group}) runs "
                          f"{launch.nproc_per_node} ranks: ask for --gpus-per-node={launch.nproc_per_node}")
    return _check_nproc(env, launch)


def from_k8s(env: Mapping[str, str], cluster: ClusterConfig) -> NodeLaunch:
    """From a Kubernetes pod of one pod group per cluster group.

    The pod group says which group it runs (``HETPIPE_GROUP``); the pod's index
    in it is ``JOB_COMPLETION_INDEX`` (an Indexed Job) or the ordinal that ends
    ``HOSTNAME`` (a StatefulSet). ``RDZV_ENDPOINT`` names the first group's
    first pod through the headless service, the same value in every pod.
    """
    name = env.get("HETPIPE_GROUP", "").strip()
    groups = [g.name for g in cluster.groups]
    if name not in groups:
        raise ConfigError(f"HETPIPE_GROUP={name!r} must name this pod group's group of cluster "
                          f"{cluster.name!r}: one of {', '.join(groups)}")
    group_index = groups.index(name)
    group = cluster.groups[group_index]
    index = _int(env, "JOB_COMPLETION_INDEX")
    source = "JOB_COMPLETION_INDEX"
    if index is None:
        source = "HOSTNAME"
        match = re.search(r"-(\d+)$", env.get("HOSTNAME", ""))
        if not match:
            raise ConfigError("JOB_COMPLETION_INDEX is not set and HOSTNAME does not end in a pod ordinal: "
                              "run each group as an Indexed Job or a StatefulSet")
        index = int(match.group(1))
    if index >= group.nodes:
        raise ConfigError(f"{source} gives pod index {index} but group {name!r} of cluster "
                          f"{cluster.name!r} has {group.nodes} nodes")
    if not env.get("RDZV_ENDPOINT", "").strip():
        raise ConfigError("RDZV_ENDPOINT is not set: give every pod the first group's first pod through "
                          "the headless service, e.g. hetpipe-nvidia-0.hetpipe-rdzv:29400")
    endpoint = _endpoint(env["RDZV_ENDPOINT"], "RDZV_ENDPOINT")
    node_rank = sum(g.nodes for g in cluster.groups[:group_index]) + index
    return _check_nproc(env, _multi_node("k8s", cluster, node_rank, endpoint,
                                         _rdzv_id(env, f"hetpipe-{cluster.name}")))


def detect_scheduler(env: Mapping[str, str]) -> str:
    """The user's own NODE_RANK/NNODES win, then Slurm, then Kubernetes, else plain env."""
    if env.get("NODE_RANK", "").strip() or env.get("NNODES", "").strip():
        return "env"
    if env.get("SLURM_JOB_ID", "").strip():
        return "slurm"
    if env.get("KUBERNETES_SERVICE_HOST", "").strip():
        return "k8s"
    return "env"


def derive(env: Mapping[str, str], cluster: ClusterConfig, scheduler: str = "auto") -> NodeLaunch:
    """This node's launch from ``env``, as ``scheduler`` (or the detected one) describes it."""
    if scheduler not in SCHEDULERS:
        raise ConfigError(f"scheduler {scheduler!r} is not one of {SCHEDULERS}")
    if scheduler == "auto":
        scheduler = detect_scheduler(env)
    return {"env": from_env, "slurm": from_slurm, "k8s": from_k8s}[scheduler](env, cluster)


def check_job_token(env: Mapping[str, str], nnodes: int) -> None:
    """Every node of a multi-node job must bring the same secret itself; it is
    never drawn by rank 0 and shared through the rendezvous store, which any
    host that reaches the endpoint could read. A secret that is given must be a
    random one (:func:`hetpipe.launch.job_secret.secret_problem`)."""
    token = find_job_secret(env)
    if token is None and nnodes > 1:
        raise ConfigError(f"HETPIPE_JOB_TOKEN is not set: a job on {nnodes} nodes needs the same secret on "
                          "every node, in HETPIPE_JOB_TOKEN or in a file named by HETPIPE_JOB_TOKEN_FILE")
    if token is not None:
        check_secret_strength(token, env)


def cluster_choice(name: Optional[str], overrides: Sequence[str]) -> tuple[str, list[tuple[str, str]]]:
    """The cluster config's name and its ``cluster.*`` overrides among pretrain's
    hydra overrides, so that the layout here is the one pretrain composes."""
    chosen, updates = None, []
    for override in overrides:
        key, sep, value = override.lstrip("+").partition("=")
        if not sep:
            continue
        if key == "cluster":
            chosen = value
        elif key.startswith("cluster."):
            updates.append((key[len("cluster."):], value))
    return name or chosen or _default_cluster(), updates


def _default_cluster() -> str:
    """pretrain's default cluster, from its defaults list (configs/pretrain.yaml)."""
    primary = yaml.safe_load((files("hetpipe.configs") / "pretrain.yaml").read_text(encoding="utf-8"))
    return next(d["cluster"] for d in primary["defaults"] if isinstance(d, dict) and "cluster" in d)


def load_cluster(name: str, updates: Sequence[tuple[str, str]] = ()) -> ClusterConfig:
    """``configs/cluster/<name>.yaml`` (package data) with ``updates`` applied and checked."""
    folder = files("hetpipe.configs") / "cluster"
    path = folder / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))
        raise ConfigError(f"no cluster config {name!r}: one of {', '.join(names)}")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(ClusterConfig),
                              yaml.safe_load(path.read_text(encoding="utf-8")))
        for key, value in updates:
            OmegaConf.update(cfg, key, yaml.safe_load(value), merge=True)
        cluster: Any = OmegaConf.to_object(cfg)
    except Exception as exc:  # noqa: BLE001 - OmegaConf wraps errors raised in __post_init__
        raise config_error_from(exc, f"cluster {name!r}: ") from None
    return cluster


def local_address(cluster: ClusterConfig) -> str:
    """This node's first channel NIC address (``cluster.transport``), for torchrun's --local-addr.

    torchrun otherwise publishes the address this host's name resolves to,
    often loopback (always inside a network namespace, which keeps the host's
    name), and the other nodes' ranks then dial their own loopback for the
    store. A wildcard is refused here, before torchrun starts; loopback is
    left to the ranks, which know whether the nodes share one host.
    """
    addresses = [nic.address for nic in resolve_local_nics(cluster.transport)]
    check_dialable(addresses, False, selection_setting(cluster.transport))
    return addresses[0]


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hetpipe.launch.scheduler_env",
        description="Print this node's launch environment as shell export lines (for launch_cluster.sh).")
    parser.add_argument("--scheduler", choices=SCHEDULERS, default="auto",
                        help="where the node's place comes from (auto: NODE_RANK/NNODES, else Slurm, "
                             "else Kubernetes)")
    parser.add_argument("--cluster", help="cluster config name (default: cluster=NAME among the overrides, "
                                          "else pretrain's default)")
    parser.add_argument("overrides", nargs="*", help="pretrain's overrides; cluster=NAME and cluster.* apply")
    args = parser.parse_args(argv)

    def run() -> None:
        cluster = load_cluster(*cluster_choice(args.cluster, args.overrides))
        launch = derive(os.environ, cluster, args.scheduler)
        check_job_token(os.environ, launch.nnodes)
        local = local_address(cluster) if launch.nnodes > 1 else None
        print(launch.summary(), file=sys.stderr)
        print(launch.shell())
        if local is not None:
            print(f"export HETPIPE_LOCAL_ADDR={shlex.quote(local)}")

    run_cli(run)


if __name__ == "__main__":
    main()
