"""What the planner tells its user: the chosen plan stage by stage, its predictions, and the plan as data.

The search ends with one candidate and its split; :func:`build_solution`
prices it once more in full (compute, collectives, boundary messages, bubble,
memory and TFLOP/s per stage) for ``python -m hetpipe.plan``'s table, and
:meth:`Solution.to_plan` turns it into the :class:`Plan` that ``pretrain``
runs, with the predictions in its notes. :class:`ScheduleOption` is the
one-line summary of the best plan under each schedule the search considered.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from hetpipe.devices.cluster import ClusterConfig
from hetpipe.models.flops import megatron_model_flops
from hetpipe.models.model_config import ModelConfig
from hetpipe.models.train_modes import RECOMPUTE_MODES
# Siblings by their own path, not through the package, whose __init__ imports the solver.
import hetpipe.partitioner.cost as cost
import hetpipe.partitioner.schedule_model as schedule_model
import hetpipe.partitioner.v_split as v_split
from hetpipe.partitioner.cost_context import Candidate, CostContext
from hetpipe.partitioner.plan_data import Plan, StagePlan
from hetpipe.partitioner.split import Split
from hetpipe.pipeline.placement import Placement
from hetpipe.pipeline.registry import DEFAULT_SCHEDULE, schedule_spec


@dataclass
class StageReport:
    index: int
    group: str
    device_type: str
    ranks: list[int]
    tp: int
    dp: int
    # Context-parallel degree (ranks are TP x CP x DP: partitioner/plan_data.py).
    cp: int
    # Decoder layers and [start, stop) model units of the stage; under zb_v the
    # rank's, over its two chunks (chunk_layers, chunk_units: virtual stages
    # r and 2P - 1 - r), and units is its first chunk's.
    layers: int
    units: tuple[int, int]
    # Activation recomputation: none, selective or full, of the first
    # recompute_num_layers layers (None: all of them).
    recompute: str
    recompute_num_layers: Optional[int]
    # Per step: forward + backward (and recomputation) of all microbatches.
    compute_s: float
    # Per step, not overlapped with compute: TP collectives and the DP gradient sync + optimizer step.
    comm_s: float
    # Per step: this stage's boundary messages, overlapped with compute by the engine.
    p2p_s: float
    # Per step: the rest of the step time (pipeline fill, drain, waiting on the bottleneck).
    bubble_s: float
    memory_gib: float
    usable_gib: float
    tflops_per_gpu: float
    chunk_layers: tuple[int, ...] = ()
    chunk_units: tuple[tuple[int, int], ...] = ()


@dataclass
class Solution:
    model: ModelConfig
    cluster: ClusterConfig
    candidate: Candidate
    split: Split
    stages: list[StageReport]
    step_s: float
    tflops_per_gpu: float
    tokens_per_s: float
    gpus_used: int
    group_order: list[str]
    cost_source: dict[str, str]
    # Catalog key of each group's devices (``auto`` resolved).
    device_types: dict[str, str]
    transport: str
    idle_ranks: list[int]
    global_batch_size: int
    seq_length: int
    # The pipeline schedule the stages run (schedule_model.PLANNED_SCHEDULES).
    schedule: str = DEFAULT_SCHEDULE
    # The best plan under each schedule considered, this one's included.
    schedule_options: list["ScheduleOption"] = field(default_factory=list)
    # How many candidates the search solved exactly (the rest were pruned by their bound).
    candidates_solved: int = 0
    candidates_total: int = 0

    def to_plan(self) -> Plan:
        cand = self.candidate
        notes: dict[str, Any] = {
            "planner": "python -m hetpipe.plan",
            "micro_batch_size": cand.micro_batch_size,
            "num_microbatches": cand.num_microbatches,
            "global_batch_size": self.global_batch_size,
            "seq_length": self.seq_length,
            "group_order": list(self.group_order),
            "predicted_step_s": _round(self.step_s),
            "predicted_tflops_per_gpu": _round(self.tflops_per_gpu),
            "predicted_tokens_per_s": _round(self.tokens_per_s),
            "cost_source": dict(self.cost_source),
            # What each group was planned for, auto resolved: its ranks check their devices against it.
            "device_types": dict(self.device_types),
            "cross_vendor_transport": self.transport,
            "predicted_step_s_by_schedule": {o.schedule: None if o.step_s is None else _round(o.step_s)
                                             for o in self.schedule_options},
        }
        if list(self.group_order) != [g.name for g in self.cluster.groups if g.name in self.group_order]:
            notes["reordered"] = ("the pipeline visits the groups in group_order, not in the cluster's "
                                  "order; ranks keep the cluster's numbering")
        if self.idle_ranks:
            notes["idle_ranks"] = list(self.idle_ranks)
        chunks = schedule_spec(self.schedule).chunks
        placement = Placement(self.schedule, len(self.stages), chunks)
        virtual = []
        for v in range(placement.num_stages):
            rank, chunk = placement.location(v)
            s = self.stages[rank]
            virtual.append(StagePlan(group=s.group, ranks=list(s.ranks), layers=s.chunk_layers[chunk], tp=s.tp,
                                     dp=s.dp, cp=s.cp, recompute=s.recompute,
                                     recompute_num_layers=s.recompute_num_layers if chunks == 1 else None))
        plan = Plan(stages=virtual, schedule=self.schedule, num_chunks=chunks, notes=notes)
        plan.check_model(self.model.num_layers)
        return plan


@dataclass(frozen=True)
class ScheduleOption:
    """The best plan under one schedule, as ``python -m hetpipe.plan`` lists it."""
    schedule: str
    # None: no plan fits memory under this schedule.
    step_s: Optional[float]
    # The idle time of the busiest stage: step less its compute and comm.
    bubble_s: float = 0.0
    # The fullest stage's memory per device, against its usable memory.
    memory_gib: float = 0.0
    usable_gib: float = 0.0

    @classmethod
    def of(cls, s: "Solution") -> "ScheduleOption":
        fullest = max(s.stages, key=lambda st: st.memory_gib / st.usable_gib)
        return cls(s.schedule, s.step_s, min(st.bubble_s for st in s.stages), fullest.memory_gib,
                   fullest.usable_gib)


def build_solution(ctx: CostContext, cand: Candidate, split: Split, schedule: str = DEFAULT_SCHEDULE) -> Solution:
    """The chosen plan under ``schedule``, stage by stage, with its predicted time and memory."""
    layout = cand.layout()
    P, M, T = len(layout), cand.num_microbatches, split.step_s
    bounds = list(split.bounds)
    alone = P == 1 and not schedule_model.is_v_shaped(schedule)
    if schedule_model.is_v_shaped(schedule):
        facts = [(list(r.ranges), r.memory, r.capacity, r.sync_s, r.mode, r.covered)
                 for r in v_split.price(schedule, ctx, cand, bounds)]
        links = [schedule_model.boundary_messages(schedule) * c for c in v_split.message_s(ctx, cand)]
    else:
        prob = ctx.problem(cand, schedule)
        links = prob.links
        facts = []
        for k in range(P):
            i, j = bounds[k], bounds[k + 1]
            facts.append(([(i, j)], prob.memory[k, i, j], prob.capacity[k], prob.sync[k, i, j],
                          prob.recompute[k, i, j], prob.recompute_layers[k, i, j]))
    stages, used = [], set()
    for k, (g, j) in enumerate(layout):
        ranges, memory, capacity, sync, mode_index, covered = facts[k]
        chunk_layers = tuple(int(ctx.range_layers[a, b]) for a, b in ranges)
        layers = sum(chunk_layers)
        mode = RECOMPUTE_MODES[mode_index] if layers else "none"
        covered = int(covered)
        # The stage's first `covered` layers run in `mode`, the rest and the other units without.
        uc = ctx.unit_costs(g, cand.tp[g], cand.micro_batch_size, "none", alone)
        rc = ctx.unit_costs(g, cand.tp[g], cand.micro_batch_size, mode, alone)
        busy, tp_comm, units = uc.forward_s + uc.backward_s, uc.tp_comm_s.copy(), np.zeros(ctx.num_units, bool)
        left = covered
        for a, b in ranges:
            first = a + (a == 0)
            n = min(left, int(ctx.range_layers[a, b]))
            busy[first:first + n] = (rc.forward_s + rc.backward_s)[first:first + n]
            tp_comm[first:first + n] = rc.tp_comm_s[first:first + n]
            units[a:b], left = True, left - n
        n = cand.tp[g] * ctx.cp * cand.dp
        ranks = [ctx.starts[g] + j * n + r for r in range(n)]
        used.update(ranks)
        compute = M * float(busy[units].sum())
        comm = M * float(tp_comm[units].sum()) + float(sync)
        boundary = (links[k - 1] if k > 0 else 0.0) + (links[k] if k < P - 1 else 0.0)
        stages.append(StageReport(
            index=k, group=ctx.names[g], device_type=ctx.specs[g].name, ranks=ranks, tp=cand.tp[g], dp=cand.dp,
            cp=ctx.cp,
            layers=layers, units=ranges[0], recompute=mode if covered else "none",
            recompute_num_layers=covered if mode != "none" and covered < layers else None,
            compute_s=compute, comm_s=comm,
            p2p_s=2 * M * boundary, bubble_s=max(0.0, T - compute - comm),
            memory_gib=float(memory) / cost.GIB, usable_gib=float(capacity) / cost.GIB,
            tflops_per_gpu=M * float(uc.flops[units].sum()) / T / 1e12,
            chunk_layers=chunk_layers, chunk_units=tuple(ranges)))
    gbs, seq = ctx.train.global_batch_size, ctx.train.seq_length
    world = ctx.cluster.world_size
    return Solution(
        model=ctx.model, cluster=ctx.cluster, candidate=cand, split=split, stages=stages, step_s=T,
        tflops_per_gpu=megatron_model_flops(ctx.model, gbs, seq) / T / len(used) / 1e12,
        tokens_per_s=gbs * seq / T, gpus_used=len(used), group_order=[ctx.names[g] for g in cand.order],
        cost_source=dict(ctx.cost_source), device_types=dict(zip(ctx.names, ctx.device_types)),
        transport=ctx.transport, schedule=schedule,
        idle_ranks=[r for r in range(world) if r not in used], global_batch_size=gbs, seq_length=seq)


def _round(x: float) -> float:
    return float(f"{x:.4g}")
