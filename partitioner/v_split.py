"""ZB-V's split: two unit ranges per rank, priced by running the schedule.

Under ``zb_v`` rank r holds virtual stages r and 2P - 1 - r
(:mod:`hetpipe.pipeline.placement`): with virtual-stage boundaries
``c_0 = 0 < c_1 < ... < c_2P = U`` its units are [c_r, c_r+1) and
[c_2P-1-r, c_2P-r). The contiguous schedules' step formula
(:mod:`hetpipe.partitioner.split`) does not carry over to such splits. On 4
ranks x 8 microbatches with F, B, W of a chunk proportional to its layers
(the head worth 2.1 layers), the simulator's makespan put an even split of
the layers (rank 0 the busiest) 5.3 units above its busiest rank's work, and
the split the additive formula preferred (chunks of 0+emb/5+head, 1/8, 2/7,
5/4 layers, every rank but the first equal) 52.2 above: the formula ranked
them the wrong way round, because a V waits on each chunk in turn, not on a
rank's total. So a V split is priced by running the zb_v order itself
with every (rank, chunk)'s F, B and W times and every boundary message's
time (:mod:`hetpipe.partitioner.v_timing`: the simulator's makespan without
its checks), plus the slowest rank's DP gradient sync and optimizer step.

A rank's memory is both chunks' weights, optimizer state and receive
buffers, the largest of what the engine holds at each moment of its order
(each chunk's live activations and B-to-W gradients, a running W's
gradients, the sends not yet waited for:
:func:`hetpipe.partitioner.schedule_model.memory_rows`), and the larger
chunk's working memory; it recomputes in the cheapest allowed mode that fits
(none or selective: zb_v runs no full recomputation), both chunks alike.

The search is local, not exact: it starts from the split that minimises the
slowest virtual stage (each on its rank's devices) and from even layers, then
moves one boundary by one unit at a time while that lowers (memory overflow,
predicted step), and keeps the best. On a shortened LLaMA-8B over two H200
and two MI325X ranks it found the best of all V splits at 8 layers and one
0.27 % slower than the best at 12 (tests/test_partitioner_schedules.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from hetpipe.models.train_modes import RECOMPUTE_MODES
# Siblings by their own path, not through the package, whose __init__ imports the solver.
import hetpipe.partitioner.schedule_model as schedule_model
from hetpipe.partitioner.cost_context import Candidate, CostContext
from hetpipe.partitioner.plan_data import even_split, unit_bounds
from hetpipe.partitioner.split import Split
from hetpipe.partitioner.v_timing import makespan
from hetpipe.pipeline.placement import Placement

# Boundary moves a climb may make (each a simulation); far more than it needs
# for the 32-layer models on 2-8 ranks, where it settles within a few dozen.
MAX_MOVES = 400


@dataclass(frozen=True)
class RankPrice:
    """One rank of a V split, per device and microbatch unless said otherwise."""
    # Units of chunk 0 and chunk 1.
    ranges: tuple[tuple[int, int], tuple[int, int]]
    forward_s: tuple[float, float]
    input_backward_s: tuple[float, float]
    weight_backward_s: tuple[float, float]
    memory: float
    capacity: float
    # Per step: DP gradient sync of both chunks and the optimizer step.
    sync_s: float
    # Index into RECOMPUTE_MODES, and the layers it covers (all or none).
    mode: int
    covered: int

    @property
    def time_s(self) -> float:
        return sum(self.forward_s) + sum(self.input_backward_s) + sum(self.weight_backward_s)

    @property
    def overflow(self) -> float:
        return max(0.0, self.memory - self.capacity)


def rank_ranges(cuts: list[int], rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Rank ``rank``'s two unit ranges (chunk 0, chunk 1) in a V split's 2P + 1 boundaries."""
    P = (len(cuts) - 1) // 2
    return (cuts[rank], cuts[rank + 1]), (cuts[2 * P - 1 - rank], cuts[2 * P - rank])


def price(schedule: str, ctx: CostContext, cand: Candidate, cuts: list[int]) -> list[RankPrice]:
    """Every rank of the V split ``cuts`` (virtual-stage unit boundaries) under ``schedule`` (zb_v)."""
    layout = cand.layout()
    P, mbs, dp = len(layout), cand.micro_batch_size, cand.dp
    rows = schedule_model.memory_rows(schedule, P, cand.num_microbatches)
    modes = schedule_model.recompute_modes(schedule, ctx.recompute_modes)
    out = []
    for k, (g, _) in enumerate(layout):
        tp = cand.tp[g]
        a, b = rank_ranges(cuts, k)
        base = ctx.group_costs(g, tp, dp, mbs, "none", False)
        options = []  # (fits, time, memory, mode)
        for mode in modes:
            gc = ctx.group_costs(g, tp, dp, mbs, mode, False)
            held = float(schedule_model.peak_bytes(rows[k], [gc.act[a], gc.act[b]], [gc.kept[a], gc.kept[b]],
                                                   [gc.wgrad[a], gc.wgrad[b]], gc.boundary))
            memory = gc.static[a] + gc.static[b] + held + max(gc.transient[a], gc.transient[b])
            options.append((memory <= base.capacity, gc.time[a] + gc.time[b], memory, mode))
        fitting = [o for o in options if o[0]]
        _, _, memory, mode = min(fitting, key=lambda o: o[1]) if fitting else min(options, key=lambda o: o[2])
        uc = ctx.unit_costs(g, tp, mbs, mode, False)
        fwd = tuple(float(uc.forward_s[i:j].sum()) for i, j in (a, b))
        weight = (float(base.weight[a]), float(base.weight[b]))
        total = (float(uc.time_s[a[0]:a[1]].sum()), float(uc.time_s[b[0]:b[1]].sum()))
        layers = int(ctx.range_layers[a] + ctx.range_layers[b])
        out.append(RankPrice(
            ranges=(a, b), forward_s=fwd, weight_backward_s=weight,
            input_backward_s=tuple(t - f - w for t, f, w in zip(total, fwd, weight)),
            memory=float(memory), capacity=base.capacity,
            sync_s=float(ctx.grad_sync_s(g, tp, dp, base.params[a] + base.params[b])),
            mode=RECOMPUTE_MODES.index(mode), covered=layers if mode != "none" else 0))
    return out


def message_s(ctx: CostContext, cand: Candidate) -> list[float]:
    """One message's time over each boundary between ranks l and l + 1."""
    layout = cand.layout()
    return [ctx.link_s(cand, layout[k], layout[k + 1]) for k in range(len(layout) - 1)]


def step_s(schedule: str, cand: Candidate, ranks: list[RankPrice], links: list[float]) -> float:
    """The predicted step of a priced V split: ``schedule``'s order run with its
    chunks' times and its messages' (:mod:`hetpipe.partitioner.v_timing`,
    equal to the simulator's makespan), then the slowest rank's sync."""
    times = ([r.forward_s for r in ranks], [r.input_backward_s for r in ranks],
             [r.weight_backward_s for r in ranks])
    return makespan(schedule, cand.num_microbatches, times, links) + max(r.sync_s for r in ranks)


def evaluate(schedule: str, ctx: CostContext, cand: Candidate, cuts: list[int]) -> tuple[Optional[Split], float]:
    """``cuts`` priced as a :class:`Split` (None where a rank does not fit), and
    the bytes by which its ranks overflow their memory in all."""
    ranks = price(schedule, ctx, cand, cuts)
    overflow = sum(r.overflow for r in ranks)
    if overflow:
        return None, overflow
    return Split(tuple(cuts), step_s(schedule, cand, ranks, message_s(ctx, cand)), max(r.time_s for r in ranks),
                 max(r.sync_s for r in ranks)), 0.0


def starts(schedule: str, ctx: CostContext, cand: Candidate) -> list[list[int]]:
    """Where the climb begins: the split with the fastest slowest virtual stage,
    and even layers (the runtime's default split), where each is valid."""
    return StartSplits(schedule, ctx)(cand)


class StartSplits:
    """:func:`starts` for the candidates of one problem. The minimax dynamic
    program over virtual stages keeps each stage's state (best value per
    boundary, and its choices) in a tree per (TP per group, microbatch size),
    a path down it the groups of the stages so far: candidates whose first
    virtual stages lie on the same groups share that work, and since a state
    is the same operations on the same numbers, the splits are those
    :func:`split.minimax` finds."""

    def __init__(self, schedule: str, ctx: CostContext) -> None:
        self.schedule, self.ctx = schedule, ctx
        self._trees: dict = {}

    def __call__(self, cand: Candidate) -> list[list[int]]:
        P = len(cand.layout())
        found = []
        value, bounds = self._minimax(cand)
        if np.isfinite(value):
            found.append(bounds)
        even = unit_bounds(even_split(self.ctx.model.num_layers, 2 * P))
        if all(b > a for a, b in zip(even, even[1:])) and even not in found:
            found.append(even)
        return found

    def _minimax(self, cand: Candidate) -> tuple[float, list[int]]:
        """split.minimax(..., with_bounds=True) over the V's virtual stages, each on its rank's group."""
        layout = cand.layout()
        placement = Placement(self.schedule, len(layout), 2)
        node = self._trees.setdefault((cand.tp, cand.micro_batch_size), {})
        state, choices = None, []
        for v in range(2 * len(layout)):
            g = layout[placement.rank_of(v)][0]
            if g not in node:
                node[g] = (self._step(cand, g, state), {})
            state, node = node[g]
            choices.append(state[1])
        N = len(state[0])
        bounds = [N - 1]
        for arg in reversed(choices[1:]):
            bounds.append(int(arg[bounds[-1]]))
        bounds.append(0)
        return float(state[0][N - 1]), bounds[::-1]

    def _step(self, cand: Candidate, g: int, state) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """The (best value per boundary, choice per boundary) after one more
        virtual stage on group ``g`` (the first where ``state`` is None)."""
        # A stage's time without recomputation, INF on and below the diagonal (as starts' matrix).
        cost = self.ctx.group_costs(g, cand.tp[g], cand.dp, cand.micro_batch_size, "none", False).time
        if state is None:
            return cost[0].copy(), None
        total = np.maximum(state[0][:, None], cost)
        arg = np.argmin(total, axis=0)
        return total[arg, np.arange(len(arg))], arg


def climb(schedule: str, ctx: CostContext, cand: Candidate, cuts: list[int],
          ruled_out: Optional[Callable[[list[int], float], bool]] = None) -> tuple[tuple[float, float], list[int]]:
    """Move one boundary by one unit at a time while (memory overflow, step)
    falls; the best (overflow, step) and its boundaries. ``ruled_out(cuts,
    step)``, where given, says a split's step is certainly no less than
    ``step`` (a lower bound's word): such a move is not priced once the best
    fits, as it cannot be taken."""
    links = message_s(ctx, cand)
    seen: dict[tuple[int, ...], tuple[float, float]] = {}

    def score(c: list[int]) -> tuple[float, float]:
        key = tuple(c)
        if key not in seen:
            ranks = price(schedule, ctx, cand, c)
            seen[key] = (sum(r.overflow for r in ranks), step_s(schedule, cand, ranks, links))
        return seen[key]

    best, moves, improved = score(cuts), 0, True
    while improved and moves < MAX_MOVES:
        improved = False
        for idx in range(1, len(cuts) - 1):
            for delta in (-1, 1):
                trial = cuts.copy()
                trial[idx] += delta
                if not trial[idx - 1] < trial[idx] < trial[idx + 1]:
                    continue
                moves += 1
                if ruled_out is not None and best[0] == 0 and ruled_out(trial, best[1]):
                    continue
                value = score(trial)
                if value < best:
                    best, cuts, improved = value, trial, True
    return best, cuts
