"""A contiguous candidate's least possible step, for a whole block of candidates at once.

The search (:mod:`hetpipe.partitioner.solver`) visits candidates best-first
by a cheap balance bound and solves each one's split
(:func:`hetpipe.partitioner.split.best_split`), whose first test is

    (M - 1) * max(min max t, c_max) + min sum p + 2 sum c + min max a

over the candidate's own (P, U+1, U+1) matrices. Most candidates stop
there, so building their matrices was most of the search's time
(docs/benchmarks.md, 2026-11-28, "Planning 1024 GPUs in under 5 s"). This
module computes a bound below that test without them: every stage of a group
is priced by the group's own matrices, each range at its cheapest
recomputation mode (without recomputation, unless a noisy profile says
otherwise; memory is left out, which only admits more splits), so the
stages of one group are alike and each minimum over splits needs only
per-group tables:

* ``min max t`` and ``min max a``: the least largest cost of units [0, c) in
  s stages of a group (:func:`prefix_minimax`), of [c, U) (:func:`suffix_minimax`)
  and of [i, j) (:func:`middle_minimax`, three groups or more), chained over
  the groups in pipeline order (:func:`chained_minimax`);
* ``min sum p``: the stage costs add up, p_k = t_k - kappa w_k after the
  first stage (schedule_model.weight_credit), so the sum depends only on
  where each group's units begin and on the first stage's end, which is best
  at one unit (w >= 0; a negative w, from a noisy profile, leaves the block
  without this bound): :func:`least_path_sum`.

Each term is at most the split's own, so the bound is at most that test and
at most the candidate's best step: a candidate whose bound reaches the best
step so far cannot beat it, and the search skips it without changing the
plan (tests/test_partitioner_solver.py checks the bound against the split's).
"""
from __future__ import annotations

import numpy as np

# Siblings by their own path, not through the package, whose __init__ imports the solver.
import hetpipe.partitioner.schedule_model as schedule_model
from hetpipe.partitioner.split import INF

# Relative slack taken off a bound before it rules a candidate out: it adds
# its terms in another order than the step does, and may round a few ulps above it.
BOUND_SLACK = 1e-9


def less_slack(bound):
    """``bound`` (a number or an array) less its rounding slack."""
    return bound - BOUND_SLACK * np.abs(bound)


def prefix_minimax(cost: np.ndarray, most: int) -> np.ndarray:
    """(most + 1, N): [s, c] the least largest stage cost of units [0, c) in s
    stages, ``cost`` (N, N) with INF on and below its diagonal (row 0 unused)."""
    out = np.full((most + 1, cost.shape[0]), INF)
    out[1] = cost[0]
    for s in range(1, most):
        out[s + 1] = np.min(np.maximum(out[s][:, None], cost), axis=0)
    return out


def suffix_minimax(cost: np.ndarray, most: int) -> np.ndarray:
    """(most + 1, N): [s, c] the least largest stage cost of units [c, U) in s stages."""
    out = np.full((most + 1, cost.shape[0]), INF)
    out[1] = cost[:, -1]
    for s in range(1, most):
        out[s + 1] = np.min(np.maximum(cost, out[s][None, :]), axis=1)
    return out


def middle_minimax(cost: np.ndarray, most: int) -> np.ndarray:
    """(most + 1, N, N): [s, i, j] the least largest stage cost of units [i, j) in s stages."""
    out = np.full((most + 1,) + cost.shape, INF)
    out[1] = cost
    for s in range(1, most):
        out[s + 1] = np.min(np.maximum(out[s][:, :, None], cost[None, :, :]), axis=1)
    return out


def chained_minimax(tables: list["MinimaxTables"], stages: np.ndarray) -> np.ndarray:
    """Per row of ``stages`` (n, G: stages per group in pipeline order), the least
    largest stage cost over contiguous splits, stage k priced by the tables of
    its group (``tables[g]``, g its position in the pipeline order)."""
    G = stages.shape[1]
    most = stages.max(axis=0)
    if G == 1:
        return tables[0].prefix(most[0])[stages[:, 0], -1]
    reach = tables[0].prefix(most[0])[stages[:, 0]]  # (n, N): units [0, c) done
    for g in range(1, G - 1):
        middle = tables[g].middle(most[g])[stages[:, g]]  # (n, N, N)
        reach = np.min(np.maximum(reach[:, :, None], middle), axis=1)
    last = tables[-1].suffix(most[-1])[stages[:, -1]]
    return np.min(np.maximum(reach, last), axis=1)


class MinimaxTables:
    """One stage cost matrix's prefix, suffix and middle tables, each built
    once for the most stages asked of it so far."""

    def __init__(self, cost: np.ndarray) -> None:
        self.cost = cost
        self._built: dict = {}

    def prefix(self, most: int) -> np.ndarray:
        return self._table(prefix_minimax, most)

    def suffix(self, most: int) -> np.ndarray:
        return self._table(suffix_minimax, most)

    def middle(self, most: int) -> np.ndarray:
        return self._table(middle_minimax, most)

    def _table(self, build, most: int) -> np.ndarray:
        table = self._built.get(build)
        if table is None or len(table) <= most:
            table = self._built[build] = build(self.cost, int(most))
        return table


def least_path_sum(times: list[np.ndarray], weights: list[np.ndarray], stages: np.ndarray,
                   kappa: np.ndarray) -> np.ndarray:
    """Per row of ``stages`` (n, G, pipeline order), min over splits of sum_k p_k with
    p_0 = t_0 and p_k = t_k - kappa w_k after it; ``times[g]``/``weights[g]``
    the group's per-unit t and w (w >= 0), ``kappa`` (n,) the row's credit."""
    n = len(stages)
    cols = np.arange(len(times[0]) + 1)[None, :]
    total = None
    for g, (t, w) in enumerate(zip(times, weights)):
        pt, pw = _prefix(t), _prefix(w)
        credited = pt[None, :] - kappa[:, None] * pw[None, :]  # (n, N)
        s = stages[:, g][:, None]
        if total is None:  # the first stage, units [0, 1) at best, is not credited
            total = np.where(s >= 2, credited + kappa[:, None] * pw[1], np.broadcast_to(pt, (n, len(pt))))
            total = np.where(cols >= s, total, INF)
            continue
        before = np.minimum.accumulate(total - credited, axis=1)
        shifted = np.take_along_axis(before, np.clip(cols - s, 0, None), axis=1)
        total = np.where(cols >= s, shifted + credited, INF)
    return total[:, -1]


def _prefix(x: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(x)])


class ContiguousBounds:
    """:meth:`block` for one planning problem. The terms that do not depend on
    the schedule (or, without weight credit, on the microbatches) are kept per
    block of candidates, whose stage counts the schedules share."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self._tables: dict = {}
        self._terms: dict = {}

    def block(self, schedule: str, block, rows: np.ndarray) -> np.ndarray:
        """The bounds of ``rows`` of ``block`` (a solver block: order, tp, dp,
        micro_batch_size, num_microbatches, stages in cluster order, c_max and
        c_sum per row) under the contiguous ``schedule`` (module docstring);
        -inf for a single stage, whose costs differ (a tied head shares the embedding)."""
        tau, sync = self._minimax_terms(block)
        path = self._path_term(schedule, block, rows)
        M1 = block.num_microbatches - 1
        bound = M1 * np.maximum(tau[rows], block.c_max[rows]) + path + block.c_sum[rows] + sync[rows]
        return np.where(block.stages[rows].sum(axis=1) > 1, bound, -INF)

    def _minimax_terms(self, block) -> tuple[np.ndarray, np.ndarray]:
        """Per row of the block, min over splits of the slowest stage and of the slowest sync."""
        key = ("minimax", block.order, block.tp, block.dp, block.micro_batch_size, id(block.stages))
        if key not in self._terms:
            stages, (tps, mbs, dp) = block.stages[:, list(block.order)], (block.tp, block.micro_batch_size, block.dp)
            tau = chained_minimax([self._time(g, tps[g], mbs) for g in block.order], stages)
            sync = chained_minimax([self._sync(g, tps[g], dp, mbs) for g in block.order], stages)
            self._terms[key] = (tau, sync, block.stages)  # the grid is kept so that its id stays its own
        return self._terms[key][:2]

    def _path_term(self, schedule: str, block, rows: np.ndarray) -> np.ndarray:
        """Per row of ``rows``, min over splits of sum_k p_k under ``schedule``.
        Without weight credit it is the same under every schedule: kept per
        block, for all its rows; with it, it depends on the schedule and the
        microbatches, and only ``rows`` are priced."""
        stages = block.stages[:, list(block.order)]
        units = self._units(block.order, block.tp, block.micro_batch_size)
        kappa = self._kappa(schedule, stages[rows].sum(axis=1), block.num_microbatches)
        if kappa.any() and min(w.min() for w in units[1]) < 0:
            return np.full(len(rows), -INF)  # a noisy profile's negative W: least_path_sum needs W >= 0
        if kappa.any():
            return least_path_sum(*units, stages[rows], kappa)
        key = ("path", block.order, block.tp, block.micro_batch_size, id(block.stages))
        if key not in self._terms:
            self._terms[key] = (least_path_sum(*units, stages, np.zeros(len(stages))), block.stages)
        return self._terms[key][0][rows]

    def _time(self, g: int, tp: int, mbs: int) -> MinimaxTables:
        """A stage's time in group g at its least over the recomputation modes
        (INF on and below the diagonal); it does not depend on DP."""
        key = ("time", g, tp, mbs)
        if key not in self._tables:
            times = [self.ctx.group_costs(g, tp, 1, mbs, m, False).time for m in self.ctx.recompute_modes]
            self._tables[key] = MinimaxTables(np.min(times, axis=0))
        return self._tables[key]

    def _sync(self, g: int, tp: int, dp: int, mbs: int) -> MinimaxTables:
        """A stage's DP gradient sync and optimizer step, INF on and below the diagonal."""
        key = ("sync", g, tp, dp, mbs)
        if key not in self._tables:
            sync = self.ctx.group_costs(g, tp, dp, mbs, "none", False).sync
            self._tables[key] = MinimaxTables(np.where(np.triu(np.ones(sync.shape, dtype=bool), 1), sync, INF))
        return self._tables[key]

    def _units(self, order: tuple[int, ...], tps: tuple[int, ...], mbs: int) -> tuple[list, list]:
        """Per group in pipeline order, its units' t at its least over the
        recomputation modes, and W (as group_costs prices it, from the units
        without recomputation)."""
        modes = self.ctx.recompute_modes
        times = [np.min([self.ctx.unit_costs(g, tps[g], mbs, m, False).time_s for m in modes], axis=0) for g in order]
        base = [self.ctx.unit_costs(g, tps[g], mbs, "none", False) for g in order]
        weights = [schedule_model.weight_backward_s(self.ctx.model, mbs, self.ctx.train.seq_length, u.forward_s,
                                                    u.backward_s) for u in base]
        return times, weights

    @staticmethod
    def _kappa(schedule: str, P: np.ndarray, num_microbatches: int) -> np.ndarray:
        """Per row, twice the schedule's weight credit at its stage count (p_k = t_k - kappa w_k)."""
        counts, index = np.unique(P, return_inverse=True)
        credit = [2 * schedule_model.weight_credit(schedule, int(p), num_microbatches) for p in counts]
        return np.array(credit)[index]
