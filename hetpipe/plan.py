"""``python -m hetpipe.plan +model=NAME cluster=NAME [overrides]``: choose a plan, print it, write plan.yaml.

Users of mixed clusters ask which split and parallelism to use; this answers
with the cost-model partitioner (``hetpipe.partitioner.solver``): a table of
stages (group, devices, TP x DP, layers, predicted compute / communication /
bubble, memory per device, TFLOP/s per GPU) and a ``plan.yaml`` that
``pretrain plan=PATH`` runs. ``partition.layers=[15,17]`` predicts a given
split instead of searching one; ``-m`` sweeps clusters, models and splits.

``python -m hetpipe.plan profile +model=NAME [train.seq_length=...]`` measures
the model's units on this machine's device (the decoder layer also under each
activation-recomputation mode) and adds them to a profile JSON
(``profiling.output``) that ``planner.profile=PATH`` feeds back to the planner.

The config composes like pretrain's (the same ``model``, ``cluster`` and
``train`` groups and schemas); problems with the input end in one
``hetpipe: error:`` line and exit status 2.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import hydra
from omegaconf import MISSING, DictConfig

from hetpipe.devices.cluster import ClusterConfig
from hetpipe.devices.facts import local_device_type
from hetpipe.errors import ConfigError, run_cli, run_hydra_cli
from hetpipe.models.model_config import ModelConfig
from hetpipe.devices.catalog import catalog_with
from hetpipe.partitioner.planner_config import PlannerConfig
from hetpipe.partitioner import schedule_model
from hetpipe.partitioner.report import Solution
from hetpipe.partitioner.solver import solve
from hetpipe.pipeline.registry import DEFAULT_SCHEDULE
from hetpipe.schema.pretrain_config import PartitionConfig, TrainConfig, register_configs, resolve

MODES = ("plan", "profile")


@dataclass
class ProfilingConfig:
    # Profile JSON to create or extend (one entry per device type and shape).
    output: str = "profile.json"
    # Microbatches per unit, run back to back: warmup untimed, then repeats
    # timed (their mean is kept). On one H100 a LLaMA-3-8B layer timed over
    # 40 came within 1.5 % of scripts/bench_layer.py's figure, over 10 within
    # 3.5 % (the GPU slows as the load goes on; docs/benchmarks.md).
    repeats: int = 40
    # Untimed microbatches before the timed repeats.
    warmup: int = 3
    # ... and the warm-up microbatches repeat for at least this long (GPUs
    # only): LLaMA-3-8B's layer timed after a 0.3 s burst came out 7 % faster
    # on one H100 than bench_layer's sustained 1.3 s run; after 30 s its
    # forward and backward took 1.8 and 1.3 % longer than after 3 s, the head
    # 3.4 % (seq 4096, bf16-pure): at 700 W the clock fell from 1980 to about
    # 1600 MHz within 30 s and to 1500 as the GPU reached 70 C in a bench
    # (docs/benchmarks.md). 3 s left two-GPU steps 4.5-5.3 % longer than
    # predicted. Each unit warms up this long: a LLaMA-3-8B profile took
    # 203-235 s on an H100 with 30 s, 44-66 s on an H200 with 3 s.
    warmup_s: float = 30.0
    # Catalog key to file the measurement under; None detects this machine's device.
    device_type: Optional[str] = None


@dataclass
class PlanConfig:
    model: ModelConfig = MISSING
    # seq_length, micro_batch_size, global_batch_size and precision shape the costs.
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    # partition.layers fixes the split (the planner predicts it); planner.schedule the schedule.
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    # Where the plan is written.
    output: str = "plan.yaml"
    # plan, or profile (what a leading `profile` argument selects).
    mode: str = "plan"
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r} is not one of {MODES}")
        if self.train.seq_length > self.model.max_position_embeddings:
            raise ConfigError(
                f"train.seq_length={self.train.seq_length} exceeds model {self.model.name!r}'s "
                f"max_position_embeddings={self.model.max_position_embeddings}")
        if self.mode == "plan" and (self.train.recompute is not None or self.train.recompute_num_layers is not None):
            raise ConfigError("the planner chooses each stage's recomputation; constrain it with planner.recompute "
                              "(auto, none, selective or full), not train.recompute")
        if self.mode == "plan" and (self.partition.schedule != DEFAULT_SCHEDULE or self.partition.num_chunks != 1):
            *first, last = schedule_model.PLANNED_SCHEDULES
            raise ConfigError(f"the planner chooses the schedule (without interleaving): set planner.schedule "
                              f"(auto, {', '.join(first)} or {last}), not "
                              f"partition.schedule={self.partition.schedule} "
                              f"or partition.num_chunks={self.partition.num_chunks}")


def register_plan_config() -> None:
    """Put the schema into hydra's ConfigStore (idempotent), next to pretrain's."""
    from hydra.core.config_store import ConfigStore

    register_configs()
    ConfigStore.instance().store(name="plan_schema", node=PlanConfig)


def resolve_plan_config(cfg: DictConfig | dict[str, Any]) -> PlanConfig:
    """Turn a composed config into checked dataclass objects, or raise ConfigError."""
    return resolve(cfg, PlanConfig)


def run_plan(cfg: PlanConfig) -> Solution:
    """Solve, print the table, write the plan."""
    layers = list(cfg.partition.layers) if cfg.partition.layers is not None else None
    solution = solve(cfg.model, cfg.cluster, cfg.train, cfg.planner, layers)
    plan = solution.to_plan()
    print(format_solution(solution), flush=True)
    out = Path(cfg.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    plan.save(out)
    print(f"wrote {out}", flush=True)
    return solution


def run_profile(cfg: PlanConfig) -> None:
    """Measure the units on this machine and file them in the profile JSON."""
    from hetpipe.partitioner.profile import measure_units, save_entry  # torch: only this mode measures

    p = cfg.profiling
    name, entry = measure_units(cfg.model, cfg.train.seq_length, cfg.train.micro_batch_size,
                                cfg.train.precision, repeats=p.repeats, warmup=p.warmup, seed=cfg.train.seed,
                                warmup_s=p.warmup_s, fuse_elementwise=cfg.train.fuse_elementwise,
                                fp8_recipe=cfg.train.fp8_recipe)
    # Filed under the key every rank's roll call and plan=auto detect (hetpipe/devices/facts.py).
    device_type = p.device_type or local_device_type(catalog_with(dict(cfg.planner.catalog or {})))[0]
    if not device_type:
        raise ConfigError(f"this machine's {name!r} is not in the device catalog: name it with "
                          "profiling.device_type=NAME (and add it with planner.catalog.NAME={...})")
    save_entry(p.output, device_type, entry)
    shape = entry["shape"]
    print(f"hetpipe profile: {cfg.model.name} on {name} ({device_type}), microbatch "
          f"{entry['micro_batch_size']} x {shape['seq_length']} tokens, {shape['precision']}")
    rows = [*entry["units"].items(), *((f"layer ({rc})", m) for rc, m in entry["recompute"].items())]
    for kind, m in rows:
        peak = f", peak {m['peak_bytes'] / 2**20:.1f} MiB" if m["peak_bytes"] is not None else ""
        print(f"  {kind:<17} forward {m['forward_s'] * 1e3:9.3f} ms  backward {m['backward_s'] * 1e3:9.3f} ms  "
              f"kept {m['activation_bytes'] / 2**20:9.2f} MiB{peak}")
    print(f"wrote {p.output}", flush=True)


def format_solution(s: Solution) -> str:
    """The plan as a table, one row per stage, and the predicted totals."""
    cand = s.candidate
    groups = ", ".join(f"{g.name} {g.size} x {s.device_types[g.name]}" for g in s.cluster.groups)
    world = s.cluster.world_size
    lines = [
        f"hetpipe plan: {s.model.name} on {s.cluster.name} ({world} device{'s' * (world != 1)}: {groups})",
        f"  pipeline {' -> '.join(s.group_order)}; {s.schedule}, {cand.num_microbatches} microbatches of "
        f"{cand.micro_batch_size} x {s.seq_length} tokens (global batch {s.global_batch_size}); "
        f"cross-vendor boundaries costed as {s.transport}",
        f"  costs: {', '.join(f'{g} {src}' for g, src in s.cost_source.items())}",
        "",
    ]
    header = ("stage", "group", "device", "ranks", "TPxDP", "layers", "recompute", "compute", "comm", "p2p*",
              "bubble", "memory/device", "TFLOP/s/GPU")
    rows = []
    for st in s.stages:
        layers = " & ".join(f"{n}" + ("+emb" if a == 0 else "") + ("+head" if b == s.model.num_units else "")
                            for n, (a, b) in zip(st.chunk_layers, st.chunk_units))
        recompute = st.recompute if st.recompute_num_layers is None else \
            f"{st.recompute} {st.recompute_num_layers}/{st.layers}"
        rows.append((str(st.index), st.group, st.device_type, _ranks(st.ranks),
                     f"{st.tp}x{st.dp}" + (f" CP{st.cp}" if st.cp > 1 else ""),
                     layers, recompute, f"{st.compute_s:.3f}s", f"{st.comm_s:.3f}s", f"{st.p2p_s:.3f}s",
                     f"{st.bubble_s:.3f}s", f"{st.memory_gib:.1f}/{st.usable_gib:.1f} GiB",
                     f"{st.tflops_per_gpu:.1f}"))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    lines += [
        "",
        f"predicted step {s.step_s:.3f} s | {s.tflops_per_gpu:.1f} TFLOP/s/GPU (Megatron model FLOPs) | "
        f"{s.tokens_per_s:,.0f} tokens/s | {s.gpus_used} of {s.cluster.world_size} devices used",
        "* boundary messages, overlapped with compute by the engine; compute + comm + bubble = step",
    ]
    if s.idle_ranks:
        lines.append(f"idle ranks: {_ranks(s.idle_ranks)}")
    lines += ["", *_schedule_lines(s)]
    return "\n".join(lines)


def _schedule_lines(s: Solution) -> list[str]:
    """The best plan's step under each schedule considered, the chosen one marked."""
    header = ("schedule", "predicted step", "bubble", "peak memory/device")
    rows = []
    for o in s.schedule_options:
        mark = " (chosen)" if o.schedule == s.schedule else ""
        if o.step_s is None:
            rows.append((o.schedule, "does not fit", "-", "-"))
        else:
            rows.append((o.schedule + mark, f"{o.step_s:.3f} s", f"{o.bubble_s:.3f} s",
                         f"{o.memory_gib:.1f}/{o.usable_gib:.1f} GiB"))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines += ["bubble: the busiest stage's idle time; planner.schedule=NAME plans for one schedule"]
    if schedule_model.is_v_shaped(s.schedule):
        lines.append(f"{s.schedule}: each rank holds two chunks in a V (virtual stages r and 2P-1-r), "
                     "listed as chunk 0 & chunk 1")
    return lines


def _ranks(ranks: list[int]) -> str:
    """0-7,16 style."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(f"{start}-{r}" if r != start else str(r))
            start = None
    return ",".join(parts)


register_plan_config()


@hydra.main(version_base=None, config_path="pkg://hetpipe.configs", config_name="plan")
def main(cfg: DictConfig) -> None:
    def _run() -> None:
        resolved = resolve_plan_config(cfg)
        if resolved.mode == "profile":
            from hetpipe.process.torch_compat import require_supported_torch

            require_supported_torch()
            run_profile(resolved)
        else:
            run_plan(resolved)

    run_cli(_run)


def cli() -> None:
    """``profile`` as the first argument selects the profiling mode (before hydra parses argv)."""
    if len(sys.argv) > 1 and sys.argv[1] == "profile":
        sys.argv[1:2] = ["mode=profile"]
    run_hydra_cli(main)


if __name__ == "__main__":
    cli()
