"""CPU ranks share their host's memory: a plan whose CPU ranks will not fit in it together is refused before any starts.

A CPU rank's "device" is host RAM, which every CPU rank of the host and
everything else running there draw on. So the ranks a launcher starts on
CPUs (groups on ``CPU``, or ``device_type: auto`` on a machine without a GPU)
are checked together: the sum of their stages' predicted peaks
(:mod:`hetpipe.training.memory_fit`'s prediction, fp32 on CPUs) against what the
host has available now (/proc/meminfo's MemAvailable), with the same
allocator margin as a GPU. A group given an emulated capacity
(``planner.memory_gib.<group>``) is checked against that instead, by
:func:`hetpipe.training.memory_fit.check_local_fit`. A plan that does not fit is one
line with both figures and what would fit - less recomputed memory, bf16-pure,
a smaller preset, each predicted the same way - before any rank allocates
weights (``python -m hetpipe.pretrain +model=llama8b`` on a 24 GiB machine
used to be killed by the kernel's OOM killer after 148 s).

The prediction counts the model's tensors (weights, gradients, optimizer
state, activations, boundary messages), not the Python and torch runtime
of each rank process.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from hetpipe.devices.facts import host_memory_gib
from hetpipe.errors import ConfigError
from hetpipe.training.memory_fit import ALLOCATOR_MARGIN, declared_capacity, fits, predict, predicted_of
from hetpipe.models.model_config import model_preset, preset_names
from hetpipe.partitioner.plan_data import Plan
from hetpipe.partitioner.resolve import build_plan, with_recompute


def host_ranks(plan: Plan, cfg: Any) -> list[tuple[int, int]]:
    """(stage, rank) of every rank a local launch runs on this host's memory, undeclared."""
    gpus = torch.cuda.is_available()
    return [(stage, rank) for stage, st in enumerate(plan.stages[:plan.pipeline_size]) for rank in st.ranks
            if (cfg.cluster.group_of(rank)[1].on_cpu or not gpus)
            and declared_capacity(cfg, cfg.cluster.group_of(rank)[1]) is None]


def check_local_host_fit(plan: Plan, cfg: Any) -> None:
    """The local launcher's check of its CPU ranks together, before any rank starts."""
    check_host_fit(plan, cfg, host_ranks(plan, cfg))


def check_host_fit(plan: Plan, cfg: Any, ranks: list[tuple[int, int]]) -> None:
    """Refuse (ConfigError) ``ranks`` (stage, rank) of one host predicted not to fit its available memory."""
    if not ranks or not cfg.train.memory_check:
        return
    total = _total(plan, ranks)
    if total is None:
        return
    available = host_memory_gib()
    if not fits(total, available[1]):
        raise ConfigError(misfit_line(plan, cfg, ranks, total, available))


def check_node_host_fit(plan: Plan, cfg: Any, rank: int, node_ranks: list[int]) -> None:
    """Ranks no launcher checked (torchrun's): the first rank of a node checks the node's
    CPU ranks together, after the roll call and before it builds its weights (the others
    may have begun building theirs: a smaller window than none)."""
    if rank == min(node_ranks):
        check_host_fit(plan, cfg, [(s, r) for s, r in host_ranks(plan, cfg) if r in node_ranks])


def _total(plan: Plan, ranks: list[tuple[int, int]]) -> Optional[float]:
    """The ranks' predicted GiB together; None where the plan carries no prediction."""
    each = [predicted_of(plan, stage) for stage, _ in ranks]
    return None if any(p is None for p in each) else sum(each)


def misfit_line(plan: Plan, cfg: Any, ranks: list[tuple[int, int]], total: float,
                available: tuple[float, float]) -> str:
    who = f"the CPU rank of this host (rank {ranks[0][1]})" if len(ranks) == 1 else \
        f"the {len(ranks)} CPU ranks of this host (ranks {', '.join(str(r) for _, r in ranks)})"
    return (f"{who} {'is' if len(ranks) == 1 else 'are'} predicted to need {total:.1f} GiB of host memory "
            f"({cfg.model.name}{_overrides(cfg.model)}: weights, gradients, optimizer state, activations) but the host has "
            f"{available[1]:.1f} GiB available of {available[0]:.1f} (/proc/meminfo MemAvailable; "
            f"{available[1] / ALLOCATOR_MARGIN:.1f} after a {ALLOCATOR_MARGIN - 1:.0%} allocator margin): "
            f"{what_fits(plan, cfg, ranks, available[1])} (train.memory_check=false runs it anyway)")


def _overrides(model: Any) -> str:
    """`` with model.hidden_size=1048576 (the preset's 128)`` for each size that is not its preset's."""
    if model.name not in preset_names():
        return ""
    preset = model_preset(model.name)
    changed = [f"model.{f.name}={getattr(model, f.name)} (the preset's {getattr(preset, f.name)})"
               for f in dataclasses.fields(model) if getattr(model, f.name) != getattr(preset, f.name)]
    return f" with {', '.join(changed)}" if changed else ""


def what_fits(plan: Plan, cfg: Any, ranks: list[tuple[int, int]], available: float) -> str:
    """Each way out predicted on the same ranks: those that fit first, with their GiB."""
    tries = [(way, _total_of(plan2, cfg2, ranks)) for way, plan2, cfg2 in _alternatives(plan, cfg)]
    fit = [f"{way} ({gib:.2g} GiB)" for way, gib in tries if gib is not None and fits(gib, available)]
    short = [f"{way} ({gib:.1f} GiB)" for way, gib in tries
             if gib is not None and not fits(gib, available) and not way.startswith("+model=")]
    parts = ([f"would fit: {', '.join(fit)}"] if fit else []) + \
        ([f"not enough alone: {', '.join(short)}"] if short else []) + \
        ["also more pipeline stages on other hosts, or plan=auto (it searches splits, recomputation "
         "and schedules)"]
    return "; ".join(parts)


def _total_of(plan: Plan, cfg: Any, ranks: list[tuple[int, int]]) -> Optional[float]:
    predicted = predict(plan, cfg)
    return None if predicted is None else sum(predicted[stage] for stage, _ in ranks)


def _alternatives(plan: Plan, cfg: Any) -> list[tuple[str, Plan, Any]]:
    """(override, plan, config) for: the leanest recomputation (a plan from partition.*
    only: a planned one brings its own), bf16-pure, and each smaller preset evenly split."""
    out = []
    if cfg.plan is None:
        mode = "selective" if plan.spec.split_backward else "full"
        stages = [dataclasses.replace(s, recompute=mode, recompute_num_layers=None) for s in plan.stages]
        out.append((f"train.recompute={mode}", dataclasses.replace(plan, stages=stages), cfg))
    if cfg.train.precision != "bf16-pure":
        pure = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision="bf16-pure"))
        out.append(("train.precision=bf16-pure", plan, pure))
    return out + _smaller_presets(cfg)


def _smaller_presets(cfg: Any) -> list[tuple[str, Plan, Any]]:
    out = []
    partition = dataclasses.replace(cfg.partition, layers=None)
    for name in preset_names():
        model = model_preset(name)
        if model.num_parameters() >= cfg.model.num_parameters() or cfg.train.seq_length > model.max_position_embeddings:
            continue
        smaller = dataclasses.replace(cfg, model=model, partition=partition, plan=None)
        try:
            plan = with_recompute(build_plan(partition, cfg.cluster, model), cfg.train.recompute,
                                  cfg.train.recompute_num_layers)
        except ConfigError:  # this cluster cannot split that preset
            continue
        out.append((f"+model={name}", plan, smaller))
    return out
