"""The cost context: one planning problem's fixed inputs, and what a candidate costs.

The search (:mod:`hetpipe.partitioner.solver`) visits many candidate layouts
of one cluster; most share per-group unit costs. :class:`CostContext` resolves
each group's device, precision and profile once, caches the per-unit and
per-range costs by (group, TP, DP, microbatch size, recomputation mode), and
turns a :class:`Candidate` into the matrices the exact split
(:mod:`hetpipe.partitioner.split`) solves: stage time, gradient-sync time and
memory for every contiguous unit range, and the time of each boundary message.

Activation recomputation is chosen per stage and unit range, inside those
matrices: a stage holding units [i, j) runs the cheapest option that fits its
devices - no recomputation, selective recomputation of every layer, or full
recomputation of its first N layers with N the fewest that fit (each layer
recomputed saves the same bytes for the same time, so fewer is cheaper).
The split search then sees one time and one fits-or-not per range, as before.
The schedule (:mod:`hetpipe.partitioner.schedule_model`) sets what each
stage keeps at its peaks (``memory_rows``: microbatches in flight, zero
bubble's B-to-W gradients, messages sent), which recomputation modes it may
run, and each stage's share of the fill/drain path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional, Sequence

import numpy as np

from hetpipe.devices.cluster import ClusterConfig, GroupConfig
from hetpipe.errors import ConfigError
from hetpipe.devices.group_precision import fp8_format, group_precision
from hetpipe.models.model_config import ModelConfig
from hetpipe.models.train_modes import RECOMPUTE_MODES
# Siblings by their own path, not through the package, whose __init__ imports the solver.
import hetpipe.partitioner.context_cost as context_cost
import hetpipe.partitioner.cost as cost
import hetpipe.partitioner.schedule_model as schedule_model
from hetpipe.devices.catalog import DeviceSpec, catalog_with, device_spec
from hetpipe.devices.facts import local_device_type
from hetpipe.partitioner.inputs import TrainShape
from hetpipe.partitioner.planner_config import PlannerConfig
from hetpipe.partitioner.profile_files import find_entry, planner_profiles, profile_shape
from hetpipe.partitioner.split import INF
from hetpipe.pipeline.registry import DEFAULT_SCHEDULE
from hetpipe.pipeline.transports import transport


@dataclass(frozen=True)
class Candidate:
    # Group indices (cluster order) along the pipeline.
    order: tuple[int, ...]
    # Stages, TP per group, indexed in cluster order.
    stages: tuple[int, ...]
    tp: tuple[int, ...]
    dp: int
    micro_batch_size: int
    num_microbatches: int

    def layout(self) -> list[tuple[int, int]]:
        """(group index, stage index within the group) of each stage, in pipeline order."""
        return [(g, j) for g in self.order for j in range(self.stages[g])]

    def describe(self, names: Sequence[str]) -> str:
        parts = [f"{names[g]}: {self.stages[g]} stage(s) x TP{self.tp[g]}" for g in self.order]
        return f"{', '.join(parts)}, DP{self.dp}, microbatch {self.micro_batch_size} x {self.num_microbatches}"


@dataclass
class _GroupCosts:
    """Per-range matrices of one group at one shape: entry [i, j] is a stage holding units [i, j)."""
    time: np.ndarray
    # The weight-gradient part (zero bubble's W) of time.
    weight: np.ndarray
    static: np.ndarray
    act: np.ndarray
    transient: np.ndarray
    # Zero bubble: kept from B to W per microbatch, and held while W runs
    # (cost.weight_pass_bytes: the net gradients of the range, and one unit's
    # all at once).
    kept: np.ndarray
    wgrad: np.ndarray
    sync: np.ndarray
    capacity: float
    # Parameters per device, for one sync over two ranges (zb_v's chunks).
    params: np.ndarray
    # One boundary message per device (the sends a rank holds, memory_rows).
    boundary: float


@dataclass
class _StageChoice:
    """The option a stage runs for each unit range [i, j), at one in-flight count."""
    time: np.ndarray
    # Bytes per device of the chosen option, or of the leanest one where none fits.
    memory: np.ndarray
    feasible: np.ndarray
    # Index into RECOMPUTE_MODES, and the layers the mode covers.
    mode: np.ndarray
    layers: np.ndarray


@dataclass
class SplitProblem:
    """One candidate's split problem: entry [k, i, j] of each (P, U+1, U+1) array
    is stage k holding units [i, j)."""
    # Per microbatch: forward + backward (recomputation included) + TP collectives.
    time: np.ndarray
    # The stage's share of the fill/drain path (schedule_model): time under 1F1B.
    path: np.ndarray
    # Per step: DP gradient sync and optimizer step.
    sync: np.ndarray
    feasible: np.ndarray
    # One microbatch's message over each boundary.
    links: list[float]
    # Each stage's choice and its group's costs without recomputation: the
    # arrays below are stacked from them when asked for, as only the plan
    # chosen and the no-fit message read them, not the split search.
    choices: list[_StageChoice] = field(repr=False)
    base: list[_GroupCosts] = field(repr=False)

    @cached_property
    def memory(self) -> np.ndarray:
        """Bytes per device (see _StageChoice.memory)."""
        return np.stack([c.memory for c in self.choices])

    @cached_property
    def capacity(self) -> np.ndarray:
        """Usable bytes per stage's device."""
        return np.array([c.capacity for c in self.base])

    @cached_property
    def recompute(self) -> np.ndarray:
        """The recomputation each stage would run: an index into RECOMPUTE_MODES."""
        return np.stack([c.mode for c in self.choices])

    @cached_property
    def recompute_layers(self) -> np.ndarray:
        """The layers (a stage's first ones) its recomputation covers."""
        return np.stack([c.layers for c in self.choices])


class CostContext:
    """Everything fixed for one planning problem, with caches of the per-group costs."""

    def __init__(self, model: ModelConfig, cluster: ClusterConfig, train: TrainShape,
                 planner: PlannerConfig, cp: int = 1, cp_method: str = "allgather") -> None:
        self.model, self.cluster, self.train, self.planner = model, cluster, train, planner
        # Context parallelism: every stage's sequences split over cp ranks
        # (partitioner/context_cost.py); a rank's units are priced at its tokens.
        self.cp, self.cp_method = cp, cp_method
        self.rank_seq_length = train.seq_length // cp
        self.catalog = catalog_with(dict(planner.catalog or {}))
        self.groups: list[GroupConfig] = list(cluster.groups)
        self.names = [g.name for g in self.groups]
        self.device_types = [_device_type(g, self.catalog) for g in self.groups]
        self.specs: list[DeviceSpec] = [device_spec(d, self.catalog) for d in self.device_types]
        fusion = getattr(train, "grad_accumulation_fusion", True)
        self.precisions = [cost.Precision.for_device(s, group_precision(train.precision, g.precision),
                                                     train.fuse_elementwise, train.compile, fusion)
                           for s, g in zip(self.specs, self.groups)]
        for i, (g, prec) in enumerate(zip(self.groups, self.precisions)):
            if prec.fp8:  # a group on a device without FP8 is refused as the trainer refuses it
                fp8_format(train.precision, g.precision, i, g.name, self.device_types[i], self.catalog)
        self.starts = [sum(g.size for g in self.groups[:i]) for i in range(len(self.groups))]
        self.net = planner.network
        self.num_units = model.num_units
        # Measured costs by device type; a device whose shapes were not profiled
        # keeps the analytic model (and the plan's notes say so).
        self.profiles = planner_profiles(planner.profile, planner.builtin_profiles)
        self.cost_source = {}
        for g, name in enumerate(self.names):
            entry, scaled = self._profile_entry(g, 0)
            self.cost_source[name] = "analytic" if entry is None else \
                "bf16 profile scaled to fp8 by the peak ratio (fp8 not measured)" if scaled else "profile"
        t = cluster.transport
        entry = transport(t.kind)
        self.transport = planner.transport if planner.transport != "auto" else entry.cost_model
        self.tcp_streams = len(t.addresses) * t.streams_per_address if entry.stripes else 1
        unknown = sorted(set(planner.memory_gib or {}) - set(self.names))
        if unknown:
            raise ConfigError(f"planner.memory_gib names {unknown}, not groups of cluster {cluster.name!r} "
                              f"({', '.join(self.names)})")
        if train.compile and planner.recompute not in ("auto", "none"):
            raise ConfigError(f"planner.recompute={planner.recompute} cannot be run with train.compile=true "
                              "(see partitioner/resolve.py); use planner.recompute=none")
        # The modes a stage may run; the runtime does not recompute compiled layers (fp8's too).
        compiled = train.compile or any(p.fp8 for p in self.precisions)
        self.recompute_modes: tuple[str, ...] = ("none",) if compiled else \
            RECOMPUTE_MODES if planner.recompute == "auto" else (planner.recompute,)
        # Decoder layers in each unit range [i, j): the units less the embedding and the head.
        idx = np.arange(self.num_units + 1)
        self.range_layers = np.clip(idx[None, :] - idx[:, None] - (idx[:, None] == 0)
                                    - (idx[None, :] == self.num_units), 0, None)
        self._units: dict = {}
        self._groups: dict = {}
        self._choices: dict = {}
        self._links: dict = {}

    # -- per-group costs --------------------------------------------------------------
    def unit_costs(self, g: int, tp: int, mbs: int, recompute: str, alone: bool) -> cost.UnitCosts:
        """Per-unit costs of group ``g`` with every layer recomputing in ``recompute``."""
        key = (g, tp, mbs, recompute, alone)
        if key not in self._units:
            entry, scaled = self._profile_entry(g, mbs)
            shape = cost.StageShape(tp, mbs, self.rank_seq_length, recompute)
            shares = alone and self.model.share_embeddings_and_output_weights
            units = cost.unit_costs(self.model, self.specs[g], shape, self.precisions[g], self.net,
                                    self.planner.efficiency, entry, head_shares_embedding=shares,
                                    profile_is_bf16=scaled)
            self._units[key] = units if self.cp == 1 else self._context_units(g, tp, mbs, recompute, units)
        return self._units[key]

    def _context_units(self, g: int, tp: int, mbs: int, recompute: str, units: cost.UnitCosts) -> cost.UnitCosts:
        """A CP rank's costs from those of its tokens (context_cost.context_unit_costs)."""
        spec = self.specs[g]
        rate = spec.peak_bf16_tflops * 1e12 * (self.planner.efficiency or spec.efficiency)
        gbs, latency = self._group_link(g, tp * self.cp)
        shape = context_cost.CpShape(self.train.seq_length, self.cp, self.cp_method, rate, gbs, latency)
        return context_cost.context_unit_costs(units, self.model, mbs, tp, recompute,
                                               self.precisions[g].matmul_bytes, shape)

    def _profile_entry(self, g: int, mbs: int) -> tuple[Optional[dict], bool]:
        """Group ``g``'s measured entry, and whether it is a bf16 one standing in for
        fp8 (no fp8 entry; either elementwise setting, since compiled layers fuse too)."""
        prec = self.precisions[g]
        found = find_entry(self.profiles, self.device_types[g],
                           profile_shape(self.model, self.rank_seq_length, prec.name, prec.fused_elementwise), mbs)
        if found is not None or not prec.fp8:
            return found, False
        for fused in (prec.fused_elementwise, not prec.fused_elementwise):
            found = find_entry(self.profiles, self.device_types[g],
                               profile_shape(self.model, self.rank_seq_length, "bf16", fused), mbs)
            if found is not None:
                return found, True
        return None, False

    def group_costs(self, g: int, tp: int, dp: int, mbs: int, recompute: str, alone: bool) -> _GroupCosts:
        key = (g, tp, dp, mbs, recompute, alone)
        if key in self._groups:
            return self._groups[key]
        uc = self.unit_costs(g, tp, mbs, recompute, alone)
        time = _range_sums(uc.time_s)
        time[~np.triu(np.ones_like(time, dtype=bool), 1)] = INF
        params = _range_sums(uc.params)
        # The gradient group, and ZeRO-1's shards, are DP x CP (the CP ranks hold the same parameters).
        static = params * self.precisions[g].static_bytes_per_param(dp * self.cp, self.planner.distributed_optimizer) \
            + 2 * cost.RECV_AHEAD * uc.boundary_bytes
        sync = self.grad_sync_s(g, tp, dp * self.cp, params)
        capacity = self.memory_gib(g) * cost.GIB * self.planner.memory_headroom
        weight = _range_sums(schedule_model.weight_backward_s(self.model, mbs, self.train.seq_length,
                                                              uc.forward_s, uc.backward_s))
        wgrad = _range_sums(uc.weight_net_bytes) + _range_max(uc.weight_grad_bytes)
        gcosts = _GroupCosts(time, weight, static, _range_sums(uc.activation_bytes),
                             _range_max(uc.transient_bytes), _range_sums(uc.weight_kept_bytes), wgrad, sync,
                             capacity, params, uc.boundary_bytes)
        self._groups[key] = gcosts
        return gcosts

    def grad_sync_s(self, g: int, tp: int, dp: int, params):
        """DP gradient sync and optimizer step of a stage of group ``g`` holding ``params`` per device."""
        gbs, lat = self.dp_link(g, tp, dp)
        return cost.grad_sync_s(params, dp, gbs, lat, self.specs[g], self.planner.distributed_optimizer,
                                self.precisions[g].grad_bytes)

    def memory_gib(self, g: int) -> float:
        """Memory of one device of group ``g``: ``planner.memory_gib``'s, else the catalog's."""
        return (self.planner.memory_gib or {}).get(self.names[g], self.specs[g].memory_gib)

    def stage_choice(self, g: int, tp: int, dp: int, mbs: int, rows: np.ndarray, alone: bool,
                     modes: tuple[str, ...]) -> _StageChoice:
        """For every unit range, the cheapest recomputation of ``modes`` that fits
        a stage of group ``g`` whose rank holds what ``rows`` count
        (:func:`~hetpipe.partitioner.schedule_model.memory_rows`; ties: less
        recomputation)."""
        key = (g, tp, dp, mbs, rows.shape, rows.tobytes(), alone, modes)
        if key in self._choices:
            return self._choices[key]
        base = self.group_costs(g, tp, dp, mbs, "none", alone)
        capacity, layers = base.capacity, self.range_layers
        # (time, memory, memory at its leanest, mode index, layers covered) per option.
        options = []
        for m, mode in enumerate(RECOMPUTE_MODES):
            if mode not in modes:
                continue
            gc = self.group_costs(g, tp, dp, mbs, mode, alone)
            every = gc.static + gc.transient + schedule_model.peak_bytes(rows, [gc.act], [gc.kept], [gc.wgrad],
                                                                         gc.boundary)
            if mode == "full" and self.planner.recompute == "auto":
                time, memory, count = self._fewest_full_layers(g, tp, mbs, alone, base, gc, rows)
                options.append((time, memory, every, m, count))
            else:
                options.append((gc.time, every, every, m, np.zeros_like(layers) if mode == "none" else layers))
        time = base.time.copy()
        memory = np.full_like(base.time, INF)
        leanest = np.full_like(base.time, INF)
        mode = np.zeros(base.time.shape, int)
        count = np.zeros(base.time.shape, int)
        for t, mem, lean, m, n in options:
            better = (mem <= capacity) & ((t < time) | ~(memory <= capacity))
            time, memory = np.where(better, t, time), np.where(better, mem, memory)
            mode, count = np.where(better, m, mode), np.where(better, n, count)
            leanest = np.minimum(leanest, lean)
        feasible = memory <= capacity
        chosen = _StageChoice(time, np.where(feasible, memory, leanest), feasible, mode, count)
        self._choices[key] = chosen
        return chosen

    def _fewest_full_layers(self, g: int, tp: int, mbs: int, alone: bool, base: _GroupCosts, full: _GroupCosts,
                            rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(time, memory, N) of full recomputation of the fewest first N layers
        of each range that fit (N = all of them where none do). Full
        recomputation runs under 1F1B and GPipe only, whose rows count
        activations and sends alone: each row's bytes fall by its activations'
        count times one layer's saving per layer recomputed."""
        u0 = self.unit_costs(g, tp, mbs, "none", alone)
        uf = self.unit_costs(g, tp, mbs, "full", alone)
        # All layers are alike: each one recomputed saves and costs the same.
        saved = u0.activation_bytes[1] - uf.activation_bytes[1]
        extra_s = uf.time_s[1] - u0.time_s[1]
        layers = self.range_layers

        def memory_at(n: np.ndarray) -> np.ndarray:
            # No layer recomputed, but the transient of one that is.
            act = base.act - n * saved
            return full.static + full.transient + schedule_model.peak_bytes(rows, [act], [full.kept], [full.wgrad],
                                                                            full.boundary)
        count = np.ones_like(layers, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            for row in rows:  # each row's own fewest layers; all must fit
                over = full.static + full.transient + row[0] * base.act + row[-1] * full.boundary - base.capacity
                need = np.ceil(over / (row[0] * saved))
                count = np.maximum(count, np.where(np.isfinite(need), need, layers))
        count = np.clip(count, 1, layers)
        memory = memory_at(count)
        bump = (memory > base.capacity) & (count < layers)  # rounding in the division
        count = count + bump
        memory = memory_at(count)
        return base.time + count * extra_s, memory, count.astype(int)

    def dp_link(self, g: int, tp: int, dp: int) -> tuple[float, float]:
        """(GB/s per direction, latency) of the ring a stage's DP all-reduce runs on."""
        return self._group_link(g, tp * dp)

    def _group_link(self, g: int, span: int) -> tuple[float, float]:
        """(GB/s per direction, latency) of a collective over ranks of group ``g``
        spread over ``span`` consecutive ranks: the fabric within a node, else the NICs."""
        spec, rpn = self.specs[g], self.groups[g].ranks_per_node
        fabric = spec.intra_node_link_gbs / 2
        if span <= rpn and rpn % span == 0:
            return fabric, self.net.intra_node_latency_us
        return min(fabric, cost.nic_share_gbs(self.net, rpn)), self.net.latency_us

    # -- boundaries --------------------------------------------------------------------
    def link_s(self, cand: Candidate, a: tuple[int, int], b: tuple[int, int]) -> float:
        """One microbatch's message over the boundary between stages a and b (the
        slower of the two directions)."""
        (ga, ja), (gb, _) = a, b
        # The same boundary recurs across candidates and V splits: priced once.
        key = (ga, gb, ja if ga == gb else None, cand.tp[ga], cand.tp[gb], cand.dp, cand.micro_batch_size)
        if key not in self._links:
            self._links[key] = self._link_s(cand, a, b)
        return self._links[key]

    def _link_s(self, cand: Candidate, a: tuple[int, int], b: tuple[int, int]) -> float:
        (ga, ja), (gb, _) = a, b
        mbs = cand.micro_batch_size
        ua = self.unit_costs(ga, cand.tp[ga], mbs, "none", False)
        ub = self.unit_costs(gb, cand.tp[gb], mbs, "none", False)
        na, nb = cand.tp[ga] * cand.dp * self.cp, cand.tp[gb] * cand.dp * self.cp
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
                                  min(self.groups[first].ranks_per_node, cand.tp[first] * cand.dp * self.cp), 1)

    # -- one candidate -------------------------------------------------------------------
    def problem(self, cand: Candidate, schedule: str = DEFAULT_SCHEDULE) -> SplitProblem:
        """A candidate's contiguous split problem under ``schedule`` (see
        :class:`SplitProblem`; zb_v's V: :mod:`hetpipe.partitioner.v_split`)."""
        if schedule_model.is_v_shaped(schedule):
            raise ValueError(f"{schedule} is not a contiguous split: see partitioner/v_split.py")
        layout = cand.layout()
        P, M = len(layout), cand.num_microbatches
        alone = P == 1
        mbs = cand.micro_batch_size
        rows = schedule_model.memory_rows(schedule, P, M)
        modes = schedule_model.recompute_modes(schedule, self.recompute_modes)
        base = [self.group_costs(g, cand.tp[g], cand.dp, mbs, "none", alone) for g, _ in layout]
        choices = [self.stage_choice(g, cand.tp[g], cand.dp, mbs, r, alone, modes)
                   for (g, _), r in zip(layout, rows)]
        time = np.stack([c.time for c in choices])
        # Zero bubble takes each later stage's W off the fill/drain path twice
        # (schedule_model); W does not depend on the recomputation mode.
        credit = 2 * schedule_model.weight_credit(schedule, P, M)
        path = time - credit * np.stack([np.zeros_like(base[0].weight)] + [c.weight for c in base[1:]])
        sync = np.stack([c.sync for c in base])
        tied = self.tied_sync_s(cand)
        if tied:
            sync[0, 0, :] += tied
            sync[-1, :, -1] += tied
        links = [self.link_s(cand, layout[k], layout[k + 1]) for k in range(P - 1)]
        return SplitProblem(time=time, path=path, sync=sync, feasible=np.stack([c.feasible for c in choices]),
                            links=links, choices=choices, base=base)


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
    """The catalog key of a group's devices; ``auto`` is this machine's device, detected
    as every rank detects its own at the roll call (hetpipe/devices/facts.py)."""
    if group.device_type != "auto":
        return device_spec(group.device_type, catalog).name
    found, name = local_device_type(catalog)
    if not found:
        raise ConfigError(f"group {group.name!r} has device_type=auto and this machine's "
                          f"{name!r} is not in the catalog: set the group's device_type "
                          "(add the device with planner.catalog if it is new)")
    return found
