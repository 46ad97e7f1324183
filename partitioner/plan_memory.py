"""The planner's memory prediction for a plan as it will run: peak bytes per device of every pipeline rank.

The search (:mod:`hetpipe.partitioner.solver`) predicts the memory of the
plans it considers, choosing each stage's recomputation as it goes; a plan
built from ``partition.layers`` or loaded from a plan.yaml has its
recomputation fixed already. :func:`predicted_memory_gib` prices such a
plan with the same cost model (:class:`~hetpipe.partitioner.cost_context.CostContext`'s
per-range static, activation, zero-bubble and transient bytes, and what
the schedule's ranks hold at their peaks, ``schedule_model.memory_rows``),
so that the runtime can compare it with the device it got
(:mod:`hetpipe.training.memory_fit`). For a plan the planner made it equals
the planner's own figure (tests/test_memory_fit.py).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from hetpipe.devices.cluster import ClusterConfig
from hetpipe.errors import ConfigError
from hetpipe.models.model_config import ModelConfig
# Siblings by their own path, not through the package, whose __init__ imports the solver.
import hetpipe.partitioner.cost as cost
import hetpipe.partitioner.schedule_model as schedule_model
from hetpipe.partitioner.cost_context import CostContext
from hetpipe.partitioner.inputs import TrainShape
from hetpipe.partitioner.plan_data import Plan, StagePlan
from hetpipe.partitioner.planner_config import PlannerConfig


def predicted_memory_gib(plan: Plan, model: ModelConfig, cluster: ClusterConfig, train: TrainShape,
                         planner: Optional[PlannerConfig] = None, cp_method: str = "allgather"
                         ) -> Optional[list[float]]:
    """Predicted peak GiB per device of each pipeline rank (stage) of ``plan``, or None
    where the cost model cannot price it: a schedule it does not model
    (interleaved_1f1b), or a device it cannot resolve (``device_type=auto`` on
    a device outside the catalog) - the plan may still run, it is just not predicted.
    Under context parallelism (the stages' ``cp``) a rank holds its ``s / CP``
    tokens' activations and ``cp_method``'s K/V buffers (partitioner/context_cost.py)."""
    if plan.schedule not in schedule_model.PLANNED_SCHEDULES:
        return None
    ctx = _context(model, cluster, train, planner, plan.stages[0].cp, cp_method)
    if ctx is None:
        return None
    microbatches = max(1, plan.microbatches(train))
    if schedule_model.is_v_shaped(plan.schedule):
        memory = _v_memory(ctx, plan, microbatches)
    else:
        memory = _contiguous_memory(ctx, plan, microbatches)
    return [float(m) / cost.GIB for m in memory]


def planned_capacity_gib(model: ModelConfig, cluster: ClusterConfig, train: TrainShape,
                         planner: Optional[PlannerConfig], group: str) -> Optional[float]:
    """The usable GiB per device the planner plans ``group``'s stages for: its device's
    memory (``planner.memory_gib``, else the catalog's) x ``planner.memory_headroom``."""
    ctx = _context(model, cluster, train, planner)
    if ctx is None or group not in ctx.names:
        return None
    return ctx.memory_gib(ctx.names.index(group)) * ctx.planner.memory_headroom


def _context(model: ModelConfig, cluster: ClusterConfig, train: TrainShape,
             planner: Optional[PlannerConfig], cp: int = 1, cp_method: str = "allgather") -> Optional[CostContext]:
    # planner.recompute constrains the search only; a fixed plan brings its own.
    planner = dataclasses.replace(planner or PlannerConfig(), recompute="auto")
    try:
        return CostContext(model, cluster, train, planner, cp, cp_method)
    except ConfigError:
        return None


def _contiguous_memory(ctx: CostContext, plan: Plan, microbatches: int) -> list[float]:
    P = plan.pipeline_size
    rows = schedule_model.memory_rows(plan.schedule, P, microbatches)
    out = []
    for k, (stage, units) in enumerate(zip(plan.stages, plan.unit_ranges())):
        b = _range_bytes(ctx, stage, units, P == 1)
        out.append(b.static + b.transient + float(schedule_model.peak_bytes(rows[k], [b.act], [b.kept], [b.wgrad],
                                                                           b.boundary)))
    return out


def _v_memory(ctx: CostContext, plan: Plan, microbatches: int) -> list[float]:
    """zb_v: rank k holds virtual stages k and 2P-1-k; its peak is the largest
    of its :func:`~hetpipe.partitioner.schedule_model.memory_rows` (v_split.price)."""
    P, placement, ranges = plan.pipeline_size, plan.placement, plan.unit_ranges()
    rows = schedule_model.memory_rows(plan.schedule, P, microbatches)
    out = []
    for k in range(P):
        a, b = (_range_bytes(ctx, plan.stages[s], ranges[s], False) for s in (placement.stage(k, c) for c in (0, 1)))
        held = schedule_model.peak_bytes(rows[k], [a.act, b.act], [a.kept, b.kept], [a.wgrad, b.wgrad], a.boundary)
        out.append(a.static + b.static + float(held) + max(a.transient, b.transient))
    return out


@dataclasses.dataclass
class _Bytes:
    """Per device of one stage: static, and per microbatch activation, zero
    bubble's kept and W bytes; transient; one boundary message."""
    static: float
    act: float
    kept: float
    wgrad: float
    transient: float
    boundary: float


def _range_bytes(ctx: CostContext, stage: StagePlan, units: tuple[int, int], alone: bool) -> _Bytes:
    """The bytes per device of ``stage`` holding model ``units``, its first
    ``recompute_num_layers`` layers recomputed.

    Every decoder layer saves the same activation bytes when recomputed, so
    recomputing n of L layers saves n/L of the whole range's saving - the
    planner's own rule for full recomputation of the first N layers
    (cost_context._fewest_full_layers)."""
    g = ctx.cluster.group_of(stage.ranks[0])[0]
    i, j = units
    mbs = ctx.train.micro_batch_size
    base = ctx.group_costs(g, stage.tp, stage.dp, mbs, "none", alone)
    layers = int(ctx.range_layers[i, j])
    covered = layers if stage.recompute_num_layers is None else min(stage.recompute_num_layers, layers)
    mode = base if stage.recompute == "none" or covered == 0 else \
        ctx.group_costs(g, stage.tp, stage.dp, mbs, stage.recompute, alone)
    act = base.act[i, j] - (covered / layers * (base.act[i, j] - mode.act[i, j]) if mode is not base else 0.0)
    return _Bytes(float(mode.static[i, j]), float(act), float(mode.kept[i, j]), float(mode.wgrad[i, j]),
                  float(mode.transient[i, j]), mode.boundary)
