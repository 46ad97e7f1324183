"""The plan search: which stages, where, at which parallelism, under every device's memory.

For a cluster of vendor groups the solver chooses the order of the groups
along the pipeline, the number of pipeline stages each group hosts, TP per
group (within a node, dividing the heads), one DP degree for all stages
(Megatron's constraint) and the microbatch size (hence the microbatch count)
- and, for each such *candidate*, the contiguous split of the model units
(embedding and head included) over the stages, which
:mod:`hetpipe.partitioner.split` solves exactly for the predicted step time
of a pipeline schedule (:mod:`hetpipe.partitioner.schedule_model`), each
stage running the cheapest activation recomputation that fits its
devices (:mod:`hetpipe.partitioner.cost_context`). Candidates are solved
best-first by a lower bound on their step (:mod:`hetpipe.partitioner.candidate_bounds`:
each term of the step at its least over splits, from per-group tables, with
no split problem built) and the search stops when the bound passes the best
plan found; of equally fast candidates the plan is the first by a cruder
balance bound (perfect balance at the candidate's aggregate speed), the
order the search once solved them in (:func:`_search`).
With ``planner.schedule=auto`` the search runs once per schedule (each
schedule changes the memory every stage needs, so the candidates that fit,
and its own bounds) and the fastest plan wins; the others are reported
beside it. zb_v's ranks hold two unit ranges each, which
:mod:`hetpipe.partitioner.v_split` prices by simulating the schedule and
searches locally from two starting splits (:mod:`hetpipe.partitioner.v_search`).
:mod:`hetpipe.partitioner.cost_context` prices each candidate and
:mod:`hetpipe.partitioner.report` describes the winner.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from hetpipe.pipeline.microbatches import microbatches_per_step
from hetpipe.devices.cluster import ClusterConfig
from hetpipe.errors import ConfigError
from hetpipe.models.model_config import ModelConfig
# Siblings by their own path, not through the package, whose __init__ imports the solver.
import hetpipe.partitioner.context_plan as context_plan
import hetpipe.partitioner.cost as cost
import hetpipe.partitioner.schedule_model as schedule_model
import hetpipe.partitioner.v_search as v_search
import hetpipe.partitioner.v_split as v_split
from hetpipe.partitioner.candidate_bounds import ContiguousBounds, less_slack
from hetpipe.partitioner.cost_context import Candidate, CostContext
from hetpipe.partitioner.inputs import TrainShape
from hetpipe.partitioner.plan_data import Plan, StagePlan, unit_bounds
from hetpipe.partitioner.planner_config import PlannerConfig
from hetpipe.partitioner.report import ScheduleOption, Solution, build_solution
from hetpipe.partitioner.split import INF, Split, best_split, evaluate_split, minimax


def solve(model: ModelConfig, cluster: ClusterConfig, train: TrainShape,
          planner: Optional[PlannerConfig] = None, layers: Optional[Sequence[int]] = None,
          cp: Optional[int] = None, cp_method: str = "allgather", beat: float = INF) -> Optional[Solution]:
    """The plan with the least predicted step time that fits every device's memory.

    ``layers`` fixes the decoder layers per (virtual) stage (e.g. ``[15, 17]``):
    the solver then only chooses the rest (groups' order and stages, TP, DP,
    microbatches, recomputation per stage, the schedule) and predicts that
    split; under zb_v 2P entries make P ranks (``auto`` leaves out a schedule
    the split gives no layout under: zb_v for an odd count, or for [15, 17]
    on two groups). The solution's ``schedule_options`` hold the best plan's step
    under every schedule considered. Raises
    :class:`ConfigError` for impossible input, naming what does not fit.
    ``cp`` prices one context-parallel degree; None searches them
    (partitioner/context_plan.py), priced for ``cp_method``'s attention;
    with ``beat`` only a plan faster than it is searched for (None: none is).
    """
    planner = planner or PlannerConfig()
    if cp is None:
        return context_plan.fastest_over_cp(lambda c, b: solve(model, cluster, train, planner, layers, c, cp_method, b),
                                            cluster, train.seq_length, planner.cp)
    if train.seq_length > model.max_position_embeddings:
        raise ConfigError(f"train.seq_length={train.seq_length} exceeds model {model.name!r}'s "
                          f"max_position_embeddings={model.max_position_embeddings}")
    ctx = CostContext(model, cluster, train, planner, cp, cp_method)
    fixed = _fixed_bounds(model, cluster, layers)
    found: list[Solution] = []
    options: list[ScheduleOption] = []
    solved = total = 0
    lean: Optional[tuple[list[_Block], str]] = None
    no_layout: list[ConfigError] = []
    memo: dict = {}
    tables = ContiguousBounds(ctx)
    for schedule in schedule_model.schedules_for(planner.schedule, planner.recompute):
        num_stages = _num_stages(planner, fixed, schedule)
        if num_stages == 0:
            continue  # an odd number of virtual stages has no V
        try:
            blocks = _enumerate(ctx, num_stages, schedule, memo)
        except ConfigError as exc:
            # Under auto a schedule the cluster cannot lay out is left out: a
            # fixed [15, 17] is one zb_v rank, which cannot cover two groups.
            if planner.schedule != "auto":
                raise
            no_layout.append(exc)
            continue
        lean = lean or (blocks, schedule)  # the first schedule keeps the fewest microbatches
        if schedule_model.is_v_shaped(schedule):
            best, count = v_search.search(schedule, ctx, blocks, fixed, beat=beat)
        else:
            best, count = _search(ctx, blocks, fixed, schedule, tables, beat)
        if best is not None and best[1].step_s >= beat:
            best = None  # no faster than the plan of a CP degree already solved
        solved, total = solved + count, total + sum(len(b.lower_bounds) for b in blocks)
        if best is None:
            options.append(ScheduleOption(schedule, None))
            continue
        found.append(build_solution(ctx, *best, schedule))
        options.append(ScheduleOption.of(found[-1]))
    if not found and beat < INF:
        return None  # nothing beats the plan already found
    if not found:
        raise _no_fit_error(ctx, *lean, fixed) if lean is not None else no_layout[0]
    # Ties go to the schedule listed first (PLANNED_SCHEDULES: least memory
    # first), within rounding: on one pipeline rank zb_v's step summed to 1
    # ulp below 1F1B's equal one and auto put both chunks on that rank.
    fastest = min(s.step_s for s in found)
    # abs(): a noisy measured profile can price a step below zero, where fastest * (1 + 1e-9)
    # lies below fastest and nothing would be chosen.
    solution = next(s for s in found if s.step_s <= fastest + abs(fastest) * 1e-9)
    solution.schedule_options = options
    solution.candidates_solved, solution.candidates_total = solved, total
    return solution


def _search(ctx: CostContext, blocks: list["_Block"], fixed: Optional[list[int]], schedule: str,
            tables: Optional[ContiguousBounds] = None, beat: float = INF) -> tuple[Optional[tuple[Candidate, Split]], int]:
    """The best (candidate, split) of ``blocks`` under ``schedule``, or None if
    nothing fits, and how many candidates were solved (``tables``: the
    tighter bounds' tables, kept across schedules). Only a step below ``beat``
    is searched for.

    The plan is the fastest candidate's best split; of equally fast ones, the
    first by the balance bound (``lower_bounds``, stable sort): the order the
    search once solved them in. They are solved by their tightest bound
    instead, which meets the fastest sooner and stops sooner (a candidate
    whose bound reaches the best step cannot beat it); ties are kept by
    comparing (step, that rank).
    """
    lbs = np.concatenate([b.lower_bounds for b in blocks])
    rank = np.empty(len(lbs), dtype=int)
    rank[np.argsort(lbs, kind="stable")] = np.arange(len(lbs))
    queue = _BestFirst(blocks, lbs, rank, tables or ContiguousBounds(ctx), schedule)
    best: Optional[tuple[Candidate, Split]] = None
    key = (beat, INF)  # (step, rank) of the best; a step equal to beat is dropped by the caller
    solved = 0
    while (item := queue.pop(key[0])) is not None and item[:2] <= key:
        cand = queue.candidate(item[2])
        solved += 1
        # A split as fast as the best still wins if its candidate ranks first.
        bar = key[0] if item[1] > key[1] else float(np.nextafter(key[0], INF))
        split = _split(ctx, cand, schedule, fixed, bar)
        if split is not None and (split.step_s, item[1]) < key:
            best, key = (cand, split), (split.step_s, item[1])
    return best, solved


class _BestFirst:
    """The candidates of ``blocks`` by (tightest lower bound, rank). A block's
    tighter bounds (candidate_bounds.py) are computed only once the queue
    reaches the least of its balance bounds, which lie below them; the block's
    candidates are then sorted, and only its next one waits in the heap."""

    def __init__(self, blocks: list["_Block"], lbs: np.ndarray, rank: np.ndarray, tables: ContiguousBounds,
                 schedule: str) -> None:
        self.blocks, self.rank, self.tables, self.schedule = blocks, rank, tables, schedule
        self.starts = np.cumsum([0] + [len(b.lower_bounds) for b in blocks])
        self.floor = less_slack(lbs)
        self.block_floor = np.minimum.reduceat(self.floor, self.starts[:-1])
        self.waiting = list(np.argsort(self.block_floor, kind="stable")[::-1])  # the next one last
        self.heap: list[tuple[float, int, int, int]] = []  # (bound, rank, block, index into its queue)
        self.queues: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # block -> (bounds, positions), sorted

    def pop(self, best: float) -> Optional[tuple[float, int, int]]:
        """The next (bound, rank, position) of a candidate whose bound does not
        pass ``best`` (the best step so far), or None."""
        while self.waiting and self.block_floor[self.waiting[-1]] <= min(best, self.heap[0][0] if self.heap else INF):
            self._load(self.waiting.pop(), best)
        if not self.heap:
            return None
        bound, rank, bi, at = heapq.heappop(self.heap)
        self._push(bi, at + 1)
        return bound, rank, int(self.queues[bi][1][at])

    def candidate(self, pos: int) -> Candidate:
        bi = int(np.searchsorted(self.starts, pos, side="right")) - 1
        return self.blocks[bi].candidate(int(pos - self.starts[bi]))

    def _load(self, bi: int, best: float) -> None:
        """Sort block ``bi``'s candidates whose bounds do not pass ``best``, and queue the first."""
        start = self.starts[bi]
        rows = np.flatnonzero(self.floor[start:self.starts[bi + 1]] <= best)
        bounds = np.maximum(self.floor[start + rows], less_slack(self._tighter(self.blocks[bi], rows)))
        keep = bounds <= best
        positions, bounds = start + rows[keep], bounds[keep]
        order = np.lexsort((self.rank[positions], bounds))
        self.queues[bi] = (bounds[order], positions[order])
        self._push(bi, 0)

    def _push(self, bi: int, at: int) -> None:
        bounds, positions = self.queues[bi]
        if at < len(bounds):
            heapq.heappush(self.heap, (float(bounds[at]), int(self.rank[positions[at]]), bi, at))

    def _tighter(self, b: "_Block", rows: np.ndarray) -> np.ndarray:
        """The tighter bounds of ``rows`` of block ``b`` (-inf where it has none)."""
        if b.c_max is None:
            return np.full(len(rows), -INF)
        return self.tables.block(self.schedule, b, rows)


def _split(ctx: CostContext, cand: Candidate, schedule: str, fixed: Optional[list[int]],
           beat: float) -> Optional[Split]:
    """The candidate's best contiguous split (or the fixed one, priced), or None;
    where that split is no faster than ``beat``, maybe another such or None
    (the search keeps only a faster one: its split walks stop at ``beat``)."""
    prob = ctx.problem(cand, schedule)
    if fixed is None:
        return best_split(prob.time, prob.sync, prob.feasible, cand.num_microbatches, prob.links, prob.path, beat)
    return evaluate_split(prob.time, prob.sync, prob.feasible, cand.num_microbatches, prob.links, fixed, prob.path)


def _num_stages(planner: PlannerConfig, fixed: Optional[list[int]], schedule: str) -> Optional[int]:
    """Pipeline ranks a fixed split of virtual stages makes under ``schedule``
    (None: no fixed split). 0: under zb_v, which ``planner.schedule=auto`` then
    leaves out, an odd count, or one that ``planner.stages`` contradicts."""
    if fixed is None:
        return None
    virtual = len(fixed) - 1
    if not schedule_model.is_v_shaped(schedule):
        return virtual
    stages = planner.stages
    if planner.schedule != schedule and (virtual % 2 or (stages is not None and sum(stages) != virtual // 2)):
        return 0
    if virtual % 2:
        raise ConfigError(f"planner.schedule={schedule} places two virtual stages per rank, but the split "
                          f"partition.layers has {virtual}: give an even number (stages 0..2P-1 of the V)")
    return virtual // 2


def plan_for(model: ModelConfig, cluster: ClusterConfig, train: TrainShape,
             planner: Optional[PlannerConfig] = None, layers: Optional[Sequence[int]] = None,
             cp_method: str = "allgather") -> Plan:
    """The :class:`Plan` ``pretrain plan=auto`` runs: :func:`solve`'s best, as data."""
    return solve(model, cluster, train, planner, layers, cp_method=cp_method).to_plan()


@dataclass
class _Block:
    """Candidates that differ only in their stages per group, with their lower bounds."""
    order: tuple[int, ...]
    tp: tuple[int, ...]
    dp: int
    micro_batch_size: int
    num_microbatches: int
    stages: np.ndarray  # (n, G)
    # The search's order (best first) and where it stops (lower bounds).
    lower_bounds: np.ndarray  # (n,)
    # Contiguous schedules: per row, the largest message and twice their sum,
    # for the tighter bounds the search takes (candidate_bounds.py).
    c_max: Optional[np.ndarray] = None
    c_sum: Optional[np.ndarray] = None

    def candidate(self, row: int) -> Candidate:
        return Candidate(self.order, tuple(int(s) for s in self.stages[row]), self.tp, self.dp,
                         self.micro_batch_size, self.num_microbatches)


def _enumerate(ctx: CostContext, num_stages: Optional[int], schedule: str,
               memo: Optional[dict] = None) -> list[_Block]:
    """Every candidate allowed by the cluster and the planner's constraints, in
    blocks, with lower bounds on its step under ``schedule``. ``memo`` keeps
    what does not depend on the schedule (stage counts, unit costs, messages)
    for the next schedule's enumeration."""
    memo = {} if memo is None else memo
    tp_options = _tp_options(ctx)
    shapes = _batch_shapes(ctx)
    orders = _orders(ctx)
    fixed_stages = _fixed_stages(ctx, num_stages)
    # Every group holds a stage, every (virtual) stage a unit; a V rank holds two.
    limit = ctx.num_units // 2 if schedule_model.is_v_shaped(schedule) else ctx.num_units
    blocks = []
    for mbs, dps in shapes:
        for dp in dps:
            M = microbatches_per_step(ctx.train.global_batch_size, mbs, dp)
            for tps in itertools.product(*tp_options):
                key = ("layouts", tps, dp, mbs, limit, num_stages)
                if key not in memo:
                    memo[key] = _layouts(ctx, tps, dp, mbs, limit, num_stages, fixed_stages)
                if memo[key] is not None:
                    blocks += _order_blocks(ctx, memo, memo[key], orders, schedule, M)
    if not blocks:
        raise ConfigError(_no_layout_message(ctx, num_stages, fixed_stages))
    return blocks


def _batch_shapes(ctx: CostContext) -> list[tuple[int, list[int]]]:
    """Each microbatch size the search tries, with the DP degrees that divide its microbatch slots."""
    train, planner = ctx.train, ctx.planner
    mbs_options = list(planner.micro_batch_sizes or [train.micro_batch_size])
    for mbs in mbs_options:
        if mbs < 1 or train.global_batch_size % mbs:
            raise ConfigError(f"microbatch size {mbs} does not divide train.global_batch_size="
                              f"{train.global_batch_size}")
    return [(mbs, _dps(ctx, mbs)) for mbs in mbs_options]


def _dps(ctx: CostContext, mbs: int) -> list[int]:
    """DP degrees for microbatch size ``mbs``: ``planner.dp``, or every divisor of the microbatch slots."""
    train, planner = ctx.train, ctx.planner
    per_dp = train.global_batch_size // mbs
    if planner.dp is not None and per_dp % planner.dp:
        raise ConfigError(f"planner.dp={planner.dp} does not divide train.global_batch_size / microbatch "
                          f"size = {train.global_batch_size} / {mbs} = {per_dp} samples per microbatch slot")
    return [planner.dp] if planner.dp is not None else [d for d in range(1, per_dp + 1) if per_dp % d == 0]


@dataclass
class _Layouts:
    """The stage counts per group that one (TP per group, DP, microbatch size)
    allows, and what bounds their steps whatever the group order."""
    tps: tuple[int, ...]
    dp: int
    mbs: int
    grid: np.ndarray  # (n, G): stages per group, cluster order
    units: list[cost.UnitCosts]  # per group, at the bound's recomputation
    stage_lb: np.ndarray  # (n,): below the slowest stage
    unit_sum: float  # below the sum of the stages
    in_max: np.ndarray  # (n,): the largest message inside a group
    in_sum: np.ndarray  # (n,): twice the messages inside groups


def _layouts(ctx: CostContext, tps: tuple[int, ...], dp: int, mbs: int, limit: int, num_stages: Optional[int],
             fixed_stages: Optional[list[int]]) -> Optional[_Layouts]:
    """The stage counts of ``tps``, ``dp`` and ``mbs`` and their bounds, or None if there are none."""
    grid = _grid(ctx, tps, dp, limit, num_stages, fixed_stages)
    if grid is None or not len(grid):
        return None
    # Recomputation only adds time, so the bound takes a stage's units at their
    # cheapest: without it, unless one mode is imposed on every stage.
    mode = ctx.recompute_modes[0] if len(ctx.recompute_modes) == 1 else "none"
    units = [ctx.unit_costs(g, tps[g], mbs, mode, False) for g in range(len(ctx.groups))]
    stage_lb, unit_sum = _balance_bounds([u.time_s for u in units], grid)
    probe = Candidate(tuple(range(len(ctx.groups))), tuple(int(s) for s in grid[0]), tps, dp, mbs, 1)
    in_max, in_sum = _inner_links(ctx, probe, grid)
    return _Layouts(tps, dp, mbs, grid, units, stage_lb, unit_sum, in_max, in_sum)


def _grid(ctx: CostContext, tps: tuple[int, ...], dp: int, limit: int, num_stages: Optional[int],
          fixed_stages: Optional[list[int]]) -> Optional[np.ndarray]:
    """(n, G) stages per group that fit each group's ranks at ``tps`` and ``dp``, or None."""
    G = len(ctx.groups)
    room = [ctx.groups[g].size // (tps[g] * dp * ctx.cp) for g in range(G)]
    if min(room) < 1:
        return None
    if fixed_stages is not None:
        return None if any(fixed_stages[g] > room[g] for g in range(G)) else np.array([fixed_stages])
    axes = [np.arange(1, min(room[g], limit - (G - 1)) + 1) for g in range(G)]
    grid = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, G)
    total = grid.sum(axis=1)
    return grid[(total <= limit) if num_stages is None else (total == num_stages)]


def _order_blocks(ctx: CostContext, memo: dict, lay: _Layouts, orders: list[tuple[int, ...]], schedule: str,
                  M: int) -> list[_Block]:
    """One block per group order of ``lay``'s candidates under ``schedule``, with their bounds."""
    sum_lb = _path_bound(ctx, memo, lay, schedule)
    blocks = []
    for order in orders:
        probe = Candidate(order, tuple(int(s) for s in lay.grid[0]), lay.tps, lay.dp, lay.mbs, M)
        cross = [ctx.link_s(probe, (a, 0), (b, 0)) for a, b in zip(order, order[1:])]
        c_max, c_sum = np.maximum(max(cross, default=0.0), lay.in_max), 2 * sum(cross) + lay.in_sum
        if schedule_model.is_v_shaped(schedule):  # simulated: only the busiest rank's work bounds it
            blocks.append(_Block(order, lay.tps, lay.dp, lay.mbs, M, lay.grid, M * lay.stage_lb))
            continue
        lb = (M - 1) * np.maximum(lay.stage_lb, c_max) + sum_lb + c_sum
        blocks.append(_Block(order, lay.tps, lay.dp, lay.mbs, M, lay.grid, lb, c_max, c_sum))
    return blocks


def _path_bound(ctx: CostContext, memo: dict, lay: _Layouts, schedule: str) -> float:
    """A lower bound on sum_k p_k of ``lay``'s candidates under ``schedule`` (zero bubble: less the W credit)."""
    credit = schedule_model.max_weight_credit(schedule)
    if credit is None:
        return lay.unit_sum
    key = ("path", lay.tps, lay.mbs, credit)
    if key not in memo:
        memo[key] = _zero_bubble_path_bound(ctx, lay.units, lay.mbs, credit)
    return memo[key]


def _inner_links(ctx: CostContext, probe: Candidate, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``grid``: the largest message between two stages of one group,
    and twice their sum, as the step counts them (split.step_time_s). A
    boundary's message depends on its group, its place in the group, TP, DP and
    the microbatch, not on the row, so each row's are exactly these: a deep
    pipeline's bound grows with its boundaries."""
    most, total = np.zeros(len(grid)), np.zeros(len(grid))
    for g in range(grid.shape[1]):
        links = [ctx.link_s(probe, (g, j), (g, j + 1)) for j in range(int(grid[:, g].max()) - 1)]
        before = grid[:, g] - 1  # boundaries inside group g
        most = np.maximum(most, np.concatenate([[0.0], np.maximum.accumulate(links)])[before])
        total += 2 * np.concatenate([[0.0], np.cumsum(links)])[before]
    return most, total


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


def _zero_bubble_path_bound(ctx: CostContext, units: list[cost.UnitCosts], mbs: int, credit: float) -> float:
    """A lower bound on a zero-bubble schedule's sum_k p_k: a unit off the first
    stage gives back at most 2 credit w (credit: the schedule's largest
    weight_credit); the embedding never leaves it."""
    paths = []
    for u in units:
        w = schedule_model.weight_backward_s(ctx.model, mbs, ctx.train.seq_length, u.forward_s, u.backward_s)
        path = u.time_s - 2 * credit * w
        path[0] = u.time_s[0]
        paths.append(path)
    return float(np.min(np.stack(paths), axis=0).sum())


def _tp_options(ctx: CostContext) -> list[list[int]]:
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


def _orders(ctx: CostContext) -> list[tuple[int, ...]]:
    order = ctx.planner.group_order
    if order is None:
        return list(itertools.permutations(range(len(ctx.groups))))
    if sorted(order) != sorted(ctx.names):
        raise ConfigError(f"planner.group_order={list(order)} must name each of the cluster's groups "
                          f"{ctx.names} once")
    return [tuple(ctx.names.index(n) for n in order)]


def _fixed_stages(ctx: CostContext, num_stages: Optional[int]) -> Optional[list[int]]:
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
    return unit_bounds(layers)


def _no_layout_message(ctx: CostContext, num_stages: Optional[int], fixed_stages) -> str:
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


def _fullest(ctx: CostContext, cand: Candidate, schedule: str, fixed: Optional[list[int]]):
    """The contiguous split whose fullest device is least full, as
    (fullness, stage, its unit ranges, GiB needed, GiB usable)."""
    prob = ctx.problem(cand, schedule)
    memory, capacity = prob.memory, prob.capacity
    ratio = memory / capacity[:, None, None]
    N = ratio.shape[1]
    ratio = np.where(np.triu(np.ones((N, N), dtype=bool), 1), ratio, INF)
    if fixed is None:
        value, bounds = minimax(ratio, with_bounds=True)
    else:
        bounds = fixed
        value = max(ratio[k, bounds[k], bounds[k + 1]] for k in range(len(bounds) - 1))
    k = max(range(len(bounds) - 1), key=lambda s: ratio[s, bounds[s], bounds[s + 1]])
    i, j = bounds[k], bounds[k + 1]
    return [(value, k, [(i, j)], memory[k, i, j] / cost.GIB, capacity[k] / cost.GIB)]


def _v_fullest(schedule: str, ctx: CostContext, cand: Candidate, fixed: Optional[list[int]]):
    """As :func:`_fullest`, for zb_v's starting splits (or the fixed one)."""
    found = []
    for cuts in ([fixed] if fixed is not None else v_split.starts(schedule, ctx, cand)):
        ranks = v_split.price(schedule, ctx, cand, cuts)
        k = max(range(len(ranks)), key=lambda s: ranks[s].memory / ranks[s].capacity)
        r = ranks[k]
        found.append((r.memory / r.capacity, k, list(r.ranges), r.memory / cost.GIB, r.capacity / cost.GIB))
    return found


def _no_fit_error(ctx: CostContext, blocks: list[_Block], schedule: str, fixed: Optional[list[int]],
                  limit: int = 5000) -> ConfigError:
    """Why nothing fits: the least memory-hungry plan tried, its fullest device, and by how much.

    Tries the candidates that need the least memory - the smallest microbatch,
    each stage at its leanest recomputation - with the most devices first, up
    to ``limit`` of them (an error path need not be exhaustive to be useful).
    """
    least_mbs = min(b.micro_batch_size for b in blocks)
    lean = [(b, r) for b in blocks if b.micro_batch_size == least_mbs for r in range(len(b.stages))]
    lean.sort(key=lambda br: -sum(int(s) * t for s, t in zip(br[0].stages[br[1]], br[0].tp)) * br[0].dp)
    best = None
    v_shaped = schedule_model.is_v_shaped(schedule)
    # A V candidate is priced start by start in Python, not as one matrix: fewer of them.
    for block, r in lean[:limit // 25 if v_shaped else limit]:
        cand = block.candidate(r)
        for value, k, ranges, need, usable in (_v_fullest(schedule, ctx, cand, fixed) if v_shaped else
                                               _fullest(ctx, cand, schedule, fixed)):
            if best is None or value < best[0]:
                best = (value, cand, k, ranges, need, usable)
    value, cand, k, ranges, need, usable = best
    g = cand.layout()[k][0]
    spec = ctx.specs[g]
    layers = sum(int(ctx.range_layers[i, j]) for i, j in ranges)
    extras = (" + embedding" if min(i for i, _ in ranges) == 0 else "") + \
        (" + head" if max(j for _, j in ranges) == ctx.num_units else "")
    which = "the split partition.layers" if fixed is not None else "any plan"
    hints = []
    if not ctx.planner.distributed_optimizer and max(b.dp for b in blocks) > 1:
        hints.append("planner.distributed_optimizer=true shards Adam's state over DP")
    if "full" not in ctx.recompute_modes and not ctx.train.compile:
        hints.append("planner.recompute=auto lets the solver recompute activations")
    # In RECOMPUTE_MODES' order: the last one the schedule allows keeps least.
    leanest = schedule_model.recompute_modes(schedule, ctx.recompute_modes)[-1]
    return ConfigError(
        f"{ctx.model.name} does not fit on cluster {ctx.cluster.name!r} under {which}: even the least "
        f"memory-hungry plan ({cand.describe(ctx.names)}, recompute {leanest}) needs {need:.1f} GiB on each "
        f"{spec.name} of group "
        f"{ctx.names[g]!r} (stage {k}: {layers} layers{extras}), but the {spec.name} has {usable:.1f} GiB usable "
        f"({ctx.memory_gib(g):g} GiB x memory_headroom {ctx.planner.memory_headroom:g}): short by "
        f"{need - usable:.1f} GiB" + (f" ({'; '.join(hints)})" if hints else ""))
