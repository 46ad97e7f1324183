"""Lower bounds on zb_v's simulated step, for its search (partitioner/v_search.py).

A V split's step is the makespan of the zb_v order run with each chunk's F,
B and W times and each boundary's message time, plus the slowest rank's
gradient sync (:mod:`hetpipe.partitioner.v_split`). The makespan is the
longest path through that order's computations, so any one path bounds it
from below. The paths taken here run along microbatch 0 to an *entry* on
rank r, then through every computation rank r's order runs from there on
(:func:`tails` counts them per chunk and kind):

* rank r's first computation (chunk 0's F): microbatch 0's forward through
  the chunks 0 of ranks 0..r-1 before it;
* its chunk 1's B: microbatch 0's forward down and back up the V (every
  chunk's F, each boundary crossed twice), its input gradient down the
  chunks 1 of ranks 0..r-1;
* its chunk 0's B: the same, the gradient then down every chunk 1 and the
  chunks 0 of ranks P-1..r+1.

Every term has a positive coefficient, so chunk times below the real ones
(each unit without recomputation, the cheapest mode's F and B) keep a path
a bound. :meth:`VBounds.start` prices one split so, :meth:`VBounds.timed`
by the makespan itself at those times. :meth:`VBounds.blocks` bounds every
split of many candidates at once: decoder layers cost alike, so a rank's
path grows with its layer count, by the cheaper of its chunks' cost per
layer, and what the path crosses on other ranks is at least one layer per
chunk (the embedding or the head on rank 0); the least slowest path over
layer counts (one per chunk at least, the rest anywhere) is a water level,
bisected from below, and the slowest rank's sync, affine in its parameters,
likewise. The search skips a candidate or a start whose bound passes what
it must beat, so the plan is unchanged (tests/test_partitioner_schedules.py
checks the bounds against simulated steps).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
from functools import lru_cache

import numpy as np

# Siblings by their own path, not through the package, whose __init__ imports the solver.
import hetpipe.partitioner.schedule_model as schedule_model
from hetpipe.partitioner.cost_context import Candidate
from hetpipe.partitioner.split import INF
from hetpipe.partitioner.v_timing import KINDS, makespan
from hetpipe.pipeline.actions import BWD_INPUT, FWD
from hetpipe.pipeline.schedules import compute_orders

# Where the paths enter rank r's order: microbatch 0's (kind, chunk).
ENTRIES = ((FWD, 0), (BWD_INPUT, 1), (BWD_INPUT, 0))
# Bisection steps of the water level: each halves a bracket of ceil(extra / P)
# largest steps; after 12 the bound lies within 1/4096 of it below the level.
BISECTIONS = 12


@lru_cache(maxsize=256)
def tails(schedule: str, num_ranks: int, num_microbatches: int) -> np.ndarray:
    """(entry, rank, chunk, kind as v_timing.KINDS): how many computations of
    each chunk and kind a rank's order runs from each of ENTRIES on, inclusive."""
    out = np.zeros((len(ENTRIES), num_ranks, 2, len(KINDS)))
    kinds = {k: i for i, k in enumerate(KINDS)}
    for r, order in enumerate(compute_orders(schedule, num_ranks, num_microbatches, 2)):
        for (k, c), n in Counter((k, c) for k, _, c in order).items():
            out[:, r, c, kinds[k]] = n
        for e, (kind, chunk) in enumerate(ENTRIES):  # less what runs before the entry (a short prefix)
            for k, _, c in order[:order.index((kind, 0, chunk))]:
                out[e, r, c, kinds[k]] -= 1
    return out


class VBounds:
    """Lower bounds on V splits' steps for one planning problem and schedule."""

    def __init__(self, ctx, schedule: str) -> None:
        self.ctx, self.schedule = ctx, schedule
        self.modes = schedule_model.recompute_modes(schedule, ctx.recompute_modes)
        self._parts: dict = {}

    def parts(self, g: int, tp: int, mbs: int) -> np.ndarray:
        """(4, U) per unit of group g: F, B, W at their least over the modes a
        rank may run, and parameters per device."""
        key = (g, tp, mbs)
        if key not in self._parts:
            base = self.ctx.unit_costs(g, tp, mbs, "none", False)
            w = schedule_model.weight_backward_s(self.ctx.model, mbs, self.ctx.train.seq_length, base.forward_s,
                                                 base.backward_s)
            units = [self.ctx.unit_costs(g, tp, mbs, m, False) for m in self.modes]
            f = np.min([u.forward_s for u in units], axis=0)
            b = np.min([u.time_s - u.forward_s for u in units], axis=0) - w
            self._parts[key] = np.stack([f, b, w, base.params])
        return self._parts[key]

    # -- one split ------------------------------------------------------------------------
    def start(self, cand: Candidate, cuts: list[int], links: list[float]) -> float:
        """A lower bound on v_split.evaluate's step for the V split ``cuts`` of
        ``cand``: the module docstring's slowest path, and the slowest sync."""
        chunks, sync = self._chunks(cand, cuts)  # (P, 2, 4), (P,)
        c = np.asarray(links, dtype=float)
        F, B = chunks[:, :, 0], chunks[:, :, 1]
        P = len(F)
        to_r = _upto(c)  # boundaries 0..r-1
        chain = np.stack([_upto(F[:-1, 0]) + to_r,
                          F.sum() + _upto(B[:-1, 1]) + 2 * c.sum() + to_r,
                          F.sum() + B[:, 1].sum() + (B[::-1, 0].cumsum()[::-1] - B[:, 0]) + 4 * c.sum() - to_r])
        tail = (tails(self.schedule, P, cand.num_microbatches).reshape(len(ENTRIES), P, -1)
                * chunks[:, :, :3].reshape(P, -1)).sum(axis=-1)
        return float((chain + tail).max() + sync.max())

    def timed(self, cand: Candidate, cuts: list[int], links: list[float]) -> float:
        """A lower bound on v_split.evaluate's step for ``cuts`` of ``cand``: the
        schedule's makespan (v_timing) at each chunk's least times, and the
        slowest rank's sync. Where every rank runs without recomputation it is
        the simulated step itself, up to rounding."""
        chunks, sync = self._chunks(cand, cuts)
        times = [chunks[:, :, i].tolist() for i in range(3)]
        return float(makespan(self.schedule, cand.num_microbatches, times, links) + sync.max())

    def _chunks(self, cand: Candidate, cuts: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(P, 2, 4) each rank's two chunks' F, B, W and parameters, and (P,) its sync."""
        cum = self._group_cumulative(cand.tp, cand.micro_batch_size)  # (G, 4, U + 1)
        groups = np.array([g for g, _ in cand.layout()])
        cuts = np.asarray(cuts)
        P = len(groups)
        r = np.arange(P)
        ends = [(cuts[r], cuts[r + 1]), (cuts[2 * P - 1 - r], cuts[2 * P - r])]
        rows, parts = groups[:, None], np.arange(4)[None, :]
        chunks = np.stack([cum[rows, parts, j[:, None]] - cum[rows, parts, i[:, None]] for i, j in ends], axis=1)
        a, b = self._group_sync(cand.tp, cand.dp)
        return chunks, a[groups] + b[groups] * chunks[:, :, 3].sum(axis=1)

    def _group_cumulative(self, tps: tuple[int, ...], mbs: int) -> np.ndarray:
        """(G, 4, U + 1): each group's cumulative unit parts at its TP."""
        key = ("cums", tps, mbs)
        if key not in self._parts:
            self._parts[key] = np.stack([self._cumulative(g, tp, mbs) for g, tp in enumerate(tps)])
        return self._parts[key]

    def _group_sync(self, tps: tuple[int, ...], dp: int) -> tuple[np.ndarray, np.ndarray]:
        """(a, b) per group: its ranks' affine sync (see _affine_sync)."""
        key = ("syncs", tps, dp)
        if key not in self._parts:
            self._parts[key] = tuple(np.array([self._affine_sync(g, tp, dp) for g, tp in enumerate(tps)]).T)
        return self._parts[key]

    def _cumulative(self, g: int, tp: int, mbs: int) -> np.ndarray:
        key = ("cum", g, tp, mbs)
        if key not in self._parts:
            parts = self.parts(g, tp, mbs)
            self._parts[key] = np.concatenate([np.zeros((len(parts), 1)), np.cumsum(parts, axis=1)], axis=1)
        return self._parts[key]

    def _affine_sync(self, g: int, tp: int, dp: int) -> tuple[float, float]:
        """(a, b) with a rank's sync a + b x for x parameters per device
        (cost.grad_sync_s: a ring all-reduce and an optimizer step, both affine)."""
        key = ("sync", g, tp, dp)
        if key not in self._parts:
            a = float(self.ctx.grad_sync_s(g, tp, dp, 0.0))
            self._parts[key] = (a, (float(self.ctx.grad_sync_s(g, tp, dp, 1e9)) - a) / 1e9)
        return self._parts[key]

    # -- every split of a candidate ------------------------------------------------------
    def blocks(self, wanted: list[tuple[object, np.ndarray]]) -> list[np.ndarray]:
        """For each (solver block, rows), (2, rows): lower bounds on the slowest
        path's and on the slowest sync's part of the step of every V split of
        each candidate in those rows (the block gives order, tp, dp,
        micro_batch_size, num_microbatches and stages per group in cluster
        order): their least over layer counts, in one vectorised pass for
        all. Their sum bounds the step."""
        parts = [self._inputs(block, rows) for block, rows in wanted if len(rows)]
        if not parts:
            return [np.zeros((2, 0)) for _ in wanted]
        bounds = iter(np.split(_bound(_Inputs.joined(parts), self.ctx.model.num_layers),
                               np.cumsum([len(p.M) for p in parts])[:-1], axis=1))
        return [next(bounds) if len(rows) else np.zeros((2, 0)) for _, rows in wanted]

    def synced(self, cand: Candidate, cuts: list[int]) -> float:
        """The slowest rank's sync under the V split ``cuts`` of ``cand`` (as priced, up to rounding)."""
        return float(self._chunks(cand, cuts)[1].max())

    def _inputs(self, block, rows: np.ndarray) -> "_Inputs":
        """What :func:`_bound` needs of ``rows`` of ``block`` (the walk loads each row once)."""
        order, mbs = list(block.order), block.micro_batch_size
        stages = block.stages[rows][:, order]
        n = len(stages)
        units = [self.parts(g, block.tp[g], mbs) for g in order]
        layer = np.stack([u[:, 1:-1].min(axis=1) for u in units])  # (G, 4): the least over the layers
        sync = np.array([self._affine_sync(g, block.tp[g], block.dp) for g in order])  # (G, 2)
        tail = self._tails(block.num_microbatches, stages)
        return _Inputs(stages, np.full(n, block.num_microbatches), np.broadcast_to(layer, (n,) + layer.shape),
                       np.broadcast_to(units[0][:, 0], (n, 4)), np.broadcast_to(units[0][:, -1], (n, 4)),
                       self._links(block, stages), np.broadcast_to(sync, (n,) + sync.shape), tail)

    def _tails(self, num_microbatches: int, stages: np.ndarray) -> np.ndarray:
        """(n, entry, P, chunk, kind): :func:`tails` per row, padded to the most ranks."""
        P = stages.sum(axis=1)
        out = np.zeros((len(P), len(ENTRIES), int(P.max()), 2, len(KINDS)))
        for p in np.unique(P):
            out[P == p, :, :p] = tails(self.schedule, int(p), num_microbatches)
        return out

    def _links(self, block, stages: np.ndarray) -> np.ndarray:
        """(n, P - 1): one message's time over each boundary of each row, 0 past its last."""
        ranks = _Ranks(stages)
        probe = _probe(block)
        inner = [[self.ctx.link_s(probe, (g, j), (g, j + 1)) for j in range(max(ranks.most[k] - 1, 0))] + [0.0]
                 for k, g in enumerate(block.order)]
        cross = [self.ctx.link_s(probe, (a, 0), (b, 0)) for a, b in zip(block.order, block.order[1:])] + [0.0]
        here, there, real = ranks.group[:, :-1], ranks.group[:, 1:], ranks.valid[:, 1:]
        out = np.zeros(here.shape)
        for k in range(len(block.order)):
            same = (here == k) & (there == k) & real
            out[same] = np.asarray(inner[k])[ranks.within[:, :-1][same]]
            out[(here == k) & (there == k + 1) & real] = cross[k]
        return out


def _upto(x: np.ndarray) -> np.ndarray:
    """out[r] = sum(x[:r]), for r = 0..len(x)."""
    return np.concatenate([[0.0], np.cumsum(x)])


def _probe(block) -> Candidate:
    """A candidate of ``block`` for its message times (which depend on the groups, TP, DP, microbatch)."""
    return Candidate(block.order, tuple(int(s) for s in block.stages[0]), block.tp, block.dp,
                     block.micro_batch_size, block.num_microbatches)


@dataclass
class _Inputs:
    """Per candidate (row): its stages per group (pipeline order), microbatches,
    a decoder layer's parts on each group (G, 4: as VBounds.parts), the
    embedding's and head's (on the first group), each boundary's message
    (P - 1, 0 past the last), each group's affine sync (G, 2) and its ranks'
    tails (entry, P, chunk, kind; 0 past the last rank)."""
    stages: np.ndarray
    M: np.ndarray
    layer: np.ndarray
    emb: np.ndarray
    head: np.ndarray
    links: np.ndarray
    sync: np.ndarray
    tail: np.ndarray

    @staticmethod
    def joined(parts: list["_Inputs"]) -> "_Inputs":
        """The rows of ``parts`` in one, ranks cut or padded to the most any row has."""
        ranks = int(max(p.stages.sum(axis=1).max() for p in parts))
        out = []
        for f in fields(_Inputs):
            x = [getattr(p, f.name) for p in parts]
            if f.name == "links":
                x = [_fit(v, 1, ranks - 1) for v in x]
            elif f.name == "tail":
                x = [_fit(v, 2, ranks) for v in x]
            out.append(np.concatenate(x))
        return _Inputs(*out)


def _fit(x: np.ndarray, axis: int, size: int) -> np.ndarray:
    """``x`` cut or zero-padded to ``size`` along ``axis``."""
    if x.shape[axis] >= size:
        return x[(slice(None),) * axis + (slice(0, size),)]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return np.pad(x, pad)


def _bound(x: _Inputs, num_layers: int) -> np.ndarray:
    """(2, n): per row, the water levels of the slowest path and of the slowest
    sync (module docstring); -inf where a decoder layer's time is negative
    (a noisy profile), as more layers could then cost less. The embedding and
    the head are one unit each, on rank 0 whatever the split, so a negative
    part of theirs (H200's profiled head: its forward holds the loss and
    outlasts its backward, so B = backward - W < 0) only adds a fixed term
    to a path, which stays a bound."""
    signed = (x.layer[:, :, :3] < 0).any(axis=(1, 2))
    return np.where(signed, -INF, _levels(x, num_layers))


def _levels(x: _Inputs, num_layers: int) -> np.ndarray:
    """_bound's water levels, for non-negative unit times."""
    ranks = _Ranks(x.stages, num_layers)
    layer = np.moveaxis(np.take_along_axis(x.layer, ranks.group[:, :, None], axis=1), 2, 0)  # (4, n, P)
    first = ranks.r == 0
    # Per layer in each chunk, each entry's tail cost: (entry, n, P, chunk).
    per_layer = np.moveaxis((x.tail @ np.moveaxis(layer[:3], 0, -1)[:, None, :, :, None])[..., 0], 1, 0)
    ends = np.moveaxis(x.tail[:, :, :, 0] @ x.emb[:, None, :3, None] + x.tail[:, :, :, 1] @ x.head[:, None, :3, None],
                       1, 0)[..., 0]
    least = _chain(x, ranks, layer, num_layers) + np.where(first, ends, per_layer.sum(axis=-1))
    step = per_layer.min(axis=-1)
    # Rank 0 entered at its chunk 0's B: the path has every chunk's B, so each
    # layer beyond one per chunk adds its B wherever it lies (and rank 0's own
    # step, which counts that B, the rest).
    b_least = np.where(ranks.valid, layer[1], INF).min(axis=1)
    least[2, :, 0] += ranks.extra * b_least
    step[2, :, 0] = np.maximum(step[2, :, 0] - b_least, 0.0)
    path = _water_level(least, step, ranks)
    a, b = (np.take_along_axis(x.sync[:, :, i], ranks.group, axis=1) for i in (0, 1))
    held = np.where(first, x.emb[:, 3:4] + x.head[:, 3:4], 2 * layer[3])
    sync = _water_level((a + b * held)[None], (b * layer[3])[None], ranks)
    return np.stack([path, sync])


def _chain(x: _Inputs, ranks: "_Ranks", layer: np.ndarray, num_layers: int) -> np.ndarray:
    """(entry, n, P): the least of each path's part before its entry on rank r:
    chunks of other ranks at one layer each (the embedding or head on rank
    0), all F at their least (layers beyond one per chunk on the fastest
    group), and the boundaries crossed."""
    c = x.links[:, :ranks.r.shape[1] - 1]
    first = ranks.r == 0
    f0, f1 = np.where(first, x.emb[:, :1], layer[0]), np.where(first, x.head[:, :1], layer[0])
    b0, b1 = np.where(first, x.emb[:, 1:2], layer[1]), np.where(first, x.head[:, 1:2], layer[1])
    f0, f1, b0, b1 = (np.where(ranks.valid, v, 0.0) for v in (f0, f1, b0, b1))
    f_all = f0.sum(1) + f1.sum(1) + ranks.extra * np.where(ranks.valid, layer[0], INF).min(axis=1)
    total = c.sum(axis=1)[:, None]
    to_r = np.concatenate([np.zeros((ranks.n, 1)), np.cumsum(c, axis=1)], axis=1)  # boundaries 0..r-1
    b1_to_r, f0_to_r = _before(b1), _before(f0)
    b0_past_r = b0[:, ::-1].cumsum(axis=1)[:, ::-1] - b0
    return np.stack([f0_to_r + to_r,
                     f_all[:, None] + b1_to_r + 2 * total + to_r,
                     f_all[:, None] + b1.sum(1, keepdims=True) + b0_past_r + 3 * total + (total - to_r)])


def _before(x: np.ndarray) -> np.ndarray:
    """(n, P): per rank r, the sum of x (n, P) over ranks 0..r-1."""
    return np.cumsum(x, axis=1) - x


class _Ranks:
    """The ranks of n candidates with G groups' stage counts (n, G, pipeline order),
    padded to the most ranks: their group (position in the order), index within
    it, and the decoder layers beyond one per chunk of every rank but the first."""

    def __init__(self, stages: np.ndarray, num_layers: int = 0) -> None:
        self.n = len(stages)
        self.P = stages.sum(axis=1)
        self.most = stages.max(axis=0)
        self.r = np.arange(int(self.P.max()))[None, :]
        ends = np.cumsum(stages, axis=1)
        self.valid = self.r < self.P[:, None]
        self.group = np.minimum((self.r[:, :, None] >= ends[:, None, :]).sum(axis=2), stages.shape[1] - 1)
        self.within = self.r - np.take_along_axis(ends - stages, self.group, axis=1)
        self.extra = num_layers - 2 * (self.P - 1)


def _masked_max(x: np.ndarray, ranks: _Ranks) -> np.ndarray:
    return np.where(ranks.valid, x, -INF).max(axis=-1)


def _water_level(least: np.ndarray, step: np.ndarray, ranks: _Ranks) -> np.ndarray:
    """(n,): per row, a lower bound on min over layer counts of the largest
    rank cost, where rank r's costs (one per entry, the first axis of
    ``least`` and ``step``, (entry, n, P)) start at ``least`` at its fewest
    layers and grow by at least ``step`` (>= 0) per extra layer, ``ranks.extra``
    extra layers in all: the extra-th smallest level at which the ranks take
    that many, bisected from below (the lower end never passes it)."""
    floor = _masked_max(least, ranks).max(axis=0)
    extra = ranks.extra.astype(float)
    least = np.where(ranks.valid, least, INF)  # a padded rank takes no layer
    # Levels tried are at least floor, so a rank's path that grows by nothing
    # takes any number of layers; the others floor((level - least) / step).
    free = ranks.valid & (step <= 0)
    per = 1.0 / np.where(ranks.valid & ~free, step, 1.0)

    def enough(level: np.ndarray) -> np.ndarray:
        layers = np.where(free, INF, np.floor((level[None, :, None] - least) * per)).min(axis=0)
        return np.minimum(np.maximum(layers, 0.0), extra[:, None]).sum(axis=-1) >= extra

    # At floor every rank is at or past its fewest layers, so ceil(extra / P) more
    # of the largest step each give every rank that many layers: enough.
    lo, hi = floor, floor + np.ceil(extra / ranks.P) * _masked_max(step, ranks).max(axis=0)
    done = enough(lo)
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        ok = enough(mid)
        lo, hi = np.where(ok, lo, mid), np.where(ok, mid, hi)
    return np.maximum(floor, np.where(done, floor, lo))
