"""Lower bounds on zb_v's simulated step, for its search (partitioner/v_search.py).

A V split's step is the makespan of the zb_v order run with each chunk's F,
B and W times and each boundary's message time, plus the slowest rank's
gradient sync (:mod:`hetpipe.partitioner.v_split`). The makespan is the
longest path through that order's computations, so any one path bounds it
from below. For rank r, microbatch 0's forward runs down and back up the V
(every chunk's F, each boundary crossed twice), its input gradient comes
back down to rank r's chunk 1 (chunks 1 of ranks 0..r-1, r boundaries), and
rank r then runs all it has left: everything but the n0 = min(M, 2P-r-1)
chunk-0 and n1 = min(M, r+1) chunk-1 forwards its order puts before its
first B (hetpipe/pipeline/schedule_zbv.py). With F_all every chunk's F:

    X_r = F_all + (M - n0) F_r0 + (M - n1) F_r1 + M (B_r + W_r) + sum_{q<r} B_q1 + 2 sum c + sum_{l<r} c_l

Every coefficient is positive, so times below a chunk's (its units without
recomputation, the cheapest mode's F and B) keep it a bound.
:meth:`VBounds.start` prices one split so; :meth:`VBounds.block` bounds
every split of a candidate at once. Decoder layers cost alike, so a split
matters through each rank's layer count (chunks hold at least one unit, rank
0 the embedding and the head): the least largest X_r over those counts is
the E-th cheapest extra layer over all ranks (E the layers beyond the
least), bisected; F_all is taken at its least, layers on the faster group;
the rank sync, affine in a rank's parameters... likewise. The search skips
a candidate or start whose bound passes what it must beat, so the plan is
unchanged (tests/test_partitioner_schedules.py checks the bounds against
the simulated steps).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Siblings by their own path, not through the package, whose __init__ imports the solver.
import hetpipe.partitioner.schedule_model as schedule_model
from hetpipe.partitioner.cost_context import Candidate
from hetpipe.partitioner.split import INF
from hetpipe.partitioner.v_split import rank_ranges
from hetpipe.partitioner.v_timing import makespan

# Bisection steps of the water level: each halves a bracket of ceil(extra / P)
# largest steps; after 12 the bound lies within 1/4096 of it below the level.
BISECTIONS = 12


class VBounds:
    """Lower bounds on V splits' steps for one planning problem and schedule."""

    def __init__(self, ctx, schedule: str) -> None:
        self.ctx, self.schedule = ctx, schedule
        self.modes = schedule_model.recompute_modes(schedule, ctx.recompute_modes)
        self._parts: dict = {}

    def parts(self, g: int, tp: int, mbs: int) -> np.ndarray:
        """(5, U) per unit of group g: F, B, W at their least over the modes a
        rank may run, parameters per device, and F + B + W."""
        key = (g, tp, mbs)
        if key not in self._parts:
            base = self.ctx.unit_costs(g, tp, mbs, "none", False)
            w = schedule_model.weight_backward_s(self.ctx.model, mbs, self.ctx.train.seq_length, base.forward_s,
                                                 base.backward_s)
            units = [self.ctx.unit_costs(g, tp, mbs, m, False) for m in self.modes]
            f = np.min([u.forward_s for u in units], axis=0)
            b = np.min([u.time_s - u.forward_s for u in units], axis=0) - w
            self._parts[key] = np.stack([f, b, w, base.params, f + b + w])
        return self._parts[key]

    # -- one split ------------------------------------------------------------------------
    def start(self, cand, cuts: list[int], links: list[float]) -> float:
        """A lower bound on v_split.evaluate's step for the V split ``cuts`` of ``cand``."""
        layout, M = cand.layout(), cand.num_microbatches
        chunks = np.array([self._chunks(cand, g, cuts, r) for r, (g, _) in enumerate(layout)])  # (P, 2, 4)
        F, B, W = chunks[:, :, 0], chunks[:, :, 1], chunks[:, :, 2]
        P = len(layout)
        r = np.arange(P)
        n0, n1 = np.minimum(M, 2 * P - r - 1), np.minimum(M, r + 1)
        tail = np.concatenate([[0.0], np.cumsum(B[:-1, 1] + np.asarray(links, dtype=float))]) if P > 1 else np.zeros(1)
        paths = F.sum() + (M - n0) * F[:, 0] + (M - n1) * F[:, 1] + M * (B.sum(1) + W.sum(1)) + tail + 2 * sum(links)
        own = M * (F + B + W).sum(axis=1)
        sync = [self.ctx.grad_sync_s(g, cand.tp[g], cand.dp, p) for (g, _), p in zip(layout, chunks[:, :, 3].sum(1))]
        return float(max(paths.max(), own.max()) + max(sync))

    def timed(self, cand, cuts: list[int], links: list[float]) -> float:
        """A lower bound on v_split.evaluate's step for ``cuts`` of ``cand``: the
        schedule's makespan (v_timing) at each chunk's least times, and the
        slowest rank's sync. Where every rank runs without recomputation it is
        the simulated step itself, up to rounding."""
        layout = cand.layout()
        chunks = np.array([self._chunks(cand, g, cuts, r) for r, (g, _) in enumerate(layout)])  # (P, 2, 4)
        times = [chunks[:, :, i].tolist() for i in range(3)]
        sync = [self.ctx.grad_sync_s(g, cand.tp[g], cand.dp, p) for (g, _), p in zip(layout, chunks[:, :, 3].sum(1))]
        return float(makespan(self.schedule, cand.num_microbatches, times, links) + max(sync))

    def _chunks(self, cand, g: int, cuts: list[int], rank: int) -> list[np.ndarray]:
        """Rank ``rank``'s two chunks' (F, B, W, parameters)."""
        cum = self._cumulative(g, cand.tp[g], cand.micro_batch_size)
        return [cum[:4, j] - cum[:4, i] for i, j in rank_ranges(cuts, rank)]

    def _cumulative(self, g: int, tp: int, mbs: int) -> np.ndarray:
        key = ("cum", g, tp, mbs)
        if key not in self._parts:
            parts = self.parts(g, tp, mbs)
            self._parts[key] = np.concatenate([np.zeros((len(parts), 1)), np.cumsum(parts, axis=1)], axis=1)
        return self._parts[key]

    # -- every split of a candidate ------------------------------------------------------
    def blocks(self, wanted: list[tuple[object, np.ndarray]]) -> list[np.ndarray]:
        """For each (solver block, rows), a lower bound on the step of every V split
        of each candidate in those rows (the block gives order, tp, dp,
        micro_batch_size, num_microbatches and stages per group in cluster
        order): the module docstring's paths, and each rank's own work, at the
        layer counts that minimise the slowest. One vectorised pass for all."""
        parts = [self._inputs(block, rows) for block, rows in wanted if len(rows)]
        if not parts:
            return [np.zeros(0) for _ in wanted]
        bounds = iter(np.split(_bound(_Inputs.joined(parts), self.ctx.model.num_layers),
                               np.cumsum([len(p.M) for p in parts])[:-1]))
        return [next(bounds) if len(rows) else np.zeros(0) for _, rows in wanted]

    def _inputs(self, block, rows: np.ndarray) -> "_Inputs":
        """What :func:`_bound` needs of ``rows`` of ``block``, per row."""
        n, order, mbs = len(rows), list(block.order), block.micro_batch_size
        stages = block.stages[rows][:, order]
        units = [self.parts(g, block.tp[g], mbs) for g in order]
        layer = np.stack([u[:, 1:-1].min(axis=1) for u in units])  # (G, 5): the least over the layers
        sync = np.array([self._affine_sync(g, block.tp[g], block.dp) for g in order])  # (G, 2)
        return _Inputs(stages, np.full(n, block.num_microbatches), np.broadcast_to(layer, (n,) + layer.shape),
                       np.broadcast_to(units[0][:, 0], (n, 5)), np.broadcast_to(units[0][:, -1], (n, 5)),
                       self._links(block, stages), np.broadcast_to(sync, (n,) + sync.shape))

    def _affine_sync(self, g: int, tp: int, dp: int) -> tuple[float, float]:
        """(a, b) with a rank's sync a + b x for x parameters per device
        (cost.grad_sync_s: a ring all-reduce and an optimizer step, both affine)."""
        a = float(self.ctx.grad_sync_s(g, tp, dp, 0.0))
        return a, (float(self.ctx.grad_sync_s(g, tp, dp, 1e9)) - a) / 1e9

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


def _probe(block) -> Candidate:
    """A candidate of ``block`` for its message times (which depend on the groups, TP, DP, microbatch)."""
    return Candidate(block.order, tuple(int(s) for s in block.stages[0]), block.tp, block.dp,
                     block.micro_batch_size, block.num_microbatches)


@dataclass
class _Inputs:
    """Per candidate (row): its stages per group (pipeline order), microbatches,
    a decoder layer's parts on each group (G, 5: as VBounds.parts), the
    embedding's and head's (on the first group), each boundary's message
    (P - 1, 0 past the last) and each group's affine sync (G, 2)."""
    stages: np.ndarray
    M: np.ndarray
    layer: np.ndarray
    emb: np.ndarray
    head: np.ndarray
    links: np.ndarray
    sync: np.ndarray

    @staticmethod
    def joined(parts: list["_Inputs"]) -> "_Inputs":
        width = max(p.links.shape[1] for p in parts)
        links = [np.pad(p.links, ((0, 0), (0, width - p.links.shape[1]))) for p in parts]
        return _Inputs(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                         ("stages", "M", "layer", "emb", "head")), np.concatenate(links),
                       np.concatenate([p.sync for p in parts]))


def _bound(x: _Inputs, num_layers: int) -> np.ndarray:
    """Per row, max(least F_all + the slowest path's water level, the slowest
    own work's) + the slowest sync's: see the module docstring."""
    ranks = _Ranks(x.stages, num_layers)
    layer = np.moveaxis(np.take_along_axis(x.layer, ranks.group[:, :, None], axis=1), 2, 0)  # (5, n, P)
    M = x.M[:, None].astype(float)
    n0, n1 = np.minimum(M, 2 * ranks.P[:, None] - ranks.r - 1), np.minimum(M, ranks.r + 1)
    each0 = (M - n0) * layer[0] + M * (layer[1] + layer[2])  # one more layer in chunk 0
    each1 = (M - n1) * layer[0] + M * (layer[1] + layer[2])
    emb, head = x.emb.T[:, :, None], x.head.T[:, :, None]
    ends = (M - n0) * emb[0] + M * (emb[1] + emb[2]) + (M - n1) * head[0] + M * (head[1] + head[2])
    first = ranks.r == 0
    path = _offsets(x, ranks, layer) + np.where(first, ends, each0 + each1)
    own = M * np.where(first, emb[4] + head[4], 2 * layer[4])
    a, b = (np.take_along_axis(x.sync[:, :, i], ranks.group, axis=1) for i in (0, 1))
    held = np.where(first, emb[3] + head[3], 2 * layer[3])
    least = np.stack([path, own, a + b * held])
    step = np.stack([np.minimum(each0, each1), M * layer[4], b * layer[3]])
    path_level, own_level, sync_level = _water_level(least, step, ranks)
    f_all = x.emb[:, 0] + x.head[:, 0] + np.where(ranks.valid & ~first, 2 * layer[0], 0.0).sum(axis=1) \
        + ranks.extra * layer[0].min(axis=1)  # the least: layers beyond one per chunk on the fastest group
    return np.maximum(f_all + path_level, own_level) + sync_level


def _offsets(x: _Inputs, ranks: "_Ranks", layer: np.ndarray) -> np.ndarray:
    """(n, P): the path's part before rank r runs: both crossings of every
    boundary, and the gradient's way down to rank r (a layer's B per chunk 1
    above it, the head's on rank 0)."""
    links = x.links[:, :ranks.r.shape[1] - 1]
    down = np.where(ranks.r[:, :-1] == 0, x.head[:, 1:2], layer[1][:, :-1]) + links
    before = np.concatenate([np.zeros((ranks.n, 1)), np.cumsum(down, axis=1)], axis=1)
    return 2 * links.sum(axis=1, keepdims=True) + before


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
    """(k, n): per row, a lower bound on min over layer counts of the largest rank
    cost, rank r's cost ``least[.., r]`` at its fewest layers and ``step[.., r]``
    (> 0) more per extra layer, ``ranks.extra`` extra layers in all: the
    extra-th smallest of least + j step (j >= 1) over the ranks, bisected from
    below (the lower end of the bracket never passes it)."""
    floor = _masked_max(least, ranks)
    extra = ranks.extra.astype(float)
    least = np.where(ranks.valid, least, INF)  # a padded rank takes no layer
    per = 1.0 / np.where(ranks.valid, step, 1.0)

    def enough(level: np.ndarray) -> np.ndarray:
        layers = np.minimum(np.maximum(np.floor((level[..., None] - least) * per), 0.0), extra[:, None])
        return layers.sum(axis=-1) >= extra

    # At floor every rank is at or past its fewest layers, so ceil(extra / P) more
    # of the largest step each give every rank that many layers: enough.
    lo, hi = floor, floor + np.ceil(extra / ranks.P) * _masked_max(step, ranks)
    done = enough(lo)
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        ok = enough(mid)
        lo, hi = np.where(ok, lo, mid), np.where(ok, mid, hi)
    lo = np.where(done, floor, lo)
    return np.maximum(floor, lo)
