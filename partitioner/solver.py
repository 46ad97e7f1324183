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
order the search once solved them in (:func:`_search`; the candidates and
that bound: :mod:`hetpipe.partitioner.candidates`).
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
from typing import Optional, Sequence

import numpy as np

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
from hetpipe.partitioner.candidates import Block, enumerate_blocks


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
    lean: Optional[tuple[list[Block], str]] = None
    no_layout: list[ConfigError] = []
    memo: dict = {}
    tables = ContiguousBounds(ctx)
    for schedule in schedule_model.schedules_for(planner.schedule, planner.recompute):
        num_stages = _num_stages(planner, fixed, schedule)
        if num_stages == 0:
            continue  # an odd number of virtual stages has no V
        try:
            blocks = enumerate_blocks(ctx, num_stages, schedule, memo)
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


def _search(ctx: CostContext, blocks: list["Block"], fixed: Optional[list[int]], schedule: str,
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

    def __init__(self, blocks: list["Block"], lbs: np.ndarray, rank: np.ndarray, tables: ContiguousBounds,
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

    def _tighter(self, b: "Block", rows: np.ndarray) -> np.ndarray:
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


def _fixed_bounds(model: ModelConfig, cluster: ClusterConfig, layers: Optional[Sequence[int]]):
    """Unit boundaries of an explicit split of the decoder layers."""
    if layers is None:
        return None
    layers = [int(n) for n in layers]
    if not layers:
        raise ConfigError("an explicit split needs at least one stage")
    Plan(stages=[StagePlan(group="", ranks=[], layers=n) for n in layers]).check_model(model.num_layers)
    return unit_bounds(layers)


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


def _no_fit_error(ctx: CostContext, blocks: list[Block], schedule: str, fixed: Optional[list[int]],
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
