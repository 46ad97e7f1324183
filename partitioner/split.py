"""The exact split: the cheapest contiguous cut of the model units over given stages.

For one candidate layout (stages in pipeline order, each on known devices)
the objective is the predicted step time

    T = (M - 1) * max(max_k t_k, max_l c_l) + sum_k p_k + 2 * sum_l c_l + max_k a_k

with t_k stage k's forward + backward time of one microbatch (TP collectives
included), p_k its share of the pipeline's fill and drain (t_k under 1F1B,
less under zero bubble: :mod:`hetpipe.partitioner.schedule_model`), c_l one message over boundary l (the engine posts receives ahead
and sends asynchronously, so a boundary behaves as a pipeline stage of its
own), a_k stage k's DP gradient all-reduce and optimizer step after the
flush, and M microbatches. With equal 1F1B stages and free links this is
the textbook (M + P - 1) * t, a bubble fraction of (P - 1) / (M + P - 1).

The split is solved exactly, not greedily (:func:`best_split`): a dynamic
program over unit boundaries minimises sum p under thresholds on max t and on
max a; thresholds are walked in increasing order of max t and, for each, down
the Pareto front of (sum t, max a), with lower bounds that stop both walks.
Each dynamic program is O(P * U^2) for P stages and U units. The module knows
only cost matrices, not devices or models, so it is tested on its own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

INF = math.inf


@dataclass(frozen=True)
class Split:
    # Unit boundaries: stage k holds units [bounds[k], bounds[k + 1]).
    bounds: tuple[int, ...]
    step_s: float
    max_stage_s: float
    max_sync_s: float


def step_time_s(num_microbatches: int, stage_s: Sequence[float], link_s: Sequence[float],
                sync_s: Sequence[float], path_s: Optional[Sequence[float]] = None) -> float:
    """Predicted step time (the formula in the module docstring); ``path_s`` is
    p_k, ``stage_s`` (1F1B) where not given."""
    bottleneck = max(max(stage_s), max(link_s, default=0.0))
    path = stage_s if path_s is None else path_s
    return (num_microbatches - 1) * bottleneck + sum(path) + 2 * sum(link_s) + max(sync_s)


def evaluate_split(time: np.ndarray, sync: np.ndarray, feasible: np.ndarray, num_microbatches: int,
                   links: Sequence[float], bounds: Sequence[int], path: Optional[np.ndarray] = None) -> Optional[Split]:
    """The step time of one given split, or None if a stage is empty or does not fit.

    ``time``, ``sync``, ``feasible`` and ``path`` (p_k; None: ``time``) are
    (P, U+1, U+1): entry [k, i, j] is stage k holding units [i, j).
    """
    P = time.shape[0]
    ks = range(P)
    if any(bounds[k + 1] <= bounds[k] for k in ks) or not all(feasible[k, bounds[k], bounds[k + 1]] for k in ks):
        return None
    stage = [float(time[k, bounds[k], bounds[k + 1]]) for k in ks]
    syncs = [float(sync[k, bounds[k], bounds[k + 1]]) for k in ks]
    paths = None if path is None else [float(path[k, bounds[k], bounds[k + 1]]) for k in ks]
    return Split(tuple(int(b) for b in bounds), step_time_s(num_microbatches, stage, links, syncs, paths),
                 max(stage), max(syncs))


def best_split(time: np.ndarray, sync: np.ndarray, feasible: np.ndarray, num_microbatches: int,
               links: Sequence[float] = (), path: Optional[np.ndarray] = None,
               beat: float = INF) -> Optional[Split]:
    """The split of U units over P stages with the least step time, or None.

    ``beat`` is a step time to undercut (the search's best plan so far): a
    split no faster than it is of no use, so the walks stop once their bounds
    reach it. The answer is then the same split as without it whenever that
    one is faster than ``beat``; otherwise it is None or some split no faster
    than ``beat``.

    Exact: let S* be optimal with max t = X*, sum p = Y*, max a = Z*. The
    outer walk reaches the threshold tau = X* (it stops only once
    (M-1)*max(tau, c_max) + min sum p + 2 sum c + min max a reaches the best
    found); at that tau the inner walk minimises sum p, then requires max a
    below the last solution's, and so on, so it meets a solution with
    sum p <= Y* and max a <= Z* unless its bound shows none can beat the best.
    Ties go to the first split found, so the result is deterministic.
    """
    N = time.shape[1]
    M1 = num_microbatches - 1
    upper = np.triu(np.ones((N, N), dtype=bool), 1)
    valid = feasible & upper
    t = np.where(valid, time, INF)
    a = np.where(valid, sync, INF)
    p = t if path is None else np.where(valid, path, INF)
    tau0 = minimax(t)
    if not math.isfinite(tau0):
        return None
    c_max, c_sum = max(links, default=0.0), 2 * sum(links)
    y_min, _ = _min_sum(p)
    z_min = minimax(a)

    def evaluate(bounds: list[int]) -> Split:
        return evaluate_split(time, sync, valid, num_microbatches, links, bounds, path)

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
        if M1 * max(tau, c_max) + y_min + c_sum + z_min >= _to_beat(best, beat):
            break
        p_tau = np.where(t <= tau, p, INF)
        limit = INF
        while True:
            y, bounds = _min_sum(p_tau if limit == INF else np.where(a < limit, p_tau, INF))
            if bounds is None:
                break
            split = evaluate(bounds)
            if best is None or split.step_s < best.step_s:
                best = split
            if M1 * max(tau, c_max) + y + c_sum + z_min >= _to_beat(best, beat):
                break
            limit = split.max_sync_s
        larger = finite[finite > tau]
        if not larger.size:
            break
        tau = float(larger.min())
    return best


def _to_beat(best: Optional[Split], beat: float) -> float:
    """The step time a split still to be found must undercut to matter."""
    return beat if best is None else min(best.step_s, beat)


def _min_sum(cost_: np.ndarray) -> tuple[float, Optional[list[int]]]:
    """min over splits of the sum of stage costs, and the boundaries of the first minimiser."""
    P, N = cost_.shape[0], cost_.shape[1]
    best = cost_[0, 0].copy()
    choices = []
    columns = np.arange(N)
    for k in range(1, P):
        total = best[:, None] + cost_[k]
        arg = total.argmin(axis=0)
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


def minimax(cost_: np.ndarray, with_bounds: bool = False) -> float | tuple[float, list[int]]:
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
