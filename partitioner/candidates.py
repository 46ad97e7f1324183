"""The solver's candidates: every layout of a cluster's vendor groups along a
pipeline (the groups' order, the stages each group hosts, TP per group, one
DP degree, the microbatch size and so the microbatch count), enumerated in
blocks that share their layout and order, each row a candidate with its
balance bound (perfect balance at the candidate's aggregate speed, and the
zero-bubble schedules' path bound), for :mod:`hetpipe.partitioner.solver`
to search. Where no layout satisfies the constraints, one line says which.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import numpy as np

from hetpipe.pipeline.microbatches import microbatches_per_step
from hetpipe.errors import ConfigError
# Siblings by their own path, not through the package, whose __init__ imports the solver.
import hetpipe.partitioner.cost as cost
import hetpipe.partitioner.schedule_model as schedule_model
from hetpipe.partitioner.cost_context import Candidate, CostContext


@dataclass
class Block:
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


def enumerate_blocks(ctx: CostContext, num_stages: Optional[int], schedule: str,
               memo: Optional[dict] = None) -> list[Block]:
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
                  M: int) -> list[Block]:
    """One block per group order of ``lay``'s candidates under ``schedule``, with their bounds."""
    sum_lb = _path_bound(ctx, memo, lay, schedule)
    blocks = []
    for order in orders:
        probe = Candidate(order, tuple(int(s) for s in lay.grid[0]), lay.tps, lay.dp, lay.mbs, M)
        cross = [ctx.link_s(probe, (a, 0), (b, 0)) for a, b in zip(order, order[1:])]
        c_max, c_sum = np.maximum(max(cross, default=0.0), lay.in_max), 2 * sum(cross) + lay.in_sum
        if schedule_model.is_v_shaped(schedule):  # simulated: only the busiest rank's work bounds it
            blocks.append(Block(order, lay.tps, lay.dp, lay.mbs, M, lay.grid, M * lay.stage_lb))
            continue
        lb = (M - 1) * np.maximum(lay.stage_lb, c_max) + sum_lb + c_sum
        blocks.append(Block(order, lay.tps, lay.dp, lay.mbs, M, lay.grid, lb, c_max, c_sum))
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
