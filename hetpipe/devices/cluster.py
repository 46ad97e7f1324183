"""Cluster description: vendor groups and the cross-vendor transport.

A cluster is an ordered list of vendor groups (all NVIDIA ranks, all AMD
ranks, ...). Pipeline stages are laid out over the groups in this order, so
the group order is the pipeline order. Ranks are numbered group by group.
On real hardware a rank's vendor comes from its torch build; a config may
*declare* vendors that differ from what the hardware is (CPU ranks standing
in for GPUs, NVIDIA GPUs standing in for AMD) only with ``emulate: true``,
and the emulated cluster still runs the cross-vendor code path.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import List, Optional

import hetpipe.errors.value_checks as value_checks
from hetpipe.errors import ConfigError
from hetpipe.pipeline.transports import MOVERS, TRANSPORTS, transport

VENDORS = ("nvidia", "amd", "cpu", "auto")


@dataclass
class GroupConfig:
    # The group's name, as plans, logs and planner.group_order give it.
    name: str = "local"
    # nvidia | amd | cpu: the collective library inside the group follows it;
    # auto takes whatever this process runs on.
    vendor: str = "auto"
    # A key of the partitioner's device catalog (H200, MI325X, CPU, ...);
    # "CPU" ranks run on the CPU, anything else on the rank's local GPU;
    # auto is the GPU when one is visible, else the CPU, and its catalog key
    # comes from the device itself (name, architecture and memory,
    # hetpipe/devices/facts.py). A declared type is checked against every
    # rank's real device at start-up (see ClusterConfig.allow_device_mismatch).
    device_type: str = "auto"
    # Nodes the group spans.
    nodes: int = 1
    # Ranks (one device each) on every one of those nodes.
    ranks_per_node: int = 1
    # This group's train.precision (models/precision.py); None takes
    # train.precision. E.g. bf16 for an A100 group of a job that trains fp8.
    precision: Optional[str] = None

    @property
    def size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def on_cpu(self) -> bool:
        if self.device_type == "auto":
            import torch

            return not torch.cuda.is_available()
        return self.device_type.upper() == "CPU"


@dataclass
class TransportConfig:
    # Channel for boundaries that cross vendors: tcp (CPU-forwarding), direct
    # (device-direct: CPU control plane, data through a mover), gloo
    # (torch.distributed over gloo), auto (the registry's fallback, tcp:
    # hetpipe/pipeline/transports.py says why). One entry per kind there.
    kind: str = "auto"
    # What moves a kind=direct boundary's bytes. auto chooses per boundary:
    # one host -> CUDA/HIP IPC between GPUs of one runtime, shared memory
    # between CPU ranks; two hosts -> Mooncake's transfer engine over RDMA
    # where both ends have it (an RDMA device, the [mooncake] extra, a wheel
    # built for the GPU's runtime); anything else -> the tcp channel. Every
    # rank prints its choice and why at start-up. shm and ipc: one host only.
    # mooncake-tcp: Mooncake over its TCP transport on every boundary, what CI
    # runs. mooncake-rdma: RDMA on every boundary (not verified by hetpipe's
    # tests; docs/architecture.md lists what a cluster needs). See
    # hetpipe/comm/factory.py:choose_mover.
    mover: str = "auto"
    # Local addresses to stripe each message over (one per NIC).
    addresses: List[str] = field(default_factory=lambda: ["127.0.0.1"])
    # The same NICs by interface name, e.g. [eth1, eth2]: each node resolves its
    # own address on each, so one command line fits every node of a
    # multi-node job (give per-node names on a node's command line where
    # images name NICs differently). Takes precedence over `addresses`.
    # Resolved per node by hetpipe/comm/nics.py:resolve_local_nics.
    interfaces: Optional[List[str]] = None
    # The same NICs by network, one CIDR per stripe, e.g. [10.201.0.0/24,
    # 10.202.0.0/24]: each node picks its interface with an address in each,
    # so one command line fits every node even where interface names differ.
    # Takes precedence over `addresses`; exclusive with `interfaces`.
    subnets: Optional[List[str]] = None
    # Connections per address (more streams help a single fast NIC too).
    streams_per_address: int = 1
    # Seconds any boundary wait may take before the rank gives up.
    deadline_s: float = 300.0
    # A MAC (HMAC-SHA256, per-connection keys from the handshake) over every
    # tcp frame's header and payload, numbered so frames cannot be altered,
    # replayed or reordered by an attacker on the network path (the handshake
    # alone already refuses peers without the job secret). Off by default:
    # it hashes every byte once more on each side, which cuts the channel's
    # bandwidth several-fold (docs/benchmarks.md, "Boundary security: the
    # per-frame MAC's cost", with its command). Transports whose entry allows
    # it only (hetpipe/pipeline/transports.py; comm/message_mac.py).
    message_mac: bool = False
    # Same-vendor (NCCL/RCCL) stage boundaries: at most this many CTAs, hence
    # SMs, per transfer (ncclConfig_t.maxCTAs of the boundary communicators
    # only; Megatron-LM sets the same per communicator). A posted send or
    # receive is a kernel that holds its SMs until the peer arrives. null:
    # NCCL's own choice.
    nccl_max_ctas: Optional[int] = 2
    # SMs that the GEMMs of a CUDA rank leave free for those NCCL kernels
    # (torch's SM carveout for cuBLASLt). Hopper's GEMMs are persistent, one
    # CTA per SM: a few SMs held by a waiting NCCL kernel push part of every
    # GEMM into a second wave. null (auto): nccl_max_ctas times the rank's
    # boundary communicators on NVIDIA ranks that have any; 0: off. Measured
    # with nccl_max_ctas in docs/benchmarks.md, "NCCL boundaries that leave
    # SMs to the GEMMs" (2026-11-22). See
    # hetpipe/training/topology.py:apply_gemm_sm_carveout.
    gemm_sm_carveout: Optional[int] = None


@dataclass
class ClusterConfig:
    # The cluster's name (the preset's; plan run directories carry it).
    name: str = "single"
    # Allow declared vendors that differ from the detected hardware.
    emulate: bool = False
    # Run although a group's device_type (or the type an auto group's plan was
    # made for) is not the device its ranks detect at start-up: a what-if plan
    # for hardware you do not have, on purpose, with a warning. Off, the job
    # stops with one line naming both, exit 2: a plan=auto run declared H200 on
    # two H100s planned 126.9 GiB per device and died of OOM at step 2. A GPU
    # type on a CPU is refused either way (it cannot run). hetpipe/devices/facts.py.
    allow_device_mismatch: bool = False
    # Run the ranks of GPU groups (vendor nvidia or amd, device_type auto) on the
    # CPU when no GPU is visible: a deliberate CPU run of a GPU config. Off, such
    # a cluster stops at start-up with one line instead of falling back to the
    # CPU unnoticed (hetpipe/devices/facts.py:check_devices; the doctor says it
    # as a blocker). cpu_* clusters need no flag: their groups declare CPU.
    allow_cpu: bool = False
    groups: List[GroupConfig] = field(default_factory=lambda: [GroupConfig()])
    transport: TransportConfig = field(default_factory=TransportConfig)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError(f"cluster {self.name!r} has no groups")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ConfigError(f"cluster {self.name!r} repeats a group name: {names}")
        for g in self.groups:
            if g.vendor not in VENDORS:
                raise ConfigError(f"cluster group {g.name!r}: vendor {g.vendor!r} is not one of {VENDORS}")
            if g.nodes <= 0 or g.ranks_per_node <= 0:
                raise ConfigError(f"cluster group {g.name!r}: nodes and ranks_per_node must be positive")
        entry = transport(self.transport.kind)
        if self.transport.mover not in MOVERS:
            raise ConfigError(f"cluster.transport.mover={self.transport.mover!r} is not one of {MOVERS}")
        if not self.transport.addresses or self.transport.streams_per_address <= 0:
            raise ConfigError("cluster.transport needs at least one address and one stream per address")
        if self.transport.interfaces is not None and self.transport.subnets is not None:
            raise ConfigError("cluster.transport: set interfaces or subnets, not both")
        if self.transport.interfaces == [] or self.transport.subnets == []:
            raise ConfigError("cluster.transport.interfaces and subnets need at least one entry (or null)")
        for cidr in self.transport.subnets or []:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ConfigError(f"cluster.transport.subnets has {cidr!r}, which is not a CIDR such as "
                                  "10.201.0.0/24") from None
        value_checks.positive("cluster.transport.deadline_s", self.transport.deadline_s,
                              why=": a number of seconds every boundary wait may take")
        if self.transport.message_mac and not entry.message_mac:
            macs = [k for k, t in TRANSPORTS.items() if t.message_mac]
            raise ConfigError(f"cluster.transport.message_mac covers the {'/'.join(macs)} channel's frames only, "
                              f"not kind={self.transport.kind}: use kind={macs[0]}, or message_mac=false")
        if self.transport.nccl_max_ctas is not None and self.transport.nccl_max_ctas <= 0:
            raise ConfigError(f"cluster.transport.nccl_max_ctas={self.transport.nccl_max_ctas} must be a "
                              "positive number of CTAs (or null for NCCL's choice)")
        if self.transport.gemm_sm_carveout is not None and self.transport.gemm_sm_carveout < 0:
            raise ConfigError(f"cluster.transport.gemm_sm_carveout={self.transport.gemm_sm_carveout} must be "
                              "a number of SMs, 0 or more (or null for automatic)")

    @property
    def world_size(self) -> int:
        return sum(g.size for g in self.groups)

    @property
    def single_node(self) -> bool:
        return all(g.nodes == 1 for g in self.groups)

    def group_of(self, rank: int) -> tuple[int, GroupConfig]:
        """(group index, group) that global ``rank`` belongs to."""
        start = 0
        for i, g in enumerate(self.groups):
            if rank < start + g.size:
                return i, g
            start += g.size
        raise ConfigError(f"rank {rank} is outside cluster {self.name!r} of {self.world_size} ranks")

    def group_ranks(self, index: int) -> list[int]:
        start = sum(g.size for g in self.groups[:index])
        return list(range(start, start + self.groups[index].size))
