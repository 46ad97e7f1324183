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

from hetpipe.cluster import ClusterConfig
from hetpipe.models.flops import megatron_model_flops
from hetpipe.models.model_config import ModelConfig
from hetpipe.models.recompute import RECOMPUTE_MODES
from hetpipe.partitioner import cost, schedule_model
from hetpipe.partitioner.cost_context import Candidate, CostContext
from hetpipe.partitioner.plan import Plan, StagePlan
from hetpipe.partitioner.split import Split


@dataclass
class StageReport:
    index: int
    group: str
    device_type: str
    ranks: list[int]
    tp: int
    dp: int
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
    schedule: str = "1f1b"
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
            "cross_vendor_transport": self.transport,
            "predicted_step_s_by_schedule": {o.schedule: None if o.step_s is None else _round(o.step_s)
                                             for o in self.schedule_options
                                             if o.schedule not in schedule_model.ESTIMATED_SCHEDULES},
        }
        estimated = {o.schedule: None if o.step_s is None else _round(o.step_s) for o in self.schedule_options
                     if o.schedule in schedule_model.ESTIMATED_SCHEDULES}
        if estimated:  # listed for comparison, never planned (schedule_model)
            notes["estimated_step_s_by_schedule"] = estimated
        if list(self.group_order) != [g.name for g in self.cluster.groups if g.name in self.group_order]:
            notes["reordered"] = ("the pipeline visits the groups in group_order, not in the cluster's "
                                  "order; ranks keep the cluster's numbering")
        if self.idle_ranks:
            notes["idle_ranks"] = list(self.idle_ranks)
        plan = Plan(stages=[StagePlan(group=s.group, ranks=list(s.ranks), layers=s.layers, tp=s.tp, dp=s.dp,
                                      recompute=s.recompute, recompute_num_layers=s.recompute_num_layers)
                            for s in self.stages],
                    schedule=self.schedule, num_chunks=1, notes=notes)
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


def build_solution(ctx: CostContext, cand: Candidate, split: Split, schedule: str = "1f1b") -> Solution:
    """The chosen plan under ``schedule``, stage by stage, with its predicted time and memory."""
    prob = ctx.problem(cand, schedule)
    sync, memory, capacity, links = prob.sync, prob.memory, prob.capacity, prob.links
    layout = cand.layout()
    P, M, T = len(layout), cand.num_microbatches, split.step_s
    alone = P == 1
    stages, used = [], set()
    for k, (g, j) in enumerate(layout):
        i, jj = split.bounds[k], split.bounds[k + 1]
        layers = (jj - i) - (i == 0) - (jj == ctx.num_units)
        mode = RECOMPUTE_MODES[prob.recompute[k, i, jj]] if layers else "none"
        covered = int(prob.recompute_layers[k, i, jj])
        # The stage's first `covered` layers run in `mode`, the rest and the other units without.
        uc = ctx.unit_costs(g, cand.tp[g], cand.micro_batch_size, "none", alone)
        rc = ctx.unit_costs(g, cand.tp[g], cand.micro_batch_size, mode, alone)
        first = i + (i == 0)
        busy = uc.forward_s + uc.backward_s
        busy[first:first + covered] = (rc.forward_s + rc.backward_s)[first:first + covered]
        tp_comm = uc.tp_comm_s.copy()
        tp_comm[first:first + covered] = rc.tp_comm_s[first:first + covered]
        n = cand.tp[g] * cand.dp
        ranks = [ctx.starts[g] + j * n + r for r in range(n)]
        used.update(ranks)
        compute = M * float(busy[i:jj].sum())
        comm = M * float(tp_comm[i:jj].sum()) + float(sync[k, i, jj])
        boundary = (links[k - 1] if k > 0 else 0.0) + (links[k] if k < P - 1 else 0.0)
        stages.append(StageReport(
            index=k, group=ctx.names[g], device_type=ctx.specs[g].name, ranks=ranks, tp=cand.tp[g], dp=cand.dp,
            layers=layers, units=(i, jj), recompute=mode if covered else "none",
            recompute_num_layers=covered if mode != "none" and covered < layers else None,
            compute_s=compute, comm_s=comm,
            p2p_s=2 * M * boundary, bubble_s=max(0.0, T - compute - comm),
            memory_gib=float(memory[k, i, jj]) / cost.GIB, usable_gib=float(capacity[k]) / cost.GIB,
            tflops_per_gpu=M * float(uc.flops[i:jj].sum()) / T / 1e12))
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
