"""The planner's side of scripts/bench_pp2_llm.py: each run's split as the planner
chooses it (layers and recomputation per stage), and its prediction for a plan a
run used. Apart from the bench driver so that it stays one job (running variants)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple, Optional

from omegaconf import OmegaConf

from hetpipe.errors import ConfigError, HetpipeError
from hetpipe.partitioner.plan_data import Plan
from hetpipe.partitioner.resolve import build_plan
from hetpipe.partitioner.schedule_model import PLANNED_SCHEDULES
from hetpipe.partitioner.solver import plan_for, solve
from hetpipe.schema.pretrain_config import PretrainConfig, resolve


class Split(NamedTuple):
    """A run's decoder layers per virtual stage and, where the planner chose it,
    each stage's recomputation (``train.recompute`` / ``train.recompute_num_layers``
    as per-stage lists; None: the run's own setting)."""
    layers: list[int]
    recompute: Optional[list[str]] = None
    recompute_num_layers: Optional[list] = None

    def overrides(self) -> list[str]:
        out = [f"partition.layers=[{','.join(map(str, self.layers))}]"]
        if self.recompute is not None:
            counts = ",".join("null" if n is None else str(n) for n in self.recompute_num_layers)
            out += [f"train.recompute=[{','.join(self.recompute)}]", f"train.recompute_num_layers=[{counts}]"]
        return out

    def describe(self) -> str:
        """``17,15`` or, with recomputation, ``17,15 (recompute full 6/17, none)``."""
        text = ",".join(map(str, self.layers))
        if self.recompute is None or set(self.recompute) == {"none"}:
            return text
        stages = [m if m == "none" or n is None else f"{m} {n}/{k}"
                  for m, n, k in zip(self.recompute, self.recompute_num_layers, self.layers)]
        return f"{text} (recompute {', '.join(stages)})"


def predicted(run_dir: Path):
    """The planner's solution for the plan a run used: same split, TP, DP,
    group order, transport and optimizer sharding (``python -m hetpipe.plan``
    with those fixed). Returns (solution, "") or (None, why not)."""
    try:
        cfg = resolve(OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml")))
        plan = Plan.load(run_dir / "plan.yaml")
    except (OSError, HetpipeError) as exc:
        return None, f"no run config: {exc}"
    physical = plan.stages[: plan.pipeline_size]  # the first P virtual stages: ranks 0..P-1
    tps = {s.tp for s in physical}
    if len(tps) > 1:
        return None, "the planner fixes one TP degree for all groups"
    if plan.schedule not in PLANNED_SCHEDULES:
        return None, f"the planner does not model {plan.schedule}"
    kind = cfg.cluster.transport.kind
    planner = dataclasses.replace(
        # A run that recomputes ran the planner's per-stage choice for its split, which the
        # solver finds again for the same split (bench --layers auto); otherwise none.
        cfg.planner, tp=tps.pop(), dp=physical[0].dp, schedule=plan.schedule,
        recompute="auto" if any(s.recompute != "none" for s in plan.stages) else "none",
        stages=[sum(s.group == g.name for s in physical) for g in cfg.cluster.groups],
        group_order=list(dict.fromkeys(s.group for s in physical)),
        transport="direct" if kind == "direct" else "cpu_forwarding",
        distributed_optimizer=cfg.optimizer.distributed)
    try:
        return solve(cfg.model, cfg.cluster, cfg.train, planner, [s.layers for s in plan.stages]), ""
    except HetpipeError as exc:
        return None, str(exc)


def planned_split(cfg: PretrainConfig) -> Split:
    """The planner's split for a run: decoder layers per virtual stage, in pipeline
    order, for the layout its partition settings make (stages per group, TP, DP,
    group order) under its schedule and optimizer sharding, with each stage's
    recomputation as the planner chooses it (as plan=auto does) unless the run
    fixes one mode (train.recompute); the cluster's device types resolve as
    plan=auto resolves them (auto: detected)."""
    layout = build_plan(dataclasses.replace(cfg.partition, layers=None), cfg.cluster, cfg.model)
    physical = layout.stages[: layout.pipeline_size]
    tps = {s.tp for s in physical}
    if len(tps) > 1:
        raise ConfigError(f"the planner fixes one TP degree for all groups, not {sorted(tps)}")
    recompute = cfg.train.recompute or "auto"
    if not isinstance(recompute, str):
        raise ConfigError(f"the planner takes one recomputation mode, not train.recompute={list(recompute)}")
    planner = dataclasses.replace(
        cfg.planner, schedule=cfg.partition.schedule, recompute=recompute, tp=tps.pop(), dp=physical[0].dp,
        stages=[sum(s.group == g.name for s in physical) for g in cfg.cluster.groups],
        group_order=list(dict.fromkeys(s.group for s in physical)), micro_batch_sizes=None,
        distributed_optimizer=cfg.optimizer.distributed)
    stages = plan_for(cfg.model, cfg.cluster, cfg.train, planner).stages
    if cfg.train.recompute is not None:  # the run's own mode, as it set it
        return Split([s.layers for s in stages])
    return Split([s.layers for s in stages], [s.recompute for s in stages],
                 [s.recompute_num_layers for s in stages])


def ran_split(run_dir: Path) -> tuple[Optional[Split], str]:
    """The split and schedule a run chose for itself (plan=auto), from the plan it
    wrote: (Split, "zb_v: "), or (None, "") before it wrote one."""
    try:
        plan = Plan.load(run_dir / "plan.yaml")
    except (OSError, HetpipeError):
        return None, ""
    return Split([s.layers for s in plan.stages], [s.recompute for s in plan.stages],
                 [s.recompute_num_layers for s in plan.stages]), f"{plan.schedule}: "
