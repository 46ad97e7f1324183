"""The cost context: one planning problem's fixed inputs, and what a candidate costs.

The search (:mod:`hetpipe.partitioner.solver`) visits many candidate layouts
of one cluster; most share per-group unit costs. :class:`CostContext` resolves
each group's device, precision and profile once, caches the per-unit and
per-range costs by (group, TP, DP, microbatch size, recomputation), and turns
a :class:`Candidate` into the matrices the exact split
(:mod:`hetpipe.partitioner.split`) solves: stage time, gradient-sync time and
memory for every contiguous unit range, and the time of each boundary message.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from hetpipe.cluster import ClusterConfig, GroupConfig
from hetpipe.comm.vendor import accelerator_name
from hetpipe.errors import ConfigError
from hetpipe.models.model_config import ModelConfig
from hetpipe.partitioner import cost
from hetpipe.partitioner.catalog import DeviceSpec, catalog_with, detect_device_type, device_spec
from hetpipe.partitioner.inputs import TrainShape
from hetpipe.partitioner.planner_config import PlannerConfig
from hetpipe.partitioner.profile import find_entry, load_profile, profile_shape
from hetpipe.partitioner.split import INF


@dataclass(frozen=True)
class Candidate:
    # Group indices (cluster order) along the pipeline.
    order: tuple[int, ...]
    # Stages, TP per group, indexed in cluster order.
    stages: tuple[int, ...]
    tp: tuple[int, ...]
    dp: int
    micro_batch_size: int
    recompute: bool
    num_microbatches: int

    def layout(self) -> list[tuple[int, int]]:
        """(group index, stage index within the group) of each stage, in pipeline order."""
        return [(g, j) for g in self.order for j in range(self.stages[g])]

    def describe(self, names: Sequence[str]) -> str:
        parts = [f"{names[g]}: {self.stages[g]} stage(s) x TP{self.tp[g]}" for g in self.order]
        return (f"{', '.join(parts)}, DP{self.dp}, microbatch {self.micro_batch_size} x "
                f"{self.num_microbatches}, recompute {'on' if self.recompute else 'off'}")


@dataclass
class _GroupCosts:
    """Per-range matrices of one group at one shape: entry [i, j] is a stage holding units [i, j)."""
    time: np.ndarray
    static: np.ndarray
    act: np.ndarray
    transient: np.ndarray
    sync: np.ndarray
    capacity: float


class CostContext:
    """Everything fixed for one planning problem, with caches of the per-group costs."""

    def __init__(self, model: ModelConfig, cluster: ClusterConfig, train: TrainShape,
                 planner: PlannerConfig) -> None:
        self.model, self.cluster, self.train, self.planner = model, cluster, train, planner
        self.catalog = catalog_with(dict(planner.catalog or {}))
        self.groups: list[GroupConfig] = list(cluster.groups)
        self.names = [g.name for g in self.groups]
        self.device_types = [_device_type(g, self.catalog) for g in self.groups]
        self.specs: list[DeviceSpec] = [device_spec(d, self.catalog) for d in self.device_types]
        self.precisions = [cost.Precision.for_device(s, train.precision, train.fuse_elementwise, train.compile)
                           for s in self.specs]
        self.starts = [sum(g.size for g in self.groups[:i]) for i in range(len(self.groups))]
        self.net = planner.network
        self.num_units = model.num_units
        # Measured costs by device type; a device whose shapes were not profiled
        # keeps the analytic model (and the plan's notes say so).
        self.profiles = load_profile(planner.profile) if planner.profile else {}
        self.cost_source = {}
        for g, (name, dtype, prec) in enumerate(zip(self.names, self.device_types, self.precisions)):
            shape = profile_shape(model, train.seq_length, prec.name, prec.fused_elementwise)
            self.cost_source[name] = "profile" if find_entry(self.profiles, dtype, shape, 0) else "analytic"
        kind = cluster.transport.kind
        self.transport = planner.transport if planner.transport != "auto" else \
            ("direct" if kind == "direct" else "cpu_forwarding")
        t = cluster.transport
        self.tcp_streams = 1 if kind == "gloo" else len(t.addresses) * t.streams_per_address
        self._units: dict = {}
        self._groups: dict = {}

    # -- per-group costs --------------------------------------------------------------
    def unit_costs(self, g: int, tp: int, mbs: int, recompute: bool, alone: bool) -> cost.UnitCosts:
        key = (g, tp, mbs, recompute, alone)
        if key not in self._units:
            entry = find_entry(self.profiles, self.device_types[g],
                               profile_shape(self.model, self.train.seq_length, self.precisions[g].name,
                                             self.precisions[g].fused_elementwise), mbs)
            shape = cost.StageShape(tp, mbs, self.train.seq_length, recompute)
            shares = alone and self.model.share_embeddings_and_output_weights
            self._units[key] = cost.unit_costs(self.model, self.specs[g], shape, self.precisions[g], self.net,
                                               self.planner.efficiency, entry, head_shares_embedding=shares)
        return self._units[key]

    def group_costs(self, g: int, tp: int, dp: int, mbs: int, recompute: bool, alone: bool) -> _GroupCosts:
        key = (g, tp, dp, mbs, recompute, alone)
        if key in self._groups:
            return self._groups[key]
        uc = self.unit_costs(g, tp, mbs, recompute, alone)
        spec = self.specs[g]
        time = _range_sums(uc.time_s)
        time[~np.triu(np.ones_like(time, dtype=bool), 1)] = INF
        params = _range_sums(uc.params)
        static = params * self.precisions[g].static_bytes_per_param(dp, self.planner.distributed_optimizer) \
            + 2 * cost.RECV_AHEAD * uc.boundary_bytes
        gbs, lat = self.dp_link(g, tp, dp)
        sync = cost.grad_sync_s(params, dp, gbs, lat, spec, self.planner.distributed_optimizer,
                                self.precisions[g].grad_bytes)
        capacity = spec.memory_gib * cost.GIB * self.planner.memory_headroom
        gcosts = _GroupCosts(time, static, _range_sums(uc.activation_bytes),
                             _range_max(uc.transient_bytes), sync, capacity)
        self._groups[key] = gcosts
        return gcosts

    def dp_link(self, g: int, tp: int, dp: int) -> tuple[float, float]:
        """(GB/s per direction, latency) of the ring a stage's DP all-reduce runs on."""
        spec, rpn = self.specs[g], self.groups[g].ranks_per_node
        fabric = spec.intra_node_link_gbs / 2
        if tp * dp <= rpn and rpn % (tp * dp) == 0:
            return fabric, self.net.intra_node_latency_us
        return min(fabric, cost.nic_share_gbs(self.net, rpn)), self.net.latency_us

    # -- boundaries --------------------------------------------------------------------
    def link_s(self, cand: Candidate, a: tuple[int, int], b: tuple[int, int]) -> float:
        """One microbatch's message over the boundary between stages a and b (the
        slower of the two directions)."""
        (ga, ja), (gb, _) = a, b
        mbs, rc = cand.micro_batch_size, cand.recompute
        ua = self.unit_costs(ga, cand.tp[ga], mbs, rc, False)
        ub = self.unit_costs(gb, cand.tp[gb], mbs, rc, False)
        na, nb = cand.tp[ga] * cand.dp, cand.tp[gb] * cand.dp
        rpn_a, rpn_b = self.groups[ga].ranks_per_node, self.groups[gb].ranks_per_node
        if ga == gb:
            offsets = np.arange(na) + ja * na
            same_node = bool(np.all(offsets // rpn_a == (offsets + na) // rpn_a))
            route = "intra_node" if same_node else "network"
        else:
            route = "network" if self.transport == "direct" else "cpu_forwarding"
        sa, sb = self.specs[ga], self.specs[gb]
        forward = cost.message_s(ua.boundary_bytes, route, sa, sb, self.net, min(rpn_a, na), self.tcp_streams)
        backward = cost.message_s(ub.boundary_bytes, route, sb, sa, self.net, min(rpn_b, nb), self.tcp_streams)
        return max(forward, backward)

    def tied_sync_s(self, cand: Candidate) -> float:
        """With tied embeddings on different stages, their gradients are summed over
        the world (gloo, through host memory) after every step."""
        if not self.model.share_embeddings_and_output_weights or sum(cand.stages) == 1:
            return 0.0
        first, last = cand.order[0], cand.order[-1]
        nbytes = self.model.vocab_size * self.model.hidden_size * cost.GRAD_BYTES / cand.tp[first]
        return 2 * cost.message_s(nbytes, "cpu_forwarding", self.specs[first], self.specs[last], self.net,
                                  min(self.groups[first].ranks_per_node, cand.tp[first] * cand.dp), 1)

    # -- one candidate -------------------------------------------------------------------
    def problem(self, cand: Candidate) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                 list[float]]:
        """A candidate's split problem: (P, U+1, U+1) arrays of stage time, sync time,
        fits-in-memory and memory bytes; usable bytes per stage; boundary times."""
        layout = cand.layout()
        P = len(layout)
        alone = P == 1
        per_stage = [self.group_costs(g, cand.tp[g], cand.dp, cand.micro_batch_size, cand.recompute, alone)
                     for g, _ in layout]
        inflight = np.minimum(P - np.arange(P), cand.num_microbatches).astype(float)
        time = np.stack([c.time for c in per_stage])
        sync = np.stack([c.sync for c in per_stage])
        memory = np.stack([c.static + n * c.act + c.transient for c, n in zip(per_stage, inflight)])
        capacity = np.array([c.capacity for c in per_stage])
        feasible = memory <= capacity[:, None, None]
        tied = self.tied_sync_s(cand)
        if tied:
            sync = sync.copy()
            sync[0, 0, :] += tied
            sync[-1, :, -1] += tied
        links = [self.link_s(cand, layout[k], layout[k + 1]) for k in range(P - 1)]
        return time, sync, feasible, memory, capacity, links


def _range_sums(x: np.ndarray) -> np.ndarray:
    c = np.concatenate([[0.0], np.cumsum(x)])
    return c[None, :] - c[:, None]


def _range_max(x: np.ndarray) -> np.ndarray:
    n = len(x) + 1
    out = np.zeros((n, n))
    for i in range(n - 1):
        out[i, i + 1:] = np.maximum.accumulate(x[i:])
    return out


def _device_type(group: GroupConfig, catalog: dict[str, DeviceSpec]) -> str:
    """The catalog key of a group's devices; ``auto`` is this machine's device."""
    if group.device_type != "auto":
        return device_spec(group.device_type, catalog).name
    if not torch.cuda.is_available():
        return "CPU"
    found = detect_device_type(accelerator_name(), catalog)
    if not found:
        raise ConfigError(f"group {group.name!r} has device_type=auto and this machine's "
                          f"{accelerator_name()!r} is not in the catalog: set the group's device_type "
                          "(add the device with planner.catalog if it is new)")
    return found
