"""The plan solver: which stages, where, with which layers, under every device's memory.

For a cluster of vendor groups the solver chooses the order of the groups
along the pipeline, the number of pipeline stages each group hosts, TP per
group (within a node, dividing the heads), one DP degree for all stages
(Megatron's constraint), the microbatch size (hence the microbatch count) and
full recomputation on or off - and, for each such *candidate*, the contiguous
split of the model units (embedding and head included) over the stages. The
objective is the predicted 1F1B step time

    T = (M - 1) * max(max_k t_k, max_l c_l) + sum_k t_k + 2 * sum_l c_l + max_k a_k

with t_k stage k's forward + backward time of one microbatch (TP collectives
included), c_l one message over boundary l (the engine posts receives ahead
and sends asynchronously, so a boundary behaves as a pipeline stage of its
own), a_k stage k's DP gradient all-reduce and optimizer step after the
flush, and M microbatches. With equal stages and free links this is the
textbook (M + P - 1) * t, a bubble fraction of (P - 1) / (M + P - 1).

The split is solved exactly, not greedily (:func:`best_split`): a dynamic
program over unit boundaries minimises sum t under thresholds on max t and on
max a; thresholds are walked in increasing order of max t and, for each, down
the Pareto front of (sum t, max a), with lower bounds that stop both walks.
Each dynamic program is O(P * U^2) for P stages and U units. Candidates are
visited best-first by a lower bound (perfect balance at the candidate's
aggregate speed) and the search stops when the bound passes the best plan
found, which is what keeps 1024 GPUs under a few seconds.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

import numpy as np

from hetpipe.cluster import ClusterConfig, GroupConfig
from hetpipe.errors import ConfigError
from hetpipe.models.model_config import ModelConfig
from hetpipe.models.flops import megatron_model_flops
from hetpipe.partitioner import cost
from hetpipe.partitioner.catalog import DeviceSpec, catalog_with, detect_device_type, device_spec
from hetpipe.partitioner.plan import Plan, StagePlan
from hetpipe.partitioner.profile import find_entry, load_profile, profile_shape

if TYPE_CHECKING:
    from hetpipe.pretrain_config import TrainConfig

TRANSPORT_MODELS = ("auto", "direct", "cpu_forwarding")
INF = math.inf


@dataclass
class PlannerConfig:
    # Fraction of dense peak reached by every device's compute; None takes the
    # catalog's per-device figure. Ignored for devices with a profile.
    efficiency: Optional[float] = None
    # Profile JSON from `python -m hetpipe.plan profile`; measured costs replace
    # the analytic ones for the device types and shapes it covers.
    profile: Optional[str] = None
    # Usable fraction of device memory (allocator fragmentation, the CUDA/HIP
    # context and communicator buffers take the rest).
    memory_headroom: float = 0.9
    # Shard Adam's state over DP (Megatron's --use-distributed-optimizer).
    distributed_optimizer: bool = False
    # Full activation recomputation: None lets the solver choose.
    recompute: Optional[bool] = None
    # Fix the TP degree of every group; None searches the divisors of the head
    # counts that fit in a node.
    tp: Optional[int] = None
    # Fix the DP degree; None searches it.
    dp: Optional[int] = None
    # Fix the pipeline stages per group, in the cluster's group order.
    stages: Optional[List[int]] = None
    # Fix the order of the groups along the pipeline (group names).
    group_order: Optional[List[str]] = None
    # Microbatch sizes to consider; None keeps train.micro_batch_size.
    micro_batch_sizes: Optional[List[int]] = None
    # How cross-vendor boundaries are costed: direct (device-direct), or
    # cpu_forwarding; auto follows cluster.transport.kind as the runtime
    # resolves it (auto and tcp are CPU-forwarding today).
    transport: str = "auto"
    network: cost.NetworkConfig = field(default_factory=cost.NetworkConfig)
    # Catalog overrides and extra devices: {H200: {efficiency: 0.6}, NEW: {...}}.
    catalog: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.memory_headroom <= 1:
            raise ConfigError(f"planner.memory_headroom={self.memory_headroom} must be in (0, 1]")
        if self.efficiency is not None and not 0 < self.efficiency <= 1:
            raise ConfigError(f"planner.efficiency={self.efficiency} must be in (0, 1]")
        if self.transport not in TRANSPORT_MODELS:
            raise ConfigError(f"planner.transport={self.transport!r} is not one of {TRANSPORT_MODELS}")
        for name in ("tp", "dp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"planner.{name}={value} must be positive")


# -- the exact split -------------------------------------------------------------------

@dataclass(frozen=True)
class Split:
    # Unit boundaries: stage k holds units [bounds[k], bounds[k + 1]).
    bounds: tuple[int, ...]
    step_s: float
    max_stage_s: float
    max_sync_s: float


def step_time_s(num_microbatches: int, stage_s: Sequence[float], link_s: Sequence[float],
                sync_s: Sequence[float]) -> float:
    """Predicted 1F1B step time (the formula in the module docstring)."""
    bottleneck = max(max(stage_s), max(link_s, default=0.0))
    return (num_microbatches - 1) * bottleneck + sum(stage_s) + 2 * sum(link_s) + max(sync_s)


def evaluate_split(time: np.ndarray, sync: np.ndarray, feasible: np.ndarray, num_microbatches: int,
                   links: Sequence[float], bounds: Sequence[int]) -> Optional[Split]:
    """The step time of one given split, or None if a stage is empty or does not fit.

    ``time``, ``sync`` and ``feasible`` are (P, U+1, U+1): entry [k, i, j] is
    stage k holding units [i, j).
    """
    P = time.shape[0]
    ks = range(P)
    if any(bounds[k + 1] <= bounds[k] for k in ks) or not all(feasible[k, bounds[k], bounds[k + 1]] for k in ks):
        return None
    stage = [float(time[k, bounds[k], bounds[k + 1]]) for k in ks]
    syncs = [float(sync[k, bounds[k], bounds[k + 1]]) for k in ks]
    return Split(tuple(int(b) for b in bounds), step_time_s(num_microbatches, stage, links, syncs),
                 max(stage), max(syncs))


def best_split(time: np.ndarray, sync: np.ndarray, feasible: np.ndarray, num_microbatches: int,
               links: Sequence[float] = ()) -> Optional[Split]:
    """The split of U units over P stages with the least step time, or None.

    Exact: let S* be optimal with max t = X*, sum t = Y*, max a = Z*. The
    outer walk reaches the threshold tau = X* (it stops only once
    (M-1)*max(tau, c_max) + min sum t + 2 sum c + min max a reaches the best
    found); at that tau the inner walk minimises sum t, then requires max a
    below the last solution's, and so on, so it meets a solution with
    sum t <= Y* and max a <= Z* unless its bound shows none can beat the best.
    Ties go to the first split found, so the result is deterministic.
    """
    N = time.shape[1]
    M1 = num_microbatches - 1
    upper = np.triu(np.ones((N, N), dtype=bool), 1)
    valid = feasible & upper
    t = np.where(valid, time, INF)
    a = np.where(valid, sync, INF)
    tau0 = _minimax(t)
    if not math.isfinite(tau0):
        return None
    c_max, c_sum = max(links, default=0.0), 2 * sum(links)
    y_min, _ = _min_sum(t)
    z_min = _minimax(a)

    def evaluate(bounds: list[int]) -> Split:
        return evaluate_split(time, sync, valid, num_microbatches, links, bounds)

    # Thresholds at or below the slowest link all cost (M-1)*c_max: start at
    # the largest of them, which admits the most splits.
    finite = t[np.isfinite(t)]
    if M1 == 0:
        tau = INF
    else:
        below = finite[(finite >= tau0) & (finite <= c_max)]
        tau = float(below.max()) if below.size else tau0
    best: Optional[Split] = None
    while True:
        if best is not None and M1 * max(tau, c_max) + y_min + c_sum + z_min >= best.step_s:
            break
        t_tau = np.where(t <= tau, t, INF)
        limit = INF
        while True:
            y, bounds = _min_sum(t_tau if limit == INF else np.where(a < limit, t_tau, INF))
            if bounds is None:
                break
            split = evaluate(bounds)
            if best is None or split.step_s < best.step_s:
                best = split
            if M1 * max(tau, c_max) + y + c_sum + z_min >= best.step_s:
                break
            limit = split.max_sync_s
        larger = finite[finite > tau]
        if not larger.size:
            break
        tau = float(larger.min())
    return best


def _min_sum(cost_: np.ndarray) -> tuple[float, Optional[list[int]]]:
    """min over splits of the sum of stage costs, and the boundaries of the first minimiser."""
    P, N = cost_.shape[0], cost_.shape[1]
    best = cost_[0, 0].copy()
    choices = []
    columns = np.arange(N)
    for k in range(1, P):
        total = best[:, None] + cost_[k]
        arg = np.argmin(total, axis=0)
        best = total[arg, columns]
        choices.append(arg)
    value = float(best[N - 1])
    if not math.isfinite(value):
        return value, None
    bounds = [N - 1]
    for arg in reversed(choices):
        bounds.append(int(arg[bounds[-1]]))
    bounds.append(0)
    return value, bounds[::-1]


def _minimax(cost_: np.ndarray, with_bounds: bool = False):
    """min over splits of the largest stage cost (and, on request, a minimiser's boundaries)."""
    P, N = cost_.shape[0], cost_.shape[1]
    best = cost_[0, 0].copy()
    choices = []
    columns = np.arange(N)
    for k in range(1, P):
        total = np.maximum(best[:, None], cost_[k])
        arg = np.argmin(total, axis=0)
        best = total[arg, columns]
        choices.append(arg)
    value = float(best[N - 1])
    if not with_bounds:
        return value
    bounds = [N - 1]
    for arg in reversed(choices):
        bounds.append(int(arg[bounds[-1]]))
    bounds.append(0)
    return value, bounds[::-1]


# -- candidates ---------------------------------------------------------------------------

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


class _Context:
    """Everything fixed for one planning problem, with caches of the per-group costs."""

    def __init__(self, model: ModelConfig, cluster: ClusterConfig, train: "TrainConfig",
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
    import torch

    from hetpipe.comm.vendor import accelerator_name

    if not torch.cuda.is_available():
        return "CPU"
    found = detect_device_type(accelerator_name(), catalog)
    if not found:
        raise ConfigError(f"group {group.name!r} has device_type=auto and this machine's "
                          f"{accelerator_name()!r} is not in the catalog: set the group's device_type "
                          "(add the device with planner.catalog if it is new)")
    return found


# -- the search ------------------------------------------------------------------------------

@dataclass
class StageReport:
    index: int
    group: str
    device_type: str
    ranks: list[int]
    tp: int
    dp: int
    layers: int
    units: tuple[int, int]
    # Per step: forward + backward (and recomputation) of all microbatches.
    compute_s: float
    # Per step, not overlapped with compute: TP collectives and the DP gradient sync + optimizer step.
    comm_s: float
    # Per step: this stage's boundary messages, overlapped with compute by the engine.
    p2p_s: float
    # Per step: the rest of the step time (pipeline fill, drain, waiting on the bottleneck).
    bubble_s: float
    memory_gib: float
    usable_gib: float
    tflops_per_gpu: float


@dataclass
class Solution:
    model: ModelConfig
    cluster: ClusterConfig
    candidate: Candidate
    split: Split
    stages: list[StageReport]
    step_s: float
    tflops_per_gpu: float
    tokens_per_s: float
    gpus_used: int
    group_order: list[str]
    cost_source: dict[str, str]
    # Catalog key of each group's devices (``auto`` resolved).
    device_types: dict[str, str]
    transport: str
    idle_ranks: list[int]
    global_batch_size: int
    seq_length: int
    # How many candidates the search solved exactly (the rest were pruned by their bound).
    candidates_solved: int = 0
    candidates_total: int = 0

    def to_plan(self) -> Plan:
        cand = self.candidate
        notes: dict[str, Any] = {
            "planner": "python -m hetpipe.plan",
            "micro_batch_size": cand.micro_batch_size,
            "num_microbatches": cand.num_microbatches,
            "global_batch_size": self.global_batch_size,
            "seq_length": self.seq_length,
            "group_order": list(self.group_order),
            "predicted_step_s": _round(self.step_s),
            "predicted_tflops_per_gpu": _round(self.tflops_per_gpu),
            "predicted_tokens_per_s": _round(self.tokens_per_s),
            "cost_source": dict(self.cost_source),
            "cross_vendor_transport": self.transport,
        }
        if list(self.group_order) != [g.name for g in self.cluster.groups if g.name in self.group_order]:
            notes["reordered"] = ("the pipeline visits the groups in group_order, not in the cluster's "
                                  "order; ranks keep the cluster's numbering")
        if self.idle_ranks:
            notes["idle_ranks"] = list(self.idle_ranks)
        plan = Plan(stages=[StagePlan(group=s.group, ranks=list(s.ranks), layers=s.layers, tp=s.tp, dp=s.dp)
                            for s in self.stages],
                    schedule="1f1b", num_chunks=1, recompute=cand.recompute, notes=notes)
        plan.check_model(self.model.num_layers)
        return plan


def solve(model: ModelConfig, cluster: ClusterConfig, train: "TrainConfig",
          planner: Optional[PlannerConfig] = None, layers: Optional[Sequence[int]] = None) -> Solution:
    """The plan with the least predicted step time that fits every device's memory.

    ``layers`` fixes the decoder layers per stage (e.g. ``[15, 17]``): the
    solver then only chooses the rest (groups' order and stages, TP, DP,
    microbatches, recompute) and predicts that split. Raises
    :class:`ConfigError` for impossible input, naming what does not fit.
    """
    planner = planner or PlannerConfig()
    if train.seq_length > model.max_position_embeddings:
        raise ConfigError(f"train.seq_length={train.seq_length} exceeds model {model.name!r}'s "
                          f"max_position_embeddings={model.max_position_embeddings}")
    ctx = _Context(model, cluster, train, planner)
    fixed = _fixed_bounds(model, cluster, layers)
    blocks = _enumerate(ctx, None if fixed is None else len(fixed) - 1)
    lbs = np.concatenate([b.lower_bounds for b in blocks])
    starts = np.cumsum([0] + [len(b.lower_bounds) for b in blocks])
    best: Optional[tuple[Candidate, Split]] = None
    solved = 0
    for pos in np.argsort(lbs, kind="stable"):
        if best is not None and lbs[pos] >= best[1].step_s:
            break
        bi = int(np.searchsorted(starts, pos, side="right")) - 1
        cand = blocks[bi].candidate(int(pos - starts[bi]))
        time, sync, feasible, _, _, links = ctx.problem(cand)
        solved += 1
        if fixed is None:
            split = best_split(time, sync, feasible, cand.num_microbatches, links)
        else:
            split = evaluate_split(time, sync, feasible, cand.num_microbatches, links, fixed)
        if split is not None and (best is None or split.step_s < best[1].step_s):
            best = (cand, split)
    if best is None:
        raise _no_fit_error(ctx, blocks, fixed)
    solution = _report(ctx, *best)
    solution.candidates_solved, solution.candidates_total = solved, len(lbs)
    return solution


def plan_for(model: ModelConfig, cluster: ClusterConfig, train: "TrainConfig",
             planner: Optional[PlannerConfig] = None, layers: Optional[Sequence[int]] = None) -> Plan:
    """The :class:`Plan` ``pretrain plan=auto`` runs: :func:`solve`'s best, as data."""
    return solve(model, cluster, train, planner, layers).to_plan()


@dataclass
class _Block:
    """Candidates that differ only in their stages per group, with their lower bounds."""
    order: tuple[int, ...]
    tp: tuple[int, ...]
    dp: int
    micro_batch_size: int
    recompute: bool
    num_microbatches: int
    stages: np.ndarray  # (n, G)
    lower_bounds: np.ndarray  # (n,)

    def candidate(self, row: int) -> Candidate:
        return Candidate(self.order, tuple(int(s) for s in self.stages[row]), self.tp, self.dp,
                         self.micro_batch_size, self.recompute, self.num_microbatches)


def _enumerate(ctx: _Context, num_stages: Optional[int]) -> list[_Block]:
    """Every candidate allowed by the cluster and the planner's constraints, in blocks."""
    train, planner = ctx.train, ctx.planner
    G, U = len(ctx.groups), ctx.num_units
    sizes = [g.size for g in ctx.groups]
    tp_options = _tp_options(ctx)
    mbs_options = list(planner.micro_batch_sizes or [train.micro_batch_size])
    for mbs in mbs_options:
        if mbs < 1 or train.global_batch_size % mbs:
            raise ConfigError(f"microbatch size {mbs} does not divide train.global_batch_size="
                              f"{train.global_batch_size}")
    recomputes = [planner.recompute] if planner.recompute is not None else [False, True]
    orders = _orders(ctx)
    fixed_stages = _fixed_stages(ctx, num_stages)
    max_stages = U - (G - 1)  # every group holds a stage, every stage a unit
    blocks = []
    for mbs in mbs_options:
        per_dp = train.global_batch_size // mbs
        dps = [planner.dp] if planner.dp is not None else [d for d in range(1, per_dp + 1) if per_dp % d == 0]
        if planner.dp is not None and per_dp % planner.dp:
            raise ConfigError(f"planner.dp={planner.dp} does not divide train.global_batch_size / microbatch "
                              f"size = {train.global_batch_size} / {mbs} = {per_dp} samples per microbatch slot")
        for dp in dps:
            M = per_dp // dp
            for tps in itertools.product(*tp_options):
                room = [sizes[g] // (tps[g] * dp) for g in range(G)]
                if min(room) < 1:
                    continue
                if fixed_stages is not None:
                    if any(fixed_stages[g] > room[g] for g in range(G)):
                        continue
                    grid = np.array([fixed_stages])
                else:
                    axes = [np.arange(1, min(room[g], max_stages) + 1) for g in range(G)]
                    grid = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, G)
                    total = grid.sum(axis=1)
                    grid = grid[(total <= U) if num_stages is None else (total == num_stages)]
                if not len(grid):
                    continue
                for rc in recomputes:
                    unit_times = [ctx.unit_costs(g, tps[g], mbs, rc, False).time_s for g in range(G)]
                    stage_lb, sum_lb = _balance_bounds(unit_times, grid)
                    for order in orders:
                        probe = Candidate(order, tuple(int(s) for s in grid[0]), tps, dp, mbs, rc, M)
                        cross = [ctx.link_s(probe, (a, 0), (b, 0)) for a, b in zip(order, order[1:])]
                        c_max, c_sum = max(cross, default=0.0), 2 * sum(cross)
                        lb = (M - 1) * np.maximum(stage_lb, c_max) + sum_lb + c_sum
                        blocks.append(_Block(order, tps, dp, mbs, rc, M, grid, lb))
    if not blocks:
        raise ConfigError(_no_layout_message(ctx, num_stages, fixed_stages))
    return blocks


def _balance_bounds(unit_times: list[np.ndarray], grid: np.ndarray) -> tuple[np.ndarray, float]:
    """Lower bounds on max_k t_k (per row of ``grid``) and on sum_k t_k.

    Measuring work in the first group's unit times w_u over any set S of
    units, a device of group g does at most v_g = max_{u in S} w_u / c_g(u) of
    it per second of its own time, so sum_k v_k t_k >= sum_{u in S} w_u and
    max_k t_k >= W_S / sum_k v_k. S is all units, and all but the memory-bound
    embedding (whose speed ratio differs from the matmuls'). Also no stage is
    faster than the most expensive unit on its best device.
    """
    costs = np.maximum(np.stack(unit_times), 1e-300)  # (G, U)
    cheapest = costs.min(axis=0)
    bound = np.full(len(grid), cheapest.max())
    for units in (slice(None), slice(1, None)):
        ref = costs[0, units]
        speed = np.max(ref[None, :] / costs[:, units], axis=1)  # (G,)
        bound = np.maximum(bound, ref.sum() / (grid @ speed))
    return bound, float(cheapest.sum())


def _tp_options(ctx: _Context) -> list[list[int]]:
    model, planner = ctx.model, ctx.planner
    heads, kv, ffn = model.num_attention_heads, model.num_query_groups, model.ffn_hidden_size
    if planner.tp is not None:
        t = planner.tp
        for what, value in (("num_attention_heads", heads), ("num_query_groups", kv), ("ffn_hidden_size", ffn)):
            if value % t:
                ok = [d for d in range(1, heads + 1) if heads % d == 0 and kv % d == 0 and ffn % d == 0]
                raise ConfigError(f"planner.tp={t} does not divide model.{what}={value} of {model.name!r} "
                                  f"(TP splits it evenly): {value} = {value // t} x {t} + {value % t}; "
                                  f"TP degrees that divide it: {ok}")
        for g in ctx.groups:
            if g.ranks_per_node % t:
                raise ConfigError(f"planner.tp={t} does not fit group {g.name!r}: its {g.ranks_per_node} "
                                  "ranks per node are not a multiple of it (a TP group stays within a node)")
        return [[t] for _ in ctx.groups]
    return [[t for t in range(1, g.ranks_per_node + 1)
             if g.ranks_per_node % t == 0 and heads % t == 0 and kv % t == 0 and ffn % t == 0]
            for g in ctx.groups]


def _orders(ctx: _Context) -> list[tuple[int, ...]]:
    order = ctx.planner.group_order
    if order is None:
        return list(itertools.permutations(range(len(ctx.groups))))
    if sorted(order) != sorted(ctx.names):
        raise ConfigError(f"planner.group_order={list(order)} must name each of the cluster's groups "
                          f"{ctx.names} once")
    return [tuple(ctx.names.index(n) for n in order)]


def _fixed_stages(ctx: _Context, num_stages: Optional[int]) -> Optional[list[int]]:
    stages = ctx.planner.stages
    if stages is None:
        if num_stages is not None and num_stages < len(ctx.groups):
            raise ConfigError(f"an explicit split of {num_stages} stage(s) cannot cover the cluster's "
                              f"{len(ctx.groups)} groups (each group holds at least one stage)")
        return None
    stages = list(stages)
    if len(stages) != len(ctx.groups) or min(stages) < 1:
        raise ConfigError(f"planner.stages={stages} needs one positive count per group {ctx.names}")
    if num_stages is not None and sum(stages) != num_stages:
        raise ConfigError(f"planner.stages={stages} makes {sum(stages)} stages but the explicit split has "
                          f"{num_stages}")
    if sum(stages) > ctx.num_units:
        raise ConfigError(f"planner.stages={stages} makes {sum(stages)} stages for {ctx.num_units} model units")
    return stages


def _fixed_bounds(model: ModelConfig, cluster: ClusterConfig, layers: Optional[Sequence[int]]):
    """Unit boundaries of an explicit split of the decoder layers."""
    if layers is None:
        return None
    layers = [int(n) for n in layers]
    if not layers:
        raise ConfigError("an explicit split needs at least one stage")
    Plan(stages=[StagePlan(group="", ranks=[], layers=n) for n in layers]).check_model(model.num_layers)
    bounds = [0]
    for k, n in enumerate(layers):
        bounds.append(bounds[-1] + n + (k == 0) + (k == len(layers) - 1))
    return bounds


def _no_layout_message(ctx: _Context, num_stages: Optional[int], fixed_stages) -> str:
    p = ctx.planner
    sizes = ", ".join(f"{g.name}: {g.size}" for g in ctx.groups)
    wanted = []
    if p.tp is not None:
        wanted.append(f"TP {p.tp}")
    if p.dp is not None:
        wanted.append(f"DP {p.dp}")
    if fixed_stages is not None:
        wanted.append(f"stages per group {fixed_stages}")
    if num_stages is not None:
        wanted.append(f"{num_stages} stages")
    return (f"no parallel layout of cluster {ctx.cluster.name!r} ({sizes} ranks) satisfies "
            f"{', '.join(wanted) or 'the constraints'}: every group needs at least one stage of TP x DP "
            f"ranks, and DP must divide train.global_batch_size / micro_batch_size = "
            f"{ctx.train.global_batch_size} / {ctx.train.micro_batch_size}")


def _no_fit_error(ctx: _Context, blocks: list[_Block], fixed: Optional[list[int]],
                  limit: int = 5000) -> ConfigError:
    """Why nothing fits: the least memory-hungry plan tried, its fullest device, and by how much.

    Tries the candidates that need the least memory - recomputation if it is
    allowed, the smallest microbatch - with the most devices first, up to
    ``limit`` of them (an error path need not be exhaustive to be useful).
    """
    least_mbs = min(b.micro_batch_size for b in blocks)
    most_rc = max(b.recompute for b in blocks)
    lean = [(b, r) for b in blocks if b.micro_batch_size == least_mbs and b.recompute == most_rc
            for r in range(len(b.stages))]
    lean.sort(key=lambda br: -sum(int(s) * t for s, t in zip(br[0].stages[br[1]], br[0].tp)) * br[0].dp)
    best = None
    for block, r in lean[:limit]:
        cand = block.candidate(r)
        _, _, _, memory, capacity, _ = ctx.problem(cand)
        ratio = memory / capacity[:, None, None]
        N = ratio.shape[1]
        ratio = np.where(np.triu(np.ones((N, N), dtype=bool), 1), ratio, INF)
        if fixed is None:
            value, bounds = _minimax(ratio, with_bounds=True)
        else:
            bounds = fixed
            value = max(ratio[k, bounds[k], bounds[k + 1]] for k in range(len(bounds) - 1))
        if best is None or value < best[0]:
            best = (value, cand, bounds, memory, capacity)
    value, cand, bounds, memory, capacity = best
    layout = cand.layout()
    k = max(range(len(layout)), key=lambda s: memory[s, bounds[s], bounds[s + 1]] / capacity[s])
    g = layout[k][0]
    spec, i, j = ctx.specs[g], bounds[k], bounds[k + 1]
    need, usable = memory[k, i, j] / cost.GIB, capacity[k] / cost.GIB
    layers = (j - i) - (i == 0) - (j == ctx.num_units)
    extras = (" + embedding" if i == 0 else "") + (" + head" if j == ctx.num_units else "")
    which = "the split partition.layers" if fixed is not None else "any plan"
    hints = []
    if not ctx.planner.distributed_optimizer and max(b.dp for b in blocks) > 1:
        hints.append("planner.distributed_optimizer=true shards Adam's state over DP")
    if ctx.planner.recompute is False:
        hints.append("planner.recompute=null lets the solver recompute activations")
    return ConfigError(
        f"{ctx.model.name} does not fit on cluster {ctx.cluster.name!r} under {which}: even the least "
        f"memory-hungry plan ({cand.describe(ctx.names)}) needs {need:.1f} GiB on each {spec.name} of group "
        f"{ctx.names[g]!r} (stage {k}: {layers} layers{extras}), but the {spec.name} has {usable:.1f} GiB usable "
        f"({spec.memory_gib:g} GiB x memory_headroom {ctx.planner.memory_headroom:g}): short by "
        f"{need - usable:.1f} GiB" + (f" ({'; '.join(hints)})" if hints else ""))


def _report(ctx: _Context, cand: Candidate, split: Split) -> Solution:
    """The chosen plan, stage by stage, with its predicted time and memory."""
    time, sync, feasible, memory, capacity, links = ctx.problem(cand)
    layout = cand.layout()
    P, M, T = len(layout), cand.num_microbatches, split.step_s
    alone = P == 1
    stages, used = [], set()
    for k, (g, j) in enumerate(layout):
        i, jj = split.bounds[k], split.bounds[k + 1]
        uc = ctx.unit_costs(g, cand.tp[g], cand.micro_batch_size, cand.recompute, alone)
        n = cand.tp[g] * cand.dp
        ranks = [ctx.starts[g] + j * n + r for r in range(n)]
        used.update(ranks)
        compute = M * float((uc.forward_s[i:jj] + uc.backward_s[i:jj]).sum())
        comm = M * float(uc.tp_comm_s[i:jj].sum()) + float(sync[k, i, jj])
        boundary = (links[k - 1] if k > 0 else 0.0) + (links[k] if k < P - 1 else 0.0)
        stages.append(StageReport(
            index=k, group=ctx.names[g], device_type=ctx.specs[g].name, ranks=ranks, tp=cand.tp[g], dp=cand.dp,
            layers=(jj - i) - (i == 0) - (jj == ctx.num_units), units=(i, jj), compute_s=compute, comm_s=comm,
            p2p_s=2 * M * boundary, bubble_s=max(0.0, T - compute - comm),
            memory_gib=float(memory[k, i, jj]) / cost.GIB, usable_gib=float(capacity[k]) / cost.GIB,
            tflops_per_gpu=M * float(uc.flops[i:jj].sum()) / T / 1e12))
    gbs, seq = ctx.train.global_batch_size, ctx.train.seq_length
    world = ctx.cluster.world_size
    return Solution(
        model=ctx.model, cluster=ctx.cluster, candidate=cand, split=split, stages=stages, step_s=T,
        tflops_per_gpu=megatron_model_flops(ctx.model, gbs, seq) / T / len(used) / 1e12,
        tokens_per_s=gbs * seq / T, gpus_used=len(used), group_order=[ctx.names[g] for g in cand.order],
        cost_source=dict(ctx.cost_source), device_types=dict(zip(ctx.names, ctx.device_types)),
        transport=ctx.transport,
        idle_ranks=[r for r in range(world) if r not in used], global_batch_size=gbs, seq_length=seq)


def _round(x: float) -> float:
    return float(f"{x:.4g}")
