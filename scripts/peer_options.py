"""The peer benchmark's command line and split (scripts/bench_pipelining_peer.py).

Which of torch.distributed.pipelining's schedules ``--schedule`` names and how
many stage modules each rank holds (one, or two in a V), the options and
their checks (one ``error:`` line and status 2 for a bad combination), the
model and optimizer configs they select, and the stage split as a
:class:`Plan`. Kept apart from the driver so each file does one job.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

import torch
from torch.distributed import pipelining

from hetpipe.errors import ConfigError
from hetpipe.models.fp8 import FP8_RECIPES
from hetpipe.models.model_config import model_preset
from hetpipe.partitioner.plan_data import Plan, StagePlan, even_split, v_layers
from hetpipe.pipeline.registry import ONE_F_ONE_B, ZB_V
from hetpipe.schema.pretrain_config import OptimizerConfig

# --schedule -> torch.distributed.pipelining class.
SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "looped_bfs": "ScheduleLoopedBFS", "interleaved_zb": "ScheduleInterleavedZeroBubble",
             "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
# The multi-stage runtime's classes, which take a list of this rank's stages.
MULTI_STAGE = {"interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"}
# Two stage modules per rank in a V: rank r holds stages r and 3 - r.
V_SHAPED = {"zbv", "dualpipev"}
NUM_RANKS = 2


# --------------------------------------------------------------------------- options

def _value(text: str) -> Any:
    """A command-line value as hydra would read it: bool, null, int, float, else string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none", "~"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _parse_assignments(items: list[str], what: str) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"bench_pipelining_peer: {what} wants key=value, got {item!r}")
        out[key.strip()] = _value(value)
    return out


def parse_args(argv: Optional[list[str]] = None, description: Optional[str] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model preset (configs/model/NAME.yaml)")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="model field overrides, e.g. --set num_layers=8 hidden_size=2048")
    p.add_argument("--layers", default=None,
                   help="decoder layers of stage 0,1, e.g. 17,15 (default: an even split); zbv and dualpipev: "
                        "of stages 0..3, or per rank as 17,15 (halved into the V)")
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=32, help="microbatches per step")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (also the LR schedule's length)")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the summary")
    p.add_argument("--data", default="demo", help="Megatron data prefix, or demo")
    p.add_argument("--tokenizer", default="byte")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--opt", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="OptimizerConfig overrides, e.g. --opt lr=3e-4 clip_grad=0 lr_warmup_iters=5")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--schedule", default="1f1b", choices=list(SCHEDULES),
                   help="torch.distributed.pipelining schedule (zbv and dualpipev: two stage modules per rank)")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    p.add_argument("--bf16-weights", action="store_true",
                   help="bf16 parameters (no autocast) instead of fp32 master weights + bf16 autocast")
    p.add_argument("--fp8", default=None, choices=FP8_RECIPES, metavar="RECIPE",
                   help="the decoder layers' linears in float8 through torchao, recipe "
                        f"{' or '.join(FP8_RECIPES)}, on fp32 master weights + bf16 autocast")
    p.add_argument("--head-in-loss", action="store_true",
                   help="compute the head's projection + CE inside loss_fn instead of the last stage")
    p.add_argument("--fused-ce", action="store_true",
                   help="with --head-in-loss: hetpipe's chunked fused cross-entropy in loss_fn")
    p.add_argument("--no-return-outputs", dest="return_outputs", action="store_false",
                   help="step(return_outputs=False): the last stage keeps no outputs for the caller")
    p.add_argument("--timeout-min", type=float, default=20.0, help="process-group timeout")
    p.add_argument("--out", default=None, help="write the result JSON here")
    args = p.parse_args(argv)
    if args.fused_ce and not args.head_in_loss:
        p.error("--fused-ce needs --head-in-loss (with the head inside the stage, loss_fn sees logits)")
    if args.bf16_weights and args.device == "cpu":
        p.error("--bf16-weights is for --device cuda")
    if args.fp8 and args.bf16_weights:
        p.error("--fp8 runs on fp32 master weights under bf16 autocast, not with --bf16-weights")
    for name in ("seq_length", "micro_batch_size", "microbatches", "steps"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup {args.warmup} must leave at least one of the {args.steps} steps to measure")
    if not hasattr(pipelining, SCHEDULES[args.schedule]):
        p.error(f"this torch ({torch.__version__}) has no {SCHEDULES[args.schedule]}")
    if args.schedule in ("interleaved_zb", "zbv", "dualpipev") and args.compile:
        p.error(f"--schedule {args.schedule} cannot --compile: torch's input/weight backward split refuses "
                "compiled stages")
    stages = num_stages(args.schedule)
    if args.microbatches < stages:
        p.error(f"{SCHEDULES[args.schedule]} needs at least {stages} microbatches")
    if args.schedule == "dualpipev" and args.microbatches % 2:
        p.error("ScheduleDualPipeV needs an even number of microbatches")
    rounds = max(1, args.microbatches // NUM_RANKS)
    if args.schedule in ("interleaved_1f1b", "interleaved_zb") and args.microbatches % rounds:
        p.error(f"{SCHEDULES[args.schedule]} needs the microbatches ({args.microbatches}) to be a multiple of "
                f"its rounds ({rounds}): an even number")
    return args


def model_config(args: argparse.Namespace):
    cfg = model_preset(args.model, **_parse_assignments(args.set, "--set"))
    if args.seq_length > cfg.max_position_embeddings:
        raise SystemExit(f"bench_pipelining_peer: --seq-length {args.seq_length} exceeds model "
                         f"{cfg.name!r}'s max_position_embeddings={cfg.max_position_embeddings}")
    return cfg


def optimizer_config(args: argparse.Namespace):
    overrides = _parse_assignments(args.opt, "--opt")
    unknown = set(overrides) - {f.name for f in dataclasses.fields(OptimizerConfig)}
    if unknown:
        raise SystemExit(f"bench_pipelining_peer: unknown optimizer fields {sorted(unknown)}")
    return OptimizerConfig(**overrides)


def num_stages(schedule: str) -> int:
    """Pipeline stages of the peer's run: one per rank, two in a V."""
    return 2 * NUM_RANKS if schedule in V_SHAPED else NUM_RANKS


def local_stages(schedule: str, rank: int) -> list[int]:
    """The stages rank ``rank`` holds, in chunk order."""
    return [rank, 2 * NUM_RANKS - 1 - rank] if schedule in V_SHAPED else [rank]


def make_plan(layers: Optional[str], num_layers: int, schedule: str = "1f1b"):
    stages = num_stages(schedule)
    counts = [int(x) for x in layers.split(",")] if layers else even_split(num_layers, stages)
    if schedule in V_SHAPED and len(counts) == NUM_RANKS:
        counts = v_layers(counts)
    if len(counts) != stages:
        raise SystemExit(f"bench_pipelining_peer: --layers wants {stages} counts, got {layers!r}")
    ranks = {v: r for r in range(NUM_RANKS) for v in local_stages(schedule, r)}
    # The hetpipe schedule of the same placement names the peer's stages' ranks.
    same = ZB_V if schedule in V_SHAPED else ONE_F_ONE_B
    plan = Plan(stages=[StagePlan(group="peer", ranks=[ranks[v]], layers=n) for v, n in enumerate(counts)],
                schedule=same.name, num_chunks=same.chunks)
    try:
        plan.check_model(num_layers)
    except ConfigError as exc:
        raise SystemExit(f"bench_pipelining_peer: --layers {counts}: {exc}") from None
    return plan
