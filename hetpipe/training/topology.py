"""Ranks, vendor groups, pipeline stages and every process group, in one place.

Like torchtitan's ``ParallelDims``, one object owns all process-group creation
so that every rank creates the same groups in the same order. The world group
is gloo on the CPU (it works between a CUDA and a ROCm build); each vendor
group gets its own communicator - ``nccl`` on GPUs, which is RCCL on a ROCm
build - or gloo on CPU ranks. Neighbouring stages in the same vendor group talk
through that group; stages on either side of a vendor line talk through the
configured cross-vendor channel.

Before any group exists, each rank resolves its node's NICs from
``cluster.transport`` (:mod:`hetpipe.comm.nics`), answers the roll call
(:mod:`hetpipe.launch.nodes`) with them and its device, checks every rank's device
against the plan (:mod:`hetpipe.devices.facts`) and arms the job's watch
(:mod:`hetpipe.launch.job_watch`);
on a multi-node job gloo and NCCL are pointed at the same NICs, so the world
group never falls back to the address the host name resolves to (often
loopback). Every group waits at most the transport deadline, so a node that
is missing or gone stops the job within it instead of after gloo's 30 minutes.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from hetpipe.devices.cluster import ClusterConfig, GroupConfig
from hetpipe.comm.factory import build_rank_channels
from hetpipe.comm.nics import Nic, check_dialable, resolve_local_nics, selection_setting, socket_ifname
from hetpipe.comm.stage_link import StageLink
from hetpipe.devices.vendor import detect_vendor
from hetpipe.devices.facts import DeviceFacts, check_devices, device_facts, devices_lines
from hetpipe.errors import ConfigError
from hetpipe.launch.job_secret import require_job_secret
from hetpipe.launch.job_watch import JobWatch, namespace
from hetpipe.launch.nodes import NodeMap, launched_multi_node, roll_call
from hetpipe.devices.catalog import DeviceSpec
from hetpipe.partitioner.plan_data import Plan
from hetpipe.pipeline.transports import transport
from hetpipe.process.known_warnings import SM_CARVEOUT, native_lines_hidden
from hetpipe.process.torch_compat import NCCL_DEFAULT_TIMEOUT, nccl_group_options, set_gemm_sm_carveout


def point_socket_interfaces(nics: list[Nic]) -> str:
    """Point gloo and NCCL/RCCL at ``nics`` unless the user chose interfaces; says what was done.

    NCCL's value starts with ``=``: NCCL matches names as prefixes otherwise
    (eth1 would also take eth10); gloo matches exactly and takes no prefix.
    """
    names = socket_ifname(nics)
    said = []
    for variable, value in (("GLOO_SOCKET_IFNAME", names), ("NCCL_SOCKET_IFNAME", f"={names}")):
        if os.environ.get(variable):
            said.append(f"{variable}={os.environ[variable]} (yours, kept)")
        else:
            os.environ[variable] = value
            said.append(f"{variable}={value}")
    return ", ".join(said)


def check_group_vendor(cluster: ClusterConfig, group: GroupConfig) -> None:
    """A group's declared vendor must be the hardware's, unless the cluster emulates."""
    detected = "cpu" if group.on_cpu else detect_vendor()
    if group.vendor not in ("auto", detected) and not cluster.emulate:
        raise ConfigError(
            f"group {group.name!r} is declared {group.vendor} but its ranks run on {detected} "
            "hardware; set cluster.emulate=true to emulate a mixed cluster")


@dataclass
class Topology:
    """This rank's place in the job: pipeline stage, TP and DP coordinates,
    its device, every process group, and its boundary channels.

    A physical pipeline stage ``s`` (plan stages 0..P-1) runs on ``TP x DP``
    consecutive ranks of one vendor group; ``stage.ranks[d * tp + t]`` is the
    rank with DP index ``d`` and TP index ``t``. Every DP replica runs the
    whole pipeline: replica ``d`` of stage ``s`` talks only to replica ``d``
    of its neighbours. Activations are replicated over a stage's TP ranks, so
    when the two sides of a boundary have different TP degrees, TP rank ``t``
    of the receiving stage takes the tensor from TP rank ``t % tp_sender`` of
    the sending stage (a sender with ``t >= tp_receiver`` sends nothing).
    """

    cluster: ClusterConfig
    plan: Plan
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    # The device catalog ranks detect their devices' types in (planner.catalog applied); None: built-in.
    catalog: Optional[Mapping[str, DeviceSpec]] = None

    def __post_init__(self) -> None:
        if self.cluster.world_size != self.world_size:
            raise ConfigError(f"cluster {self.cluster.name!r} has {self.cluster.world_size} ranks but "
                              f"{self.world_size} processes were started")
        self.stages = self.plan.stages[: self.plan.pipeline_size]
        where = {r: (s, i) for s, st in enumerate(self.stages) for i, r in enumerate(st.ranks)}
        if sorted(where) != list(range(self.world_size)):
            raise ConfigError(f"the plan's stages use ranks {sorted(where)} but the cluster has "
                              f"{self.world_size}; every rank must be in exactly one stage")
        self.pp_rank, index = where[self.rank]
        self.stage = self.stages[self.pp_rank]
        self.tp_size, self.dp_size, self.cp_size = self.stage.tp, self.stage.dp, self.stage.cp
        # Index (d * cp + c) * tp + t: TP fastest, then CP, then DP (Megatron's order).
        replica, self.tp_rank = divmod(index, self.tp_size)
        self.dp_rank, self.cp_rank = divmod(replica, self.cp_size)
        self.group_index, self.group = self.cluster.group_of(self.rank)
        self.device = self._device(self.group)
        self._check_vendor()
        self.vendor_groups: list[Optional[dist.ProcessGroup]] = []
        self.tp_group: Optional[dist.ProcessGroup] = None
        # The ranks holding the same parameters (DP x CP): gradients are averaged over it.
        self.dp_group: Optional[dist.ProcessGroup] = None
        # The ranks sharing each sequence (hetpipe.parallel.context).
        self.cp_group: Optional[dist.ProcessGroup] = None
        self.p2p_groups: dict[tuple[int, int], dist.ProcessGroup] = {}
        self.embedding_group: Optional[dist.ProcessGroup] = None
        self.channels: dict[int, StageLink] = {}
        self.store: Optional[dist.Store] = None  # the rendezvous store, from init_process_groups
        # From init_process_groups: this node's channel NICs, every rank's node, the job's watch.
        self.nics: list[Nic] = []
        self.nodes: Optional[NodeMap] = None
        self.watch: Optional[JobWatch] = None
        self.devices: dict[int, DeviceFacts] = {}  # rank -> its device, from the roll call

    @property
    def pipeline_size(self) -> int:
        return len(self.stages)

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
    def stage_name(self, rank: int) -> str:
        g = self.cluster.group_of(rank)[1]
        s = next(i for i, st in enumerate(self.stages) if rank in st.ranks)
        st = self.stages[s]
        replica, t = divmod(st.ranks.index(rank), st.tp)
        d, c = divmod(replica, st.cp)
        coords = f", DP {d}, TP {t}" if st.tp * st.dp > 1 else ""
        coords += f", CP {c}" if st.cp > 1 else ""
        return f"stage {s} (group {g.name}, {g.vendor}, rank {rank}{coords})"

    def is_cross_vendor(self, a: int, b: int) -> bool:
        return self.cluster.group_of(a)[0] != self.cluster.group_of(b)[0]

    @property
    def neighbours(self) -> list[int]:
        """Pipeline stages this rank exchanges activations with: the ranks of the
        virtual stages next to its own (hetpipe.pipeline.placement; wrapping when interleaved)."""
        return self.plan.placement.neighbours(self.pp_rank)

    def _stage_pairs(self) -> list[tuple[int, int]]:
        """Ordered (stage, stage) pairs that exchange messages, both directions."""
        return self.plan.placement.rank_pairs()

    def routes(self, src_stage: int, dst_stage: int) -> list[tuple[int, int]]:
        """(sender rank, receiver rank) pairs that carry stage ``src_stage``'s
        messages to ``dst_stage``: receiver (d, c, t) takes them from (d, c, t % tp_src),
        so CP rank c's slice of the sequence goes to CP rank c (equal CP degrees: resolve.py)."""
        a, b = self.stages[src_stage], self.stages[dst_stage]
        return [(a.ranks[r * a.tp + t % a.tp], b.ranks[r * b.tp + t]) for r in range(b.dp * b.cp)
                for t in range(b.tp)]

    # -- process groups and channels ---------------------------------------------
    def init_process_groups(self, tied_embeddings: bool) -> None:
        """Create the world, vendor, TP, DP, boundary and embedding groups (same order on every rank)."""
        if self.world_size == 1:
            self._check_devices({0: device_facts(self.device, self.catalog)})
            return
        # The store is kept for the channels' endpoint exchange (never for the
        # job secret: see job_token); torch has no public way to get it back from the default
        # group, so it is made here (torchrun's agent store under a launcher).
        # Every key - the roll call's, the watch's verdict, gloo's, the channels'
        # endpoints - goes under this attempt's namespace: the agent keeps one
        # store for all restarts of the job, and a restarted attempt must not
        # read the last one's (job_watch.namespace).
        deadline = timedelta(seconds=self.cluster.transport.deadline_s)
        rendezvous_store, _, _ = next(dist.rendezvous("env://", self.rank, self.world_size, timeout=deadline))
        self.store = dist.PrefixStore(namespace(), rendezvous_store)
        self._join_nodes(rendezvous_store)
        # PrefixStore("default_pg"): the keys init_process_group would give the group itself.
        dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", self.store), rank=self.rank,
                                world_size=self.world_size, timeout=deadline)
        for i, g in enumerate(self.cluster.groups):
            self.vendor_groups.append(self._new_group(self.cluster.group_ranks(i), g))
        for st in self.stages:
            vendor = self.cluster.group_of(st.ranks[0])[1]
            if st.tp > 1:
                for d in range(st.dp * st.cp):  # one TP group per (DP, CP) replica
                    ranks = st.ranks[d * st.tp:(d + 1) * st.tp]
                    group = self._new_group(ranks, vendor)
                    if self.rank in ranks:
                        self.tp_group = group
            if st.dp * st.cp > 1:
                for t in range(st.tp):
                    ranks = st.ranks[t::st.tp]
                    group = self._new_group(ranks, vendor)
                    if self.rank in ranks:
                        self.dp_group = group
            if st.cp > 1:
                self._new_cp_groups(st, vendor)
        # One communicator per direction of every same-vendor rank pair at a
        # stage boundary (see comm/p2p.py for why NCCL needs this).
        # NCCL boundary waits do not block the host (comm/p2p.py), so the
        # group's own timeout (NCCL's watchdog) is what enforces the deadline.
        for src, dst in self._same_vendor_directions():
            group = self._new_group([src, dst], self.cluster.group_of(src)[1], timeout=deadline,
                                    max_ctas=self.cluster.transport.nccl_max_ctas)
            if self.rank in (src, dst):
                self.p2p_groups[(src, dst)] = group
        last = self.plan.placement.rank_of(len(self.plan.stages) - 1)  # 0 in a V: no group, a local sum
        if tied_embeddings and last != 0:
            first_stage, last_stage = self.stages[0], self.stages[last]
            for i, (a, b) in enumerate(zip(first_stage.ranks, last_stage.ranks)):
                group = dist.new_group([a, b], backend="gloo", timeout=deadline)
                if self.rank in (a, b):
                    self.embedding_group = group

    def _new_cp_groups(self, st, vendor: GroupConfig) -> None:
        """One group per (DP, TP) coordinate of the stage over its CP ranks."""
        for d in range(st.dp):
            for t in range(st.tp):
                ranks = [st.ranks[(d * st.cp + c) * st.tp + t] for c in range(st.cp)]
                group = self._new_group(ranks, vendor)
                if self.rank in ranks:
                    self.cp_group = group

    def _join_nodes(self, rendezvous_store: dist.TCPStore) -> None:
        """This node's NICs, the roll call, the job's watch, and gloo/NCCL pointed at the NICs."""
        transport = self.cluster.transport
        self.watch = JobWatch(rendezvous_store, self.rank, transport.deadline_s, namespace()).install()
        multi_node = launched_multi_node(self.cluster)
        setting = selection_setting(transport)
        nics = resolve_local_nics(transport)
        addresses = [nic.address for nic in nics]
        check_dialable(addresses, False, setting)  # a wildcard is refused on one host too
        self.nodes = roll_call(self.store, self.rank, NodeMap.layout(self.cluster, multi_node), addresses,
                               transport.deadline_s, self.watch.posted, device_facts(self.device, self.catalog),
                               seal=self.watch.seal)
        self._check_devices(self.nodes.devices)
        # Loopback joins ranks that share a network stack, which the roll call has just seen.
        check_dialable(addresses, self.nodes.multi_host, setting)
        self.nics = nics
        if multi_node:
            sockets = point_socket_interfaces(nics)
            if self.local_rank == 0:
                print(f"hetpipe: {self.nodes.label_of(self.rank)}: NICs "
                      f"{', '.join(f'{n.name} {n.address}' for n in nics)} ({setting}); {sockets}",
                      file=sys.stderr, flush=True)
        self.watch.arm(self.nodes, nics, self._cross_node_boundaries())

    def _check_devices(self, devices: Mapping[int, DeviceFacts]) -> None:
        """Every rank's device against the type its group is planned for - on every rank, so a
        mismatch stops each with the same line - then rank 0 says what the ranks run on."""
        self.devices = dict(devices)
        warnings = check_devices(self.cluster, self.devices, self.plan)
        if self.rank != 0:
            return
        for line in devices_lines(self.cluster, self.devices):
            print(line, flush=True)
        for line in warnings:
            print(f"hetpipe: warning: {line}", file=sys.stderr, flush=True)

    def _cross_node_boundaries(self) -> list[tuple[int, int, str]]:
        """(rank on this node, rank on another node, "stage 1 <-> stage 2") for every
        pipeline boundary between this node and another."""
        node_of = self.nodes.node_of
        stage_of = {r: s for s, st in enumerate(self.stages) for r in st.ranks}
        here = node_of[self.rank]
        found = []
        for x, y in sorted({tuple(sorted(p)) for a, b in self._stage_pairs() for p in self.routes(a, b)}):
            if node_of[x] != node_of[y] and here in (node_of[x], node_of[y]):
                mine, peer = (x, y) if node_of[x] == here else (y, x)
                found.append((mine, peer, f"stage {stage_of[mine]} <-> stage {stage_of[peer]}"))
        return found

    def gemm_sm_carveout(self) -> int:
        """SMs this rank's GEMMs leave to its boundary NCCL kernels
        (``cluster.transport.gemm_sm_carveout``; automatic: ``nccl_max_ctas``
        per boundary communicator). 0 on CPU, ROCm and ranks without NCCL
        boundaries."""
        transport = self.cluster.transport
        if self.device.type != "cuda" or not self.p2p_groups or torch.version.hip:
            return 0
        if transport.gemm_sm_carveout is not None:
            return transport.gemm_sm_carveout
        return (transport.nccl_max_ctas or 0) * len(self.p2p_groups)

    def apply_gemm_sm_carveout(self) -> int:
        """Leave :meth:`gemm_sm_carveout` SMs to the boundary's NCCL kernels on
        this rank; returns that number.

        torch's carveout reaches cuBLASLt only (the plain cuBLAS path from
        later torch versions), so GEMMs are routed through cuBLASLt here.
        The idea of TransformerEngine's SM margin for communication overlap.
        """
        carveout = self.gemm_sm_carveout()
        if carveout == 0:
            return 0
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        if carveout >= sms:
            raise ConfigError(f"cluster.transport.gemm_sm_carveout={carveout} leaves no SMs of this GPU's "
                              f"{sms} to the GEMMs")
        with native_lines_hidden(SM_CARVEOUT):  # torch's "experimental" lines: the banner says what is set
            if not set_gemm_sm_carveout(carveout):
                return 0
            torch.backends.cuda.preferred_blas_library("cublaslt")
        return carveout

    def _new_group(self, ranks: list[int], group: GroupConfig, timeout: Optional[timedelta] = None,
                   max_ctas: Optional[int] = None) -> dist.ProcessGroup:
        """A gloo group for CPU ranks; an NCCL (RCCL on ROCm) group for GPU ranks,
        initialised eagerly so that communicator set-up happens here, with every
        member present, rather than inside the first training step. ``max_ctas``
        caps the communicator's CTAs (cluster.transport.nccl_max_ctas)."""
        if group.on_cpu:  # gloo waits block the host and carry the channel's deadline themselves
            return dist.new_group(ranks, backend="gloo",
                                  timeout=timeout or timedelta(seconds=self.cluster.transport.deadline_s))
        extra = {"timeout": timeout} if timeout is not None else {}
        if self.rank in ranks:
            extra["device_id"] = self.device
        if max_ctas is not None:  # the options carry the group's timeout, or torch warns they disagree
            extra["timeout"] = timeout or NCCL_DEFAULT_TIMEOUT
            extra["pg_options"] = nccl_group_options(max_ctas, extra["timeout"])
        return dist.new_group(ranks, backend="nccl", **extra)

    def _same_vendor_directions(self) -> list[tuple[int, int]]:
        """Ordered (sender, receiver) rank pairs of all same-vendor boundaries."""
        pairs = {pair for a, b in self._stage_pairs() for pair in self.routes(a, b)}
        return sorted(d for d in pairs if d[0] != d[1] and not self.is_cross_vendor(*d))

    def job_token(self) -> str:
        """The job's shared secret for the socket channels' handshakes, from the launcher's
        environment or an owner-only file (:mod:`hetpipe.launch.job_secret`), never through the
        store, which anyone who reaches it can read and rewrite. Asked on every rank, so a
        job that needs one and has none stops on every rank with the same line; '' for a
        job whose boundaries need no handshake (all same-vendor, or a transport whose entry
        needs no secret: hetpipe/pipeline/transports.py)."""
        crosses = any(self.is_cross_vendor(*d) for a, b in self._stage_pairs() for d in self.routes(a, b))
        if not crosses or not transport(self.cluster.transport.kind).needs_job_secret:
            return ""
        return require_job_secret(os.environ)

    def build_channels(self) -> dict[int, StageLink]:
        """One link per neighbouring *stage*, keyed by its pipeline index.

        This rank's routes give the ranks it sends to and receives from;
        :func:`~hetpipe.comm.factory.build_rank_channels` gives each of them a
        channel (the vendor group's own P2P, or the configured cross-vendor
        channel), and a :class:`StageLink` maps a stage to those ranks.
        """
        token = self.job_token()  # on every rank: a missing secret stops all of them alike
        targets: dict[int, list[int]] = {}
        sources: dict[int, int] = {}
        for s in self.neighbours:
            targets[s] = [dst for src, dst in self.routes(self.pp_rank, s) if src == self.rank]
            sources[s] = next(src for src, dst in self.routes(s, self.pp_rank) if dst == self.rank)
        peers = sorted({r for rs in targets.values() for r in rs} | set(sources.values()))
        self._rank_channels = build_rank_channels(
            self.rank, same_vendor=[r for r in peers if not self.is_cross_vendor(self.rank, r)],
            cross_vendor=[r for r in peers if self.is_cross_vendor(self.rank, r)],
            names={r: self.stage_name(r) for r in range(self.world_size)}, store=self.store, cluster=self.cluster,
            token=token, device=self.device, p2p_groups=self.p2p_groups, nics=self.nics,
            on_failure=self.watch.report if self.watch is not None else None,
            seal=self.watch.seal if self.watch is not None else None)
        for s in self.neighbours:
            self.channels[s] = StageLink(self.rank, s, f"stage {s}", targets[s], sources[s], self._rank_channels)
        return self.channels

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        for channel in set(getattr(self, "_rank_channels", {}).values()):
            channel.close()
        self.channels.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
