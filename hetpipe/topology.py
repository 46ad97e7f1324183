"""Ranks, vendor groups, pipeline stages and every process group, in one place.

Like torchtitan's ``ParallelDims``, one object owns all process-group creation
so that every rank creates the same groups in the same order. The world group
is gloo on the CPU (it works between a CUDA and a ROCm build); each vendor
group gets its own communicator - ``nccl`` on GPUs, which is RCCL on a ROCm
build - or gloo on CPU ranks. Neighbouring stages in the same vendor group talk
through that group; stages on either side of a vendor line talk through the
configured cross-vendor channel.
"""
from __future__ import annotations

import dataclasses
import os
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from hetpipe.cluster import ClusterConfig, GroupConfig
from hetpipe.comm.vendor import detect_vendor
from hetpipe.errors import ConfigError
from hetpipe.models.config import ModelConfig
from hetpipe.partitioner.plan import Plan, StagePlan, even_split

if TYPE_CHECKING:
    from hetpipe.comm.channel import Channel


def build_plan(partition, cluster: ClusterConfig, model: ModelConfig) -> Plan:
    """The plan from explicit overrides: one pipeline rank per cluster rank, in
    group order; ``partition.layers`` or an even split of the decoder layers."""
    p = cluster.world_size
    if partition.num_chunks > 1 and p == 1:
        raise ConfigError("partition.num_chunks > 1 (interleaving) needs at least two pipeline ranks")
    virtual = p * partition.num_chunks
    layers = list(partition.layers) if partition.layers is not None else even_split(model.num_layers, virtual)
    if len(layers) != virtual:
        raise ConfigError(f"partition.layers={layers} has {len(layers)} entries but cluster {cluster.name!r} "
                          f"x num_chunks={partition.num_chunks} gives {virtual} (virtual) stages")
    stages = []
    for v, n in enumerate(layers):
        rank = v % p
        stages.append(StagePlan(group=cluster.group_of(rank)[1].name, ranks=[rank], layers=n))
    plan = Plan(stages=stages, schedule=partition.schedule, num_chunks=partition.num_chunks)
    plan.check_model(model.num_layers)
    return plan


def resolve_plan(cfg) -> Plan:
    """The plan a pretrain config asks for: ``plan=auto`` (the cost-model
    planner, restricted to what this release runs: one stage per rank, in the
    cluster's group order, no TP/DP/recompute), ``plan=PATH`` (a plan.yaml), or
    the explicit ``partition`` settings."""
    from hetpipe.partitioner.solver import plan_for

    if cfg.plan is None:
        return build_plan(cfg.partition, cfg.cluster, cfg.model)
    if cfg.plan == "auto":
        planner = dataclasses.replace(
            cfg.planner, tp=cfg.planner.tp or 1, dp=cfg.planner.dp or 1,
            recompute=bool(cfg.planner.recompute),
            stages=cfg.planner.stages or [g.size for g in cfg.cluster.groups],
            group_order=cfg.planner.group_order or [g.name for g in cfg.cluster.groups])
        plan = plan_for(cfg.model, cfg.cluster, cfg.train, planner)
    else:
        plan = Plan.load(cfg.plan)
    plan.check_model(cfg.model.num_layers)
    check_runnable(plan, cfg.cluster, cfg.train)
    return plan


def check_runnable(plan: Plan, cluster: ClusterConfig, train) -> None:
    """Refuse plans that need features this release does not run yet."""
    p = cluster.world_size
    if plan.pipeline_size != p:
        raise ConfigError(f"the plan has {plan.pipeline_size} pipeline ranks but cluster {cluster.name!r} has {p}")
    for v, stage in enumerate(plan.stages):
        if stage.tp != 1 or stage.dp != 1 or stage.ranks != [v % p]:
            raise ConfigError(
                f"plan stage {v} uses TP{stage.tp} x DP{stage.dp} on ranks {stage.ranks}; this release runs "
                "one pipeline stage per rank in the cluster's rank order (TP/DP inside groups come later)")
        if stage.group != cluster.group_of(v % p)[1].name:
            raise ConfigError(f"plan stage {v} is on group {stage.group!r} but rank {v % p} belongs to "
                              f"{cluster.group_of(v % p)[1].name!r}")
    if plan.recompute:
        raise ConfigError("the plan turns on activation recomputation, which this release does not run yet")
    mbs = plan.notes.get("micro_batch_size") if plan.notes else None
    if mbs is not None and mbs != train.micro_batch_size:
        raise ConfigError(f"the plan was made for micro_batch_size={mbs} but train.micro_batch_size="
                          f"{train.micro_batch_size}; set train.micro_batch_size={mbs}")


def check_group_vendor(cluster: ClusterConfig, group: GroupConfig) -> None:
    """A group's declared vendor must be the hardware's, unless the cluster emulates."""
    detected = "cpu" if group.on_cpu else detect_vendor()
    if group.vendor not in ("auto", detected) and not cluster.emulate:
        raise ConfigError(
            f"group {group.name!r} is declared {group.vendor} but its ranks run on {detected} "
            "hardware; set cluster.emulate=true to emulate a mixed cluster")


def check_transport_available(cluster: ClusterConfig) -> str:
    """The cross-vendor channel kind this release runs for ``transport.kind``."""
    kind = cluster.transport.kind
    if kind == "direct" and not cluster.single_node:
        raise ConfigError("cluster.transport.kind=direct moves data through shared memory or CUDA/HIP IPC, "
                          "so both sides of a boundary must be on one host; the RDMA (verbs) mover is not "
                          "implemented yet: use tcp across nodes")
    # auto stays on the CPU-forwarding channel until device-direct is verified on GPUs.
    return "tcp" if kind == "auto" else kind


@dataclass
class Topology:
    cluster: ClusterConfig
    plan: Plan
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    def __post_init__(self) -> None:
        if self.cluster.world_size != self.world_size:
            raise ConfigError(f"cluster {self.cluster.name!r} has {self.cluster.world_size} ranks but "
                              f"{self.world_size} processes were started")
        if self.plan.pipeline_size != self.world_size:
            raise ConfigError(f"the plan has {self.plan.pipeline_size} pipeline ranks but the cluster has "
                              f"{self.world_size} (one stage per rank until TP/DP land)")
        self.group_index, self.group = self.cluster.group_of(self.rank)
        self.device = self._device(self.group)
        self._check_vendor()
        self.vendor_groups: list[Optional[dist.ProcessGroup]] = []
        self.p2p_groups: dict[tuple[int, int], dist.ProcessGroup] = {}
        self.embedding_group: Optional[dist.ProcessGroup] = None
        self.channels: dict[int, Channel] = {}

    def _device(self, group: GroupConfig) -> torch.device:
        if group.on_cpu:
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise ConfigError(f"cluster group {group.name!r} runs on {group.device_type} GPUs "
                              "but this process sees no GPU")
        if self.local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {self.local_rank} has no GPU: only "
                              f"{torch.cuda.device_count()} visible")
        torch.cuda.set_device(self.local_rank)
        return torch.device("cuda", self.local_rank)

    def _check_vendor(self) -> None:
        check_group_vendor(self.cluster, self.group)

    # -- naming -----------------------------------------------------------------
    def group_name_of(self, rank: int) -> str:
        return self.cluster.group_of(rank)[1].name

    def stage_name(self, rank: int) -> str:
        g = self.cluster.group_of(rank)[1]
        return f"stage {rank} (group {g.name}, {g.vendor}, rank {rank})"

    def is_cross_vendor(self, a: int, b: int) -> bool:
        return self.cluster.group_of(a)[0] != self.cluster.group_of(b)[0]

    @property
    def neighbours(self) -> list[int]:
        """Ranks this rank exchanges activations with (wrapping when interleaved)."""
        p = self.world_size
        if p == 1:
            return []
        if self.plan.num_chunks > 1:
            return sorted({(self.rank - 1) % p, (self.rank + 1) % p})
        return [r for r in (self.rank - 1, self.rank + 1) if 0 <= r < p]

    # -- process groups and channels ---------------------------------------------
    def init_process_groups(self, tied_embeddings: bool) -> None:
        """Create the world, vendor, boundary and embedding groups (same order on every rank)."""
        if self.world_size == 1:
            return
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size)
        for i, g in enumerate(self.cluster.groups):
            self.vendor_groups.append(self._new_group(self.cluster.group_ranks(i), g))
        # One communicator per direction of every same-vendor boundary (see
        # comm/p2p.py for why NCCL needs this).
        for src, dst in self._same_vendor_directions():
            group = self._new_group([src, dst], self.cluster.group_of(src)[1])
            if self.rank in (src, dst):
                self.p2p_groups[(src, dst)] = group
        first, last = 0, self.world_size - 1
        if self.plan.num_chunks > 1:
            last = (len(self.plan.stages) - 1) % self.world_size
        if tied_embeddings and first != last:
            group = dist.new_group([first, last], backend="gloo")
            if self.rank in (first, last):
                self.embedding_group = group

    def _new_group(self, ranks: list[int], group: GroupConfig) -> dist.ProcessGroup:
        """A gloo group for CPU ranks; an NCCL (RCCL on ROCm) group for GPU ranks,
        initialised eagerly so that communicator set-up happens here, with every
        member present, rather than inside the first training step."""
        if group.on_cpu:
            return dist.new_group(ranks, backend="gloo")
        eager = {"device_id": self.device} if self.rank in ranks else {}
        return dist.new_group(ranks, backend="nccl", **eager)

    def _same_vendor_directions(self) -> list[tuple[int, int]]:
        """Ordered (sender, receiver) rank pairs of all same-vendor boundaries."""
        p = self.world_size
        pairs = {(r, (r + 1) % p) for r in range(p)} if self.plan.num_chunks > 1 else \
            {(r, r + 1) for r in range(p - 1)}
        both = {d for a, b in pairs for d in ((a, b), (b, a)) if a != b}
        return sorted(d for d in both if not self.is_cross_vendor(*d))

    def job_token(self) -> str:
        """The job's shared secret for channel handshakes: $HETPIPE_JOB_TOKEN (set by
        the launcher), else one rank 0 draws and shares through the rendezvous store."""
        token = os.environ.get("HETPIPE_JOB_TOKEN")
        if token:
            return token
        store = dist.distributed_c10d._get_default_store()
        if self.rank == 0:
            store.set("hetpipe/job_token", secrets.token_hex(16))
        return store.get("hetpipe/job_token").decode()

    def build_channels(self) -> dict[int, Channel]:
        """One channel per neighbour: the vendor group's own P2P inside a group,
        the configured cross-vendor channel across a vendor line."""
        from hetpipe.comm.direct import DirectChannel
        from hetpipe.comm.gloo import GlooChannel
        from hetpipe.comm.p2p import TorchP2PChannel
        from hetpipe.comm.tcp import TcpChannel

        t = self.cluster.transport
        token = self.job_token()  # on every rank: rank 0 may have no cross-vendor peer
        names = {r: self.stage_name(r) for r in range(self.world_size)}
        same = [r for r in self.neighbours if not self.is_cross_vendor(self.rank, r)]
        cross = [r for r in self.neighbours if self.is_cross_vendor(self.rank, r)]
        if same:
            channel = TorchP2PChannel(self.rank, same, names, self.p2p_groups, deadline=t.deadline_s)
            self.channels.update({r: channel for r in same})
        kind = check_transport_available(self.cluster)
        if cross:
            if kind == "direct":
                channel = DirectChannel(self.rank, cross, names, dist.distributed_c10d._get_default_store(),
                                        token=token, deadline=t.deadline_s, device=self.device,
                                        address=t.addresses[0])
            elif kind == "tcp":
                channel = TcpChannel(self.rank, cross, names, dist.distributed_c10d._get_default_store(),
                                     token=token, addresses=list(t.addresses),
                                     streams_per_address=t.streams_per_address,
                                     deadline=t.deadline_s, device=self.device)
            else:
                channel = GlooChannel(self.rank, cross, names, None, deadline=t.deadline_s)
            self.channels.update({r: channel for r in cross})
        return self.channels

    def close(self) -> None:
        for channel in set(self.channels.values()):
            channel.close()
        self.channels.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
