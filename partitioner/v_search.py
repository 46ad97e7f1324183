"""zb_v's search over candidates (partitioner/v_split.py prices and climbs one).

The search's result is defined by a walk: candidates in the order of their
balance bound (``lower_bounds``, stable), each one's starting splits
(v_split.starts) simulated in turn, until a candidate's balance bound
reaches the best start's step found before it; the three best starts of the
walk (by step, then the order they were found in; where fewer fit, the
least overflowing) are then climbed. Simulating every start of the walk
was most of the planner's time (docs/benchmarks.md, 2026-11-28, "Planning
1024 GPUs in under 5 s"), so :func:`search` computes the same walk's end
and the same three starts from lower bounds
(partitioner/v_bounds.py), simulating only the starts those bounds cannot
rule out:

* where the walk ends: at the first candidate whose balance bound reaches
  the best step before it, which is certain once the bounds of the
  candidates before it lie above its balance bound, or a simulated step
  before it lies at or below it;
* its three best starts: no start whose bound passes the third best
  simulated step of the walk can be among them.

Bounds are refined one level at a time, the least first: a candidate's
bound over all its splits (computed for many at once), then its starts'
own bounds, then their simulations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

# Siblings by their own path, not through the package, whose __init__ imports the solver.
import hetpipe.partitioner.v_split as v_split
from hetpipe.partitioner.candidate_bounds import less_slack
from hetpipe.partitioner.cost_context import Candidate, CostContext
from hetpipe.partitioner.split import INF, Split
from hetpipe.partitioner.v_bounds import VBounds

# How many of the best V candidates (by their starting splits) the climb refines.
V_REFINED = 3
# Candidates whose bound over all splits is computed at once, at first (doubled each time more are needed).
FIRST_LOAD = 256


def search(schedule: str, ctx: CostContext, blocks: list, fixed: Optional[list[int]],
           bounds: Optional[VBounds] = None, beat: float = INF) -> tuple[Optional[tuple[Candidate, Split]], int]:
    """The best (candidate, split) of ``blocks`` under the V ``schedule``, or None
    if nothing fits, and how many candidates had a start simulated. With
    ``beat``, None also where no split of any candidate can step below it
    (the walk is then not taken: exact, as every split's step lies above its
    candidate's bound)."""
    bounds = bounds or VBounds(ctx, schedule)
    if fixed is not None:
        scored, tight, solved = plain_walk(schedule, ctx, blocks, lambda cand: [fixed])
    else:
        walk = _Walk(schedule, ctx, blocks, bounds)
        if beat < INF and not walk.may_beat(beat):
            return None, 0
        walk.settle()
        scored, tight, solved = walk.results()
    return _climbed(schedule, ctx, finalists(scored, tight), fixed, bounds), solved


def finalists(scored: list, tight: list) -> list[tuple[Candidate, list[int]]]:
    """The (candidate, cuts) that climb: the best fitting starts of a walk, then
    (where fewer fit) the least overflowing."""
    out = [(c, list(sp.bounds)) for _, _, c, sp in sorted(scored, key=_key)[:V_REFINED]]
    return out + [(c, cuts) for _, _, c, cuts in sorted(tight, key=_key)[:V_REFINED - len(out)]]


def _key(entry: tuple) -> tuple:
    return entry[:2]


def _climbed(schedule: str, ctx: CostContext, chosen: list, fixed: Optional[list[int]], bounds: VBounds):
    """The best of ``chosen`` (candidate, starting cuts) once each has climbed, or None."""
    scored = []
    for cand, cuts in chosen:
        if fixed is None:
            cuts = v_split.climb(schedule, ctx, cand, cuts, _ruled_out(ctx, bounds, cand))[1]
        split, _ = v_split.evaluate(schedule, ctx, cand, cuts)
        if split is not None:
            scored.append((split.step_s, len(scored), cand, split))
    if not scored:
        return None
    _, _, cand, split = min(scored, key=_key)
    return cand, split


def _ruled_out(ctx: CostContext, bounds: VBounds, cand: Candidate):
    """climb's test that a split of ``cand`` cannot step below ``step``: its paths' bound, then its timed one."""
    links = v_split.message_s(ctx, cand)

    def ruled_out(cuts: list[int], step: float) -> bool:
        return less_slack(bounds.start(cand, cuts, links)) >= step or \
            less_slack(bounds.timed(cand, cuts, links)) >= step
    return ruled_out


def plain_walk(schedule: str, ctx: CostContext, blocks: list, cuts_of) -> tuple[list, list, int]:
    """The walk itself, simulating every start ``cuts_of(candidate)`` gives:
    (scored, tight, candidates simulated), entries (step or overflow, order, candidate, split or cuts)."""
    lbs = np.concatenate([b.lower_bounds for b in blocks])
    starts = np.cumsum([0] + [len(b.lower_bounds) for b in blocks])
    scored, tight, best, solved = [], [], INF, 0
    for pos in np.argsort(lbs, kind="stable"):
        if lbs[pos] >= best:
            break
        bi = int(np.searchsorted(starts, pos, side="right")) - 1
        cand = blocks[bi].candidate(int(pos - starts[bi]))
        solved += 1
        for cuts in cuts_of(cand):
            split, overflow = v_split.evaluate(schedule, ctx, cand, cuts)
            if split is not None:
                scored.append((split.step_s, len(scored), cand, split))
                best = min(best, split.step_s)
            else:
                tight.append((overflow, len(tight), cand, cuts))
    return scored, tight, solved


@dataclass
class _Start:
    """One starting split of a walk candidate and what is known of it."""
    cuts: list[int]
    # A lower bound on its simulated step, refined level by level: the
    # candidate's paths over all splits and this split's own sync, this
    # split's paths (VBounds.start), its makespan at the least chunk times
    # (VBounds.timed), its simulated step.
    bound: float
    level: int = 0
    # v_split.evaluate's (split or None, overflow), once simulated.
    result: Optional[tuple[Optional[Split], float]] = None

    @property
    def step(self) -> float:
        """The simulated step where it fits, else INF."""
        return INF if self.result is None or self.result[0] is None else self.result[0].step_s


class _Walk:
    """The walk's candidates by position, with what is known of each: its lower
    bound on its best fitting start's step (``lower``), the least bound on a
    start not yet simulated (``pending``), its best simulated step (``best``)
    and, once known, its starts."""

    def __init__(self, schedule: str, ctx: CostContext, blocks: list, bounds: VBounds) -> None:
        self.schedule, self.ctx, self.blocks, self.bounds = schedule, ctx, blocks, bounds
        self.splits = v_split.StartSplits(schedule, ctx)
        lbs = np.concatenate([b.lower_bounds for b in blocks])
        self.order = np.argsort(lbs, kind="stable")
        self.lb = lbs[self.order]
        self.first = np.cumsum([0] + [len(b.lower_bounds) for b in blocks])
        self.lower = less_slack(self.lb)
        self.paths = np.zeros(len(self.lb))  # the path part of a loaded position's bound over all splits
        self.pending = self.lower.copy()  # the least bound on a start not yet simulated
        self.best = np.full(len(self.lb), INF)
        self.fitting: list[tuple[float, int]] = []  # (simulated step, position) of each start that fits
        self.loaded = 0  # positions below it have their bound over all splits
        self.starts: dict[int, list[_Start]] = {}
        self.end = len(self.lb)

    def may_beat(self, beat: float) -> bool:
        """Whether a candidate's bound over all its splits lies below ``beat``:
        loads bounds in the walk's order until one does, or until the balance
        bounds (which rise along the walk) reach ``beat``."""
        below = int(np.searchsorted(self.lb, beat, side="left"))
        while True:
            if (self.lower[:min(self.loaded, below)] < beat).any():
                return True
            if self.loaded >= below:
                return False
            self._load(self.loaded)

    def settle(self) -> None:
        """Refine until the walk's end and its three best starts are certain."""
        self.end = self._find_end()
        while (j := self._open_below(self._third_best())) is not None:
            self._refine(j)

    def results(self) -> tuple[list, list, int]:
        """The walk's (scored, tight, candidates simulated), entries in the walk's order."""
        scored, tight, solved = [], [], 0
        for k in sorted(k for k in self.starts if k < self.end):
            simulated = [s for s in self.starts[k] if s.result is not None]
            solved += bool(simulated)
            for s in simulated:
                if s.result[0] is not None:
                    scored.append((s.step, (k, len(scored)), self._candidate(k), s.result[0]))
                else:
                    tight.append((s.result[1], (k, len(tight)), self._candidate(k), s.cuts))
        return scored, tight, solved

    def _find_end(self) -> int:
        """The first position whose balance bound reaches the best step before it."""
        while True:
            # Past the loaded positions the lower bounds are the balance bounds, which
            # rise along the walk: the first unsure position lies at most one beyond.
            span = min(len(self.lb), self.loaded + 1)
            low = _exclusive_min(self.lower[:span])
            high = _exclusive_min(self.best[:span])
            unsure = np.flatnonzero(self.lb[:span] >= low)
            if not len(unsure):
                if span == len(self.lb):
                    return span
                self._reach()
                continue
            c = int(unsure[0])
            if self.lb[c] >= high[c]:
                return c
            self._refine_below(c)

    def _refine_below(self, c: int) -> None:
        """One more level for each position before ``c`` whose bound does not
        pass c's balance bound, least first (to go past c, all must pass it),
        until one of them simulates a step at or below it (the walk ends there)."""
        for q in np.argsort(self.lower[:c], kind="stable"):
            if self.lower[q] > self.lb[c] or self.best[q] <= self.lb[c]:
                break
            self._refine(int(q))

    def _reach(self) -> None:
        """Know more positions: first, while no start has a simulated step, the
        most promising loaded one's (a step caps how far the walk can reach,
        hence what is worth loading); then load more."""
        j = int(np.argmin(self.pending[:self.loaded])) if self.loaded else 0
        if self.loaded and self.best.min() == INF and self.pending[j] < INF:
            self._refine(j)
        else:
            self._load(self.loaded)

    def _third_best(self) -> float:
        """The third best simulated step of the walk so far (INF while fewer fit)."""
        steps = sorted(step for step, k in self.fitting if k < self.end)
        return steps[V_REFINED - 1] if len(steps) >= V_REFINED else INF

    def _open_below(self, limit: float) -> Optional[int]:
        """The walk's position with the least bound on a start not yet simulated, if at or below ``limit``."""
        if self.end > self.loaded:
            self._load(self.end - 1)
        j = int(np.argmin(self.pending[:self.end]))
        return j if self.pending[j] <= limit and self.pending[j] < INF else None

    def _refine(self, k: int) -> None:
        """One more level of knowledge about position ``k``."""
        if k >= self.loaded:
            self._load(k)
        elif k not in self.starts:
            self._bound_starts(k)
        else:
            self._simulate_next(k)

    def _load(self, k: int) -> None:
        """Bounds over all splits for every position below max(2 x loaded, k + 1,
        FIRST_LOAD), but none past where the walk certainly ends: at the first
        balance bound that reaches a simulated step."""
        beyond = int(np.searchsorted(self.lb, self.best.min(), side="left")) + 1
        stop = min(len(self.lb), max(min(2 * self.loaded, beyond), k + 1, FIRST_LOAD))
        positions = np.arange(self.loaded, stop)
        pos = self.order[positions]
        bi = np.searchsorted(self.first, pos, side="right") - 1
        wanted = [(self.blocks[b], pos[bi == b] - self.first[b]) for b in np.unique(bi)]
        for b, (paths, sync) in zip(np.unique(bi), self.bounds.blocks(wanted)):
            at = positions[bi == b]
            self.paths[at] = paths
            self.lower[at] = np.maximum(self.lower[at], less_slack(paths + sync))
            self.pending[at] = self.lower[at]
        self.loaded = stop

    def _bound_starts(self, k: int) -> None:
        """Position ``k``'s starts, each bounded by the paths of all its
        candidate's splits and its own sync (or the candidate's bound, where higher)."""
        cand = self._candidate(k)
        self.starts[k] = [_Start(cuts, max(self.lower[k], less_slack(self.paths[k] + self.bounds.synced(cand, cuts))))
                          for cuts in self.splits(cand)]
        self._update(k)

    def _simulate_next(self, k: int) -> None:
        """Position ``k``'s start with the least bound, one level further: its
        own paths, its makespan at the least chunk times, or its simulation."""
        start = min((s for s in self.starts[k] if s.result is None), key=lambda s: s.bound)
        cand = self._candidate(k)
        if start.level < 2:
            links = v_split.message_s(self.ctx, cand)
            bound = (self.bounds.start if start.level == 0 else self.bounds.timed)(cand, start.cuts, links)
            start.bound, start.level = max(start.bound, less_slack(bound)), start.level + 1
        else:
            start.result = v_split.evaluate(self.schedule, self.ctx, cand, start.cuts)
            if start.result[0] is not None:
                self.fitting.append((start.step, k))
        self._update(k)

    def _update(self, k: int) -> None:
        """Position ``k``'s bounds and best step from its starts."""
        starts = self.starts[k]
        self.best[k] = min((s.step for s in starts), default=INF)
        open_ = [s.bound for s in starts if s.result is None]
        self.pending[k] = min(open_, default=INF)
        self.lower[k] = max(self.lower[k], min(open_ + [self.best[k]]))

    def _candidate(self, k: int) -> Candidate:
        pos = int(self.order[k])
        bi = int(np.searchsorted(self.first, pos, side="right")) - 1
        return self.blocks[bi].candidate(pos - int(self.first[bi]))


def _exclusive_min(x: np.ndarray) -> np.ndarray:
    """out[k] = min(x[:k]) (INF for k = 0)."""
    return np.concatenate([[INF], np.minimum.accumulate(x)[:-1]])
