"""The plan's one way from a run's config to the engine: choose it, then check it.

A run's plan comes from one of three places - the explicit ``partition``
overrides (:func:`build_plan`), the cost-model planner (``plan=auto``) or a
plan.yaml (``plan=PATH``) - and whichever it is, :func:`check_runnable` then
refuses what this release cannot run. :func:`resolve_plan` is the entry
point ``pretrain`` calls once, before any process starts; the ranks then
receive the resolved plan as data, activation recomputation per stage included.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from hetpipe.devices.cluster import ClusterConfig
from hetpipe.errors import ConfigError
from hetpipe.models.model_config import ModelConfig
from hetpipe.models.parallelize import check_tensor_parallel
from hetpipe.partitioner.inputs import PartitionRequest, PlanRequest, TrainShape
from hetpipe.partitioner.plan_data import Plan, StagePlan, even_split
from hetpipe.partitioner.solver import plan_for
from hetpipe.pipeline.placement import Placement
from hetpipe.pipeline.registry import schedule_spec


def group_tp_degrees(partition: PartitionRequest, cluster: ClusterConfig) -> list[int]:
    """TP degree of each cluster group from ``partition.tp`` / ``partition.tp_per_group``."""
    if partition.tp_per_group is None:
        return [partition.tp] * len(cluster.groups)
    if len(partition.tp_per_group) != len(cluster.groups):
        raise ConfigError(f"partition.tp_per_group={list(partition.tp_per_group)} has "
                          f"{len(partition.tp_per_group)} entries but cluster {cluster.name!r} has "
                          f"{len(cluster.groups)} groups ({', '.join(g.name for g in cluster.groups)})")
    return list(partition.tp_per_group)


def group_cp_degree(partition: PartitionRequest, cluster: ClusterConfig) -> int:
    """The one CP degree of every group, from ``partition.cp`` / ``partition.cp_per_group``.

    A stage boundary carries CP rank i's slice of the sequence to CP rank i of
    the next stage; the channel does not reshard a slice, so groups with
    different degrees are refused (in one line, before any process starts)."""
    per_group = getattr(partition, "cp_per_group", None)
    if per_group is None:
        return getattr(partition, "cp", 1)
    if len(per_group) != len(cluster.groups):
        raise ConfigError(f"partition.cp_per_group={list(per_group)} has {len(per_group)} entries but cluster "
                          f"{cluster.name!r} has {len(cluster.groups)} groups")
    if len(set(per_group)) > 1:
        raise ConfigError(f"partition.cp_per_group={list(per_group)}: every vendor group must use the same CP "
                          "degree (a stage boundary hands CP rank i's slice to CP rank i; the channel does "
                          "not reshard the sequence)")
    return per_group[0]


def build_plan(partition: PartitionRequest, cluster: ClusterConfig, model: ModelConfig) -> Plan:
    """The plan from explicit overrides. Each vendor group is cut into
    ``ranks / (TP x DP)`` pipeline stages of consecutive ranks (TP fastest,
    then DP, as in Megatron's rank order), groups in cluster order; decoder
    layers per stage from ``partition.layers`` or an even split."""
    tps = group_tp_degrees(partition, cluster)
    dp, cp = partition.dp, group_cp_degree(partition, cluster)
    physical: list[tuple[str, list[int], int]] = []
    for i, g in enumerate(cluster.groups):
        per_stage = tps[i] * cp * dp
        if g.size % per_stage:
            shape = f"TP{tps[i]} x CP{cp} x DP{dp}" if cp > 1 else f"TP{tps[i]} x DP{dp}"
            raise ConfigError(f"group {g.name!r} has {g.size} ranks, not a multiple of {shape} = "
                              f"{per_stage}; every stage of a group needs {'TP x CP x DP' if cp > 1 else 'TP x DP'} ranks")
        start = cluster.group_ranks(i)[0]
        for j in range(g.size // per_stage):
            physical.append((g.name, list(range(start + j * per_stage, start + (j + 1) * per_stage)), tps[i]))
    p = len(physical)
    if partition.num_chunks > 1 and p == 1 and schedule_spec(partition.schedule).chunks is None:  # interleaving
        raise ConfigError("partition.num_chunks > 1 (interleaving) needs at least two pipeline stages")
    placement = Placement(partition.schedule, p, partition.num_chunks)
    virtual = p * partition.num_chunks
    layers = list(partition.layers) if partition.layers is not None else even_split(model.num_layers, virtual)
    if len(layers) != virtual:
        raise ConfigError(f"partition.layers={layers} has {len(layers)} entries but cluster {cluster.name!r} "
                          f"gives {p} pipeline stage(s) (TP {tps}, DP {dp}) x num_chunks={partition.num_chunks} "
                          f"= {virtual} (virtual) stages")
    stages = []
    for v, n in enumerate(layers):
        group, ranks, tp = physical[placement.rank_of(v)]
        stages.append(StagePlan(group=group, ranks=list(ranks), layers=n, tp=tp, dp=dp, cp=cp))
    plan = Plan(stages=stages, schedule=partition.schedule, num_chunks=partition.num_chunks)
    plan.check_model(model.num_layers)
    return plan


def with_recompute(plan: Plan, recompute: Any, num_layers: Any) -> Plan:
    """``plan`` with ``train.recompute`` and ``train.recompute_num_layers`` set
    on its stages: one value for every stage, or a list with one per (virtual)
    stage in pipeline order; None: no recomputation, all layers."""
    modes = _per_stage(recompute, "none", "train.recompute", plan)
    counts = _per_stage(num_layers, None, "train.recompute_num_layers", plan)
    stages = [dataclasses.replace(s, recompute=m, recompute_num_layers=n)
              for s, m, n in zip(plan.stages, modes, counts)]
    return dataclasses.replace(plan, stages=stages)


def _per_stage(value: Any, default: Any, name: str, plan: Plan) -> list:
    if value is None:
        return [default] * len(plan.stages)
    if not isinstance(value, (list, tuple)):
        return [value] * len(plan.stages)
    if len(value) != len(plan.stages):
        raise ConfigError(f"{name}={list(value)} has {len(value)} entries but the plan has {len(plan.stages)} "
                          f"(virtual) stages (layers {[s.layers for s in plan.stages]})")
    return list(value)


def check_context_parallel(plan: Plan, train: TrainShape) -> None:
    """One CP degree on every stage (a boundary hands CP rank i's slice to CP
    rank i; the channel does not reshard), dividing the sequence into 2 x CP chunks."""
    cps = sorted({s.cp for s in plan.stages})
    if len(cps) > 1:
        raise ConfigError(f"plan stages use different context-parallel degrees {cps}; a stage boundary hands CP "
                          "rank i's slice to CP rank i of the next stage and the channel does not reshard, "
                          "so CP must be equal across stages (and vendor groups)")
    if cps[0] > 1 and train.seq_length % (2 * cps[0]):
        raise ConfigError(f"train.seq_length={train.seq_length} must be a multiple of 2 x CP{cps[0]} = "
                          f"{2 * cps[0]} (each CP rank holds two equal chunks of the sequence)")


def resolve_plan(cfg: PlanRequest) -> Plan:
    """The plan a pretrain config asks for: ``plan=auto`` (the cost-model
    planner, recomputation chosen per stage), ``plan=PATH`` (a plan.yaml), or
    the explicit ``partition`` settings with ``train.recompute``."""
    t = cfg.train
    if cfg.plan is None:
        plan = with_recompute(build_plan(cfg.partition, cfg.cluster, cfg.model), t.recompute,
                              t.recompute_num_layers)
    elif t.recompute is not None or t.recompute_num_layers is not None:
        raise ConfigError(f"plan={cfg.plan} brings its own recomputation per stage; leave train.recompute and "
                          "train.recompute_num_layers null (planner.recompute constrains the planner's choice)")
    elif cfg.plan == "auto":
        # Sequence parallelism and CP both split the sequence: the runtime runs one of them.
        planner = dataclasses.replace(cfg.planner, cp=1) if getattr(cfg.partition, "sequence_parallel", False) \
            else cfg.planner
        plan = plan_for(cfg.model, cfg.cluster, cfg.train, planner, cp_method=cfg.partition.cp_method)
    else:
        plan = Plan.load(cfg.plan)
    plan.check_model(cfg.model.num_layers)
    check_runnable(plan, cfg.cluster, cfg.train, cfg.model)
    return plan


def check_runnable(plan: Plan, cluster: ClusterConfig, train: TrainShape,
                   model: Optional[ModelConfig] = None) -> None:
    """Refuse plans this release cannot run, each with one sentence naming the problem."""
    world = cluster.world_size
    seen: dict[int, int] = {}
    placement = plan.placement
    for v, stage in enumerate(plan.stages):
        if len(stage.ranks) != stage.tp * stage.cp * stage.dp:
            raise ConfigError(f"plan stage {v} has {len(stage.ranks)} ranks {stage.ranks} but TP{stage.tp} x "
                              f"CP{stage.cp} x DP{stage.dp} needs {stage.tp * stage.cp * stage.dp}")
        for r in stage.ranks:
            if not 0 <= r < world:
                raise ConfigError(f"plan stage {v} uses rank {r}, outside cluster {cluster.name!r} "
                                  f"of {world} ranks")
            if cluster.group_of(r)[1].name != stage.group:
                raise ConfigError(f"plan stage {v} is on group {stage.group!r} but its rank {r} belongs to "
                                  f"{cluster.group_of(r)[1].name!r}")
        rank, chunk = placement.location(v)
        if chunk > 0:
            home = placement.stage(rank, 0)
            first = plan.stages[home]
            if stage.ranks != first.ranks or stage.tp != first.tp:
                raise ConfigError(f"plan virtual stage {v} must sit on the ranks of stage {home} "
                                  f"({first.ranks}, TP{first.tp}) with num_chunks={plan.num_chunks} "
                                  f"under {plan.schedule}")
            continue
        for r in stage.ranks:
            if r in seen:
                raise ConfigError(f"rank {r} is in both plan stage {seen[r]} and stage {v}")
            seen[r] = v
    idle = [r for r in range(world) if r not in seen]
    if idle:
        raise ConfigError(f"the plan leaves rank(s) {idle} of cluster {cluster.name!r} idle; this release needs "
                          "every rank in a stage (shrink the cluster or change the plan)")
    dps = sorted({s.dp for s in plan.stages})
    if len(dps) > 1:
        raise ConfigError(f"plan stages use different data-parallel degrees {dps}; DP must be equal across "
                          "stages (each stage is replicated DP times and every replica runs the whole pipeline)")
    dp = dps[0]
    check_context_parallel(plan, train)
    if train.global_batch_size % (train.micro_batch_size * dp):
        raise ConfigError(f"train.global_batch_size={train.global_batch_size} is not a multiple of "
                          f"micro_batch_size={train.micro_batch_size} x DP{dp}")
    if model is not None:
        for tp in sorted({s.tp for s in plan.stages}):
            check_tensor_parallel(model, tp)
        if model.share_embeddings_and_output_weights and plan.stages[0].tp != plan.stages[-1].tp:
            raise ConfigError(f"model {model.name!r} ties its embedding and output weights, so the first and "
                              f"last stage need the same TP degree (got TP{plan.stages[0].tp} and "
                              f"TP{plan.stages[-1].tp})")
    recomputing = [v for v, s in enumerate(plan.stages)
                   if s.recompute != "none" and s.layers and s.recompute_num_layers != 0]
    if recomputing and train.compile:
        # Full recomputation reinstalls the forward's bf16 weights for the
        # rerun through checkpoint's context_fn, which torch.compile refuses.
        raise ConfigError(f"plan stage(s) {recomputing} recompute activations, which this release does not run "
                          "with train.compile=true (whole compiled layers); set train.compile=false or recompute none")
    if recomputing and train.precision == "fp8":
        # fp8 compiles the decoder layers on GPUs (models/fp8.py: compiles_layers).
        raise ConfigError(f"plan stage(s) {recomputing} recompute activations, which this release does not run "
                          "with train.precision=fp8 (compiled layers); set recompute none")
    mbs = plan.notes.get("micro_batch_size") if plan.notes else None
    if mbs is not None and mbs != train.micro_batch_size:
        raise ConfigError(f"the plan was made for micro_batch_size={mbs} but train.micro_batch_size="
                          f"{train.micro_batch_size}; set train.micro_batch_size={mbs}")
