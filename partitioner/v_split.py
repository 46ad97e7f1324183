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
from typing import Optional

import numpy as np

from hetpipe.models.train_modes import RECOMPUTE_MODES
# Siblings by their own path, not through the package, whose __init__ imports the solver.
import hetpipe.partitioner.schedule_model as schedule_model
from hetpipe.partitioner.cost_context import Candidate, CostContext
from hetpipe.partitioner.plan_data import even_split, unit_bounds
from hetpipe.partitioner.split import INF, Split, minimax
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
    layout = cand.layout()
    P, U = len(layout), ctx.num_units
    placement = Placement(schedule, P, 2)
    found = []
    time = np.stack([ctx.group_costs(layout[placement.rank_of(v)][0], cand.tp[layout[placement.rank_of(v)][0]],
                                     cand.dp, cand.micro_batch_size, "none", False).time for v in range(2 * P)])
    value, bounds = minimax(np.where(np.triu(np.ones((U + 1, U + 1), bool), 1), time, INF), with_bounds=True)
    if np.isfinite(value):
        found.append(list(bounds))
    even = unit_bounds(even_split(ctx.model.num_layers, 2 * P))
    if all(b > a for a, b in zip(even, even[1:])) and even not in found:
        found.append(even)
    return found


def climb(schedule: str, ctx: CostContext, cand: Candidate, cuts: list[int]) -> tuple[tuple[float, float], list[int]]:
    """Move one boundary by one unit at a time while (memory overflow, step)
    falls; the best (overflow, step) and its boundaries."""
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
                value = score(trial)
                if value < best:
                    best, cuts, improved = value, trial, True
    return best, cuts
