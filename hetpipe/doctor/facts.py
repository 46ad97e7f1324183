"""This node's fact sheet: what the doctor knows about the node it runs on.

Everything here reads the local machine (torch build and GPUs, NICs and the
ones the config selects, RDMA devices and whether GPU memory can be
registered for them, data and tokenizer checksums, the config's hash) and
returns JSON-ready data, so that a node's sheet can be published through the
rendezvous store and compared with the other nodes' sheets by
hetpipe/doctor/report.py. Problems that this node alone can tell (a missing
data file, a down NIC) become blockers on the sheet itself.

Test hooks (environment variables that tests set to fake a fact on one node;
not for users):

- ``HETPIPE_DOCTOR_FAKE_TORCH=2.12.0``: this node reports that torch version.
- ``HETPIPE_DOCTOR_FAKE_HOST=NAME``: this node reports host NAME and a network
  stack of its own, as a node on another host would.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import secrets
import socket
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

import hetpipe
from hetpipe.devices.cluster import ClusterConfig
from hetpipe.comm.nics import Nic, list_interfaces, resolve_local_nics, selection_setting
from hetpipe.comm.nics import network_identity as nics_network_identity
from hetpipe.data.indexed import data_file_path, index_file_path
from hetpipe.devices.facts import needs_gpu, no_gpu_line
from hetpipe.doctor.config import DoctorConfig
from hetpipe.errors import ConfigError

# Config keys that may differ between nodes of one job: NICs are per node, and
# data may sit at different paths (its content is compared by checksum).
PER_NODE_KEYS = (("cluster", "transport", "addresses"), ("cluster", "transport", "interfaces"),
                 ("data", "path"), ("data", "tokenizer"), ("doctor",))
# Files up to this size are hashed whole; larger ones by their size and first and last MiB.
WHOLE_FILE_BYTES = 64 << 20
_MIB = 1 << 20
# ibv_port_state values, as pyverbs reports a port's state.
_PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}


def config_hash(raw: DictConfig) -> str:
    """Digest of the composed config without :data:`PER_NODE_KEYS`."""
    tree = OmegaConf.to_container(raw, resolve=True)
    for path in PER_NODE_KEYS:
        node = tree
        for key in path[:-1]:
            node = node.get(key) or {}
        node.pop(path[-1], None)
    return hashlib.sha256(json.dumps(tree, sort_keys=True, default=str).encode()).hexdigest()[:12]


def file_digest(path: Path) -> dict[str, Any]:
    """sha256 of ``path``: whole when small, else of its size and first and last MiB
    (enough to tell two corpora apart without reading terabytes)."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as f:
        if size <= WHOLE_FILE_BYTES:
            method = "whole file"
            while chunk := f.read(_MIB):
                digest.update(chunk)
        else:
            method = "size + first and last MiB"
            digest.update(str(size).encode())
            digest.update(f.read(_MIB))
            f.seek(size - _MIB)
            digest.update(f.read(_MIB))
    return {"sha256": digest.hexdigest(), "method": method, "bytes": size}


def data_facts(path: str) -> dict[str, Any]:
    """What the job's data is on this node: the built-in corpus, or checksums of the .bin/.idx pair."""
    if path == "demo":
        # The demo corpus is built from this Python's standard library, so
        # the Python version is what decides its content.
        return {"summary": f"built-in demo corpus (Python {platform.python_version()} standard library)",
                "files": {}, "missing": []}
    files, missing = {}, []
    for name in (index_file_path(path), data_file_path(path)):
        if Path(name).is_file():
            files[name] = file_digest(Path(name))
        else:
            missing.append(name)
    return {"summary": path, "files": files, "missing": missing}


def tokenizer_facts(spec: str) -> dict[str, Any]:
    """The built-in byte tokenizer, or one digest over a tokenizer directory's files."""
    if spec == "byte":
        return {"summary": "byte (built-in)", "digest": "byte", "missing": []}
    root = Path(spec).expanduser()
    if not root.is_dir():
        return {"summary": spec, "digest": None, "missing": [spec]}
    digest = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f"{f.relative_to(root)}\0{file_digest(f)['sha256']}\0".encode())
    return {"summary": spec, "digest": digest.hexdigest(), "missing": []}


def torch_facts() -> dict[str, Any]:
    """torch version and build, and the visible GPUs."""
    if torch.version.hip:
        build = "ROCm " + ".".join(torch.version.hip.split(".")[:2])
    elif torch.version.cuda:
        build = f"CUDA {torch.version.cuda}"
    else:
        build = "CPU"
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)})
    return {"torch": os.environ.get("HETPIPE_DOCTOR_FAKE_TORCH") or torch.__version__, "build": build,
            "gpus": gpus}


def rdma_facts() -> list[str]:
    """RDMA devices and port states: through pyverbs where installed, else from sysfs."""
    try:
        from pyverbs.device import Context, get_device_list
    except ImportError:
        lines = ["pyverbs not installed"]
    else:
        try:
            lines = []
            for dev in get_device_list():
                name = dev.name.decode()
                with Context(name=name) as ctx:
                    ports = range(1, ctx.query_device().phys_port_cnt + 1)
                    states = [_PORT_STATES.get(ctx.query_port(p).state, "?") for p in ports]
                lines.append(f"{name}: " + ", ".join(f"port {p} {s}" for p, s in zip(ports, states)))
            return lines or ["pyverbs: no RDMA devices"]
        except Exception as exc:  # pyverbs raises its own error types (PyverbsRDMAError, ...)
            lines = [f"pyverbs failed: {exc}"]
    ports = sorted(Path("/sys/class/infiniband").glob("*/ports/*"))
    for port in ports:
        dev = port.parent.parent
        state = _read(port / "state").split(":")[-1].strip() or "?"
        nets = ",".join(sorted(p.name for p in (dev / "device" / "net").glob("*"))) or "no netdev"
        lines.append(f"{dev.name} port {port.name}: {state}, {_read(port / 'link_layer') or '?'}, "
                     f"{_read(port / 'rate') or '?'} (net {nets})")
    if not ports:
        lines.append("no devices in /sys/class/infiniband")
    return lines


def gpu_rdma_facts(build: str, gpus: list) -> str:
    """Whether a NIC can register this node's GPU memory (GPUDirect RDMA), as far as sysfs tells."""
    if not gpus:
        return "n/a (no GPU visible)"
    kernel = platform.release()
    try:
        dmabuf_kernel = tuple(int(x) for x in kernel.split("-")[0].split(".")[:2]) >= (5, 12)
    except ValueError:
        dmabuf_kernel = False
    peers = sorted(p.name for p in Path("/sys/kernel/mm/memory_peers").glob("*"))
    if build.startswith("CUDA"):
        if Path("/sys/module/nvidia_peermem").exists():
            return "yes: nvidia_peermem is loaded"
        if "nv_mem" in peers:
            return "yes: nv_peer_mem is registered (/sys/kernel/mm/memory_peers/nv_mem)"
        if "Open Kernel Module" in _read(Path("/proc/driver/nvidia/version")) and dmabuf_kernel:
            return f"possible: dma-buf (NVIDIA open kernel module, Linux {kernel}); unknown whether the NIC takes it"
        return (f"unknown: no nvidia_peermem; dma-buf needs NVIDIA's open kernel module and Linux >= 5.12 "
                f"(this is {kernel})")
    amd = [p for p in peers if "amd" in p]
    if amd:
        return f"yes: AMD peer-memory client registered (/sys/kernel/mm/memory_peers/{amd[0]})"
    if Path("/sys/module/amdgpu").exists() and dmabuf_kernel:
        return f"possible: dma-buf (amdgpu loaded, Linux {kernel}); unknown whether the NIC takes it"
    return f"unknown: no AMD peer-memory client; dma-buf needs amdgpu and Linux >= 5.12 (this is {kernel})"


def network_identity() -> str:
    """:func:`hetpipe.comm.nics.network_identity` (the report's column shows 8 characters), or
    the fake host's under HETPIPE_DOCTOR_FAKE_HOST."""
    fake = os.environ.get("HETPIPE_DOCTOR_FAKE_HOST")
    if fake:
        return f"fake-{fake}"
    return nics_network_identity()[:8]


def node_labels(cluster: ClusterConfig, nodes: int) -> dict[int, str]:
    """Group name of each node, where the config's node counts match the job's
    (nodes follow the group order, as scripts/launch_cluster.sh numbers them)."""
    names = [g.name for g in cluster.groups for _ in range(g.nodes)]
    return dict(enumerate(names)) if len(names) == nodes else {}


def gpu_blockers(cluster: ClusterConfig, label: str | None) -> list[str]:
    """On a node without a GPU, each group it may run that needs GPUs: the job would stop at
    start-up (hetpipe/devices/facts.py:check_devices). ``label`` is the node's group where
    the job's layout tells it; without one (a node checked alone) every group counts."""
    return [no_gpu_line(cluster, i, "this node has none") for i, g in enumerate(cluster.groups)
            if label in (None, g.name) and (needs_gpu(cluster, g) or g.device_type.upper() not in ("AUTO", "CPU"))]


def fact_sheet(cfg: DoctorConfig, raw: DictConfig, node: int, nodes: int) -> tuple[dict[str, Any], list[Nic]]:
    """This node's facts as JSON-ready data, and the NICs the config selects here
    (none when that failed: the reason is among the sheet's blockers)."""
    transport = cfg.cluster.transport
    interfaces = list_interfaces()
    blockers: list[str] = []
    nics: list[Nic] = []
    try:
        nics = resolve_local_nics(transport, interfaces)
    except ConfigError as exc:
        blockers.append(str(exc))
    states = {i.name: i.state for i in interfaces}
    blockers += [f"{n.name} (stripe {j}) is {states[n.name]}: bring it up or select another NIC"
                 for j, n in enumerate(nics) if n.name is not None and states[n.name] != "up"]
    data = data_facts(cfg.data.path)
    tokenizer = tokenizer_facts(cfg.data.tokenizer)
    blockers += [f"data file {m} is missing: put the same corpus on every node (data.path)"
                 for m in data["missing"]]
    blockers += [f"tokenizer directory {m} is missing: put the same tokenizer on every node (data.tokenizer)"
                 for m in tokenizer["missing"]]
    facts = torch_facts()
    label = node_labels(cfg.cluster, nodes).get(node)
    if not facts["gpus"]:
        blockers += gpu_blockers(cfg.cluster, label)
    sheet = {
        "node": node, "nodes": nodes, "label": label,
        "host": os.environ.get("HETPIPE_DOCTOR_FAKE_HOST") or socket.gethostname(),
        "network": network_identity(), "hetpipe": hetpipe.__version__, "python": platform.python_version(),
        **facts, "interfaces": [asdict(i) for i in interfaces], "selection": selection_setting(transport),
        "nics": [asdict(n) for n in nics], "rdma": rdma_facts(), "gpu_rdma": gpu_rdma_facts(facts["build"],
                                                                                              facts["gpus"]),
        "config": config_hash(raw), "cluster": cfg.cluster.name, "model": cfg.model.name if cfg.model else None,
        "data": data, "tokenizer": tokenizer, "endpoints": [], "nonce": secrets.token_hex(8),
        "blockers": blockers,
    }
    return sheet, nics


def _read(path: Path) -> str:
    """The file's text, '' where there is none: sysfs and procfs entries vary by kernel and driver."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""

