#!/usr/bin/env python3
"""Two-GPU pipeline benchmark of a full-size model: every boundary variant in one run.

Trains LLaMA-3-8B (or Qwen2-7B) with PP=2 on the two local GPUs, once per
variant, each through the user's entry point (``python -m hetpipe.pretrain``):

  nccl     both GPUs in one NVIDIA group; the boundary is NCCL (the reference)
  direct   second GPU declared amd; device-direct channel (CUDA IPC mover)
  tcp4     second GPU declared amd; CPU-forwarding channel, 4 TCP streams
  tcp1     the same with 1 stream
  gloo     the boundary over torch.distributed's gloo (host staging)
  peer     the same model, split, data, microbatches and precision through
           PyTorch's torch.distributed.pipelining (scripts/bench_pipelining_peer.py),
           once per schedule of --peer-schedules (default 1f1b: Schedule1F1B)
  tp2      one stage, TP=2 over both GPUs in one NVIDIA group; on 4/8 GPUs TP2
           inside the first vendor group only (its stage TP2, the other group's TP1)
  nccl_ra2 nccl with two receives posted ahead of use (partition.recv_ahead=2;
           the automatic value on NCCL boundaries is 1)

``--gpus 4`` / ``--gpus 8`` run the paper's shape: two vendor groups of 2 (4)
GPUs, each one pipeline stage replicated DP2 (DP4), configs gpu4_*/gpu8_*;
--microbatches stays per DP replica so the per-GPU batch equals the 2-GPU run.

A ``+compile`` suffix (``nccl+compile``, ``peer+compile``) compiles the decoder
layers; ``+zero1`` shards AdamW's state over DP (optimizer.distributed=true);
``+ctaN`` on an nccl variant caps the boundary communicators at N CTAs
(cluster.transport.nccl_max_ctas=N) and ``+smN`` leaves N SMs free of GEMMs
for them (cluster.transport.gemm_sm_carveout=N; sm0: none); ``+pure`` runs hetpipe in
train.precision=bf16-pure (bf16 parameters, gradients and AdamW state, what
the peer runs under ``--precision bf16-pure``), beside the default. ``+sched=NAME`` picks the
pipeline schedule: on a hetpipe variant partition.schedule=NAME (gpipe, 1f1b,
zb_h1 or zb_v; ``nccl+sched=zb_h1`` is zero bubble over NCCL; zb_v halves
each rank's --layers into its two chunks, 17,15 -> 9,8,7,8; ``+sched=auto`` runs
``plan=auto planner.schedule=auto``, the planner's layout, split, schedule and
recomputation for the detected devices, whatever --layers says), on ``peer`` the
peer's --schedule (1f1b, gpipe, interleaved_1f1b, looped_bfs, interleaved_zb,
zbv, dualpipev; see the peer's docstring). A bare ``peer`` runs once per --peer-schedules
entry, as ``peer`` (1f1b) and ``peer+sched=NAME``; the table's "x peer" ratio
is against the 1F1B peer.
``--layers auto`` gives each hetpipe variant the planner's split for its own
schedule and layout (``plan=auto``'s search with the run's stages, TP, DP,
model, sequence, microbatches and precision fixed; zb_v's four chunks in
pipeline order) with the planner's recomputation per stage (as plan=auto
runs it; a ``--set train.recompute=MODE`` fixes one mode instead), and the
peer the nccl 1F1B run's layers; the table shows each run's split. A run whose process exits non-zero, dies of a signal or
times out is "failed (exit N)" / "failed (signal NAME)" in the table and in
results.json, with no throughput, and no ratio is taken against it.
``--precision`` is the hetpipe runs' train.precision (bf16 by default), and
the peer runs its counterpart (:func:`peer_precision_flags`): fp32 master
weights under bf16 autocast for bf16, bf16 parameters for bf16-pure, and for
fp8 torchao's float8 linears on fp32 master weights, compiled like hetpipe's
fp8 layers (``--set train.fp8_recipe=rowwise`` reaches both). The first ``--warmup`` steps are not timed (they
include kernel loading and compilation); ``--profile`` adds one more, untimed,
profiled step (train.profile_step) to every hetpipe run, ``--memory-snapshot`` one
more that records what each rank holds at its memory peak (train.memory_snapshot_step). Prints a table with TFLOP/s per GPU (Megatron's
formula), tokens/s, MFU, peak memory per GPU, each variant's ratio to nccl
(and nccl's to the peer), and the measured step time beside the cost model's
prediction for the same plan; writes ``results.json`` and ``results.md`` to --out.
Each run starts as ``$PYTHON -m hetpipe.pretrain ...`` (or the peer's script),
``PYTHON`` defaulting to this interpreter, as scripts/launch_cluster.sh does.

Example (2xH200):
  python scripts/bench_pp2_llm.py --out runs/bench8b --model llama8b --seq-length 8192 \\
      --microbatches 32 --layers 17,15 --data .gpu/shakespeare_text_document
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from hetpipe.errors import HetpipeError, fail, hydra_error_line
from hetpipe.partitioner.plan_data import v_layers
from hetpipe.schema.pretrain_config import PretrainConfig, register_configs, resolve
from hetpipe.pipeline.layouts import V_SHAPE
from hetpipe.pipeline.registry import DEFAULT_SCHEDULE, ONE_F_ONE_B, SCHEDULES, schedule_spec

# The peer's options and the planner's side sit beside this script (sys.path[0] when run as a script).
from bench_plans import Split, planned_split, predicted, ran_split  # noqa: E402
from peer_options import SCHEDULES as PEER_SCHEDULES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# The interpreter every run starts with: $PYTHON, else this one (tests put a fake runner behind it).
PYTHON = [os.environ.get("PYTHON") or sys.executable]

VARIANTS = ("nccl", "direct", "tcp4", "tcp1", "gloo", "tp2", "nccl_ra2")
# hetpipe's schedules with one model chunk per rank: the variants' splits are per stage.
# zb_v halves each rank's --layers count into its two chunks (partitioner.plan_data.v_layers).
HETPIPE_SCHEDULES = tuple(s.name for s in SCHEDULES.values() if s.chunks is not None)  # not interleaving
# +sched=auto: the run's own plan=auto (planner.schedule=auto) picks layout, split, schedule and recomputation.
PLAN_AUTO = "auto"

# Both hetpipe and the peer follow this optimizer schedule: lr 3e-4 (the
# default) after 2000 warmup steps, as in a real LLaMA-3-8B run's first steps.
# (With the peak lr reached at step 1, a random-init 8B model's loss climbs
# from 12.5 to about 27 in three steps, which says nothing about throughput but
# reads as divergence.) Learning rate does not change the work per step.
OPTIMIZER = {"lr_warmup_iters": "2000"}


def variant_overrides(base: str, gpus: int) -> list[str]:
    """Hydra overrides of one boundary variant on ``gpus`` local GPUs.

    Two GPUs: PP2. Four or eight: two vendor groups of gpus/2, each one
    pipeline stage replicated DP = gpus/2 times (the paper's PP2 x DP shape).
    ``tp2`` is one TP2 stage (two GPUs), or on 4/8 GPUs TP2 inside the first
    group only, its other groups' stages at TP1.
    """
    dp = [] if gpus == 2 else [f"partition.dp={gpus // 2}"]
    homogeneous, mixed = f"cluster=gpu{gpus}_homogeneous", f"cluster=gpu{gpus}_mixed"
    if base == "nccl":
        return [homogeneous, *dp]
    if base == "nccl_ra2":  # receives posted two ahead, as hetpipe's own channels do
        return [homogeneous, "partition.recv_ahead=2", *dp]
    if base == "direct":
        return [mixed, "cluster.transport.kind=direct", *dp]
    if base in ("tcp4", "tcp1"):
        return [mixed, "cluster.transport.kind=tcp", f"cluster.transport.streams_per_address={base[-1]}", *dp]
    if base == "gloo":
        return [mixed, "cluster.transport.kind=gloo", *dp]
    if base == "tp2":
        if gpus == 2:
            return [homogeneous, "partition.tp=2", "partition.layers=null"]
        # DP must be equal across stages: nvidia TP2 x DP(gpus/4) is one stage, amd TP1 x DP(gpus/4) two.
        return [mixed, "partition.tp_per_group=[2,1]", f"partition.dp={gpus // 4}", "partition.layers=null"]
    raise ValueError(base)


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def hetpipe_overrides(args, variant: str, flags: set[str], schedule: str,
                      split: Split | None) -> list[str]:
    """``python -m hetpipe.pretrain``'s overrides for one run, its directory aside;
    ``split`` None leaves the split to the variant (tp2: an even one)."""
    # --microbatches is per DP replica: the per-GPU batch stays that of the 2-GPU run.
    replicas = 1 if args.gpus == 2 else (args.gpus // 4 if variant == "tp2" else args.gpus // 2)
    return [f"+model={args.model}", f"train.seq_length={args.seq_length}",
            f"train.micro_batch_size={args.micro_batch_size}",
            f"train.global_batch_size={args.micro_batch_size * args.microbatches * replicas}",
            f"train.train_iters={args.steps + args.profile + args.memory_snapshot}", "train.log_interval=1",
            f"train.compile={'compile' in flags}",
            *([f"train.profile_step={args.steps + 1}"] if args.profile else []),
            *([f"train.memory_snapshot_step={args.steps + args.profile + 1}"] if args.memory_snapshot else []),
            f"train.precision={'bf16-pure' if 'pure' in flags else args.precision}",
            f"optimizer.distributed={'zero1' in flags}",
            *(["plan=auto", "planner.schedule=auto"] if schedule == PLAN_AUTO else
              [f"partition.schedule={schedule}", f"partition.num_chunks={schedule_spec(schedule).chunks}"]),
            *[f"cluster.transport.nccl_max_ctas={f[3:]}" for f in flags if f.startswith("cta")],
            *[f"cluster.transport.gemm_sm_carveout={f[2:]}" for f in flags if f.startswith("sm")],
            *[f"optimizer.{k}={v}" for k, v in OPTIMIZER.items()],
            "logging.progress=false", f"data.path={args.data}",
            *(split.overrides() if split is not None else []),
            *variant_overrides(variant, args.gpus), *args.set]


def run_config(overrides: list[str]) -> PretrainConfig:
    """The config ``python -m hetpipe.pretrain OVERRIDES`` runs, composed as hydra composes it."""
    from hydra import compose, initialize_config_module

    register_configs()
    with initialize_config_module("hetpipe.configs", version_base=None):
        return resolve(compose("pretrain", overrides=overrides))


def run_split(args, base: str, flags: set[str], schedule: str) -> Split | None:
    """One run's partition.layers: --layers as given (zb_v halves each rank's count
    into its V) or, with --layers auto, the planner's split for the run's schedule.
    The peer takes the nccl 1F1B run's split; tp2 keeps its even one (None)."""
    if base == "tp2" or schedule == PLAN_AUTO:
        return None
    if base == "peer":  # hetpipe's 1F1B layers (the peer does not recompute; its compiled layers are its own)
        return Split(run_split(args, "nccl", set(), ONE_F_ONE_B.name).layers)
    if args.layers != "auto":
        counts = [int(n) for n in args.layers.split(",")]
        return Split(v_layers(counts) if schedule_spec(schedule).layout is V_SHAPE else counts)
    return planned_split(run_config(hetpipe_overrides(args, base, flags, schedule, None)))


def run_hetpipe(args, variant: str, flags: set[str], schedule: str, out: Path, split: Split | None) -> dict:
    overrides = [*hetpipe_overrides(args, variant, flags, schedule, split), f"hydra.run.dir={out}"]
    cmd = [*PYTHON, "-m", "hetpipe.pretrain", *overrides]
    result = _run(cmd, out.with_suffix(".log"), args.timeout)
    chosen = ""
    if schedule == PLAN_AUTO:
        split, chosen = ran_split(out)
    result.update(layers=split and split.layers, split=split and chosen + split.describe())
    if "failed" in result:
        return result  # whatever it logged before it failed is no measurement
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        timed = [r for r in rows if args.warmup < r["step"] <= args.steps]  # not the profiled/recorded steps
        result.update(losses=[r["loss"] for r in rows], steps_timed=len(timed),
                      # Rows carry TFLOP/s and MFU only where they mean something (hetpipe.observe.metrics).
                      tflops_per_gpu=mean([r["tflops_per_device"] for r in timed if "tflops_per_device" in r]),
                      tokens_per_s=mean([r["tokens_per_s"] for r in timed]),
                      mfu=mean([r["mfu"] for r in timed if r.get("mfu") is not None]),
                      step_time_s=mean([r["step_time_s"] for r in timed]))
        solution, why = predicted(out)
        result["predicted_step_s"] = solution.step_s if solution else None
        # One per pipeline rank, as peak_mem_gib (the model's stage memory, recomputation included).
        result["predicted_mem_gib"] = [st.memory_gib for st in solution.stages] if solution else None
        if why:
            result["predicted_note"] = why
    # The first lines of each rank's profile: busy time and time by kernel class.
    result["profile"] = [path.read_text().split("\ntop kernels:")[0] for path in sorted(out.glob("profile_rank*.txt"))]
    # What each rank held at its memory peak (the report's first 12 lines: the largest groups).
    result["memory_peak"] = ["\n".join(path.read_text().splitlines()[:12])
                             for path in sorted(out.glob("memory_peak_rank*.txt"))]
    records = [json.loads(path.read_text()) for path in sorted(out.glob("memory_rank*.json"))]
    result["peak_mem_gib"] = [rec["peak_allocated_gib"] for rec in records]
    result["alloc_retries"] = [rec.get("alloc_retries") for rec in records]
    return result


def peer_precision_flags(precision: str, sets: list[str]) -> list[str]:
    """The peer's options for the hetpipe runs' train.precision, each the peer's natural
    counterpart: bf16-pure bf16 parameters (8 bytes per parameter, as hetpipe's
    bf16-pure), bf16 and bf16-autocast fp32 master weights under bf16 autocast (the
    peer's default), fp8 torchao's float8 linears on those (recipe train.fp8_recipe)."""
    if precision == "bf16-pure":
        return ["--bf16-weights"]
    if precision == "fp8":
        recipe = next((s.split("=", 1)[1] for s in sets if s.startswith("train.fp8_recipe=")), "tensorwise")
        return ["--fp8", recipe]
    return []


def run_peer(args, compiled: bool, schedule: str, out: Path, split: Split) -> dict:
    layers = split.layers
    out.mkdir(parents=True, exist_ok=True)
    result_path = out / "result.json"
    result_path.unlink(missing_ok=True)  # an earlier run's result is not this one's
    cmd = [*PYTHON, str(REPO / "scripts" / "bench_pipelining_peer.py"), "--model", args.model,
           "--layers", ",".join(map(str, layers)), "--seq-length", str(args.seq_length),
           "--micro-batch-size", str(args.micro_batch_size), "--microbatches", str(args.microbatches),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--data", args.data,
           "--device", "cuda", "--schedule", schedule, "--out", str(result_path), "--opt", *[f"{k}={v}" for k, v in OPTIMIZER.items()]]
    for item in args.set:
        if item.startswith("model."):
            cmd += ["--set", item.removeprefix("model.")]
        elif item.startswith("optimizer."):  # the same schedule for the peer
            cmd += ["--opt", item.removeprefix("optimizer.")]
    if compiled or args.precision == "fp8":  # hetpipe's fp8 compiles its layers too
        cmd.append("--compile")
    cmd += peer_precision_flags(args.precision, args.set)
    result = _run(cmd, out.with_suffix(".log"), args.timeout)
    result["layers"] = layers
    if "failed" not in result and result_path.exists():
        peer = json.loads(result_path.read_text())
        result.update(losses=peer.get("losses"), tflops_per_gpu=peer.get("tflops_per_gpu"),
                      tokens_per_s=peer.get("tokens_per_s"), peak_mem_gib=peer.get("peak_mem_gib", []),
                      status=peer.get("status"))
    return result


def _run(cmd: list[str], log: Path, timeout: float) -> dict:
    """Run ``cmd`` into ``log``: {"rc", "wall_s"}, and "failed" (exit N, signal
    NAME, timeout) unless it exited 0 in time."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    start = time.perf_counter()
    with log.open("w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        # Its own session, so a timeout takes down the launcher's workers too
        # (they hold the GPUs; the next variant would start out of memory).
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        failed = None
        try:
            rc = proc.wait(timeout=timeout)
            failed = exit_failure(rc)
        except subprocess.TimeoutExpired:
            rc, failed = 124, f"timeout after {timeout:g} s"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    result = {"rc": rc, "wall_s": time.perf_counter() - start}
    return {**result, "failed": failed} if failed else result


def exit_failure(rc: int) -> str | None:
    """How a run with exit status ``rc`` (Popen's: -N for signal N) failed; None: it did not."""
    if rc == 0:
        return None
    if rc > 0:
        return f"exit {rc}"
    try:
        return f"signal {signal.Signals(-rc).name}"
    except ValueError:
        return f"signal {-rc}"


def _throughput(results: dict[str, dict], base: str) -> float | None:
    """TFLOP/s/GPU of the first run of ``base`` that did not fail (a ratio's reference)."""
    return next((r["tflops_per_gpu"] for name, r in results.items()
                 if name.split("+")[0] == base and "failed" not in r and r.get("tflops_per_gpu")), None)


def table(results: dict[str, dict], args) -> str:
    # The reference is the first nccl variant that did not fail (with whatever flags it ran).
    ref = _throughput(results, "nccl")
    peer = results.get("peer", {}).get("tflops_per_gpu") if "failed" not in results.get("peer", {}) else None
    gpus = getattr(args, "gpus", 2)
    lines = [f"{args.model}, {gpus} GPUs, {getattr(args, 'precision', 'bf16')}, seq {args.seq_length}, "
             f"micro-batch {args.micro_batch_size}, "
             f"{args.microbatches} microbatches per DP replica, split {_split_setting(args)}, {args.steps} "
             f"steps ({args.warmup} untimed)", "",
             "| variant | split | TFLOP/s/GPU | tokens/s | MFU | peak mem GiB (GPU0, GPU1, ...; predicted) | vs nccl "
             "| step s (predicted) | loss, last step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        tf = None if "failed" in r else r.get("tflops_per_gpu")
        split = r.get("split") or (",".join(map(str, r["layers"])) if r.get("layers") else "even")
        if tf is None:
            status = f"failed ({r['failed']})" if "failed" in r else (r.get("status") or "no step timed")
            lines.append(f"| {name} | {split} | {status} | - | - | {_mem(r)} | - | - | - |")
            continue
        ratio = f"{tf / ref:.3f}" if ref else "-"
        if name.split("+")[0] == "nccl" and peer:
            ratio = f"{tf / ref:.3f} ({tf / peer:.3f}x peer)"
        mfu = f"{100 * r['mfu']:.1f} %" if r.get("mfu") else "-"
        loss = f"{r['losses'][-1]:.4f}" if r.get("losses") else "-"
        step = f"{r['step_time_s']:.3f}" if r.get("step_time_s") else "-"
        if r.get("predicted_step_s"):
            step += f" ({r['predicted_step_s']:.3f})"
        lines.append(f"| {name} | {split} | {tf:.1f} | {r['tokens_per_s']:,.0f} | {mfu} | {_mem(r)} | {ratio} "
                     f"| {step} | {loss} |")
    return "\n".join(lines)


def _split_setting(args) -> str:
    layers = getattr(args, "layers", "-")
    return "the planner's per schedule (--layers auto)" if layers == "auto" else layers


def _mem(r: dict) -> str:
    mem = r.get("peak_mem_gib") or []
    text = ", ".join("-" if m is None else f"{m:.1f}" for m in mem) if mem else "-"
    if r.get("predicted_mem_gib"):
        text += " (" + ", ".join(f"{m:.1f}" for m in r["predicted_mem_gib"]) + ")"
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama8b")
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=32)
    p.add_argument("--layers", default="17,15",
                   help="decoder layers of stage 0 and stage 1 (on 2xH200 at seq 8192, 17,15 measured fastest "
                        "under 1F1B for LLaMA-3-8B and 15,13 for Qwen2-7B), or auto: the planner's split for "
                        "each variant's schedule")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--data", default="demo")
    p.add_argument("--variants", default="nccl,direct,tcp4,tcp1,gloo,peer")
    p.add_argument("--peer-schedules", default="1f1b",
                   help=f"comma-separated schedules a bare peer variant runs, one run each: "
                        f"{', '.join(PEER_SCHEDULES)}")
    p.add_argument("--gpus", type=int, default=2, choices=[2, 4, 8],
                   help="local GPUs: 2 = PP2; 4/8 = PP2 x DP2/DP4 over two vendor groups")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp8", "bf16-pure", "bf16-autocast"],
                   help="train.precision of the hetpipe runs and the peer's counterpart: bf16-pure bf16 "
                        "weights, bf16 and bf16-autocast fp32 master weights under bf16 autocast, fp8 "
                        "torchao float8 linears on those (train.fp8_recipe via --set), compiled")
    p.add_argument("--profile", action="store_true",
                   help="hetpipe runs profile one extra, untimed step (train.profile_step); "
                        "the reports go into results.json and each run dir")
    p.add_argument("--memory-snapshot", action="store_true",
                   help="hetpipe runs record one more extra, untimed step's allocations "
                        "(train.memory_snapshot_step): what each rank held at its memory peak")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--set", action="append", default=[], help="extra hydra override for hetpipe runs")
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    if args.layers != "auto" and not re.fullmatch(r"[0-9]+(,[0-9]+)+", args.layers):
        p.error(f"--layers {args.layers!r}: give per-stage counts (17,15) or auto")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peer_schedules = args.peer_schedules.split(",")
    if set(peer_schedules) - set(PEER_SCHEDULES):
        p.error(f"unknown --peer-schedules {sorted(set(peer_schedules) - set(PEER_SCHEDULES))}; choose from "
                f"{', '.join(PEER_SCHEDULES)}")
    variants = []
    for variant in args.variants.split(","):
        if variant == "peer":
            variants += ["peer" if s == "1f1b" else f"peer+sched={s}" for s in peer_schedules]
        else:
            variants.append(variant)
    # Every variant checked before the first runs (each takes minutes on GPUs).
    runs = []
    for variant in variants:
        base, *rest = variant.split("+")
        flags = set(rest)
        nccl_flags = {f for f in flags if re.fullmatch(r"cta[1-9][0-9]*|sm[0-9]+", f)}
        sched_flags = {f for f in flags if f.startswith("sched=")}
        schedules = PEER_SCHEDULES if base == "peer" else (*HETPIPE_SCHEDULES, PLAN_AUTO)
        if (base not in VARIANTS and base != "peer") \
                or flags - {"compile", "zero1", "pure"} - nccl_flags - sched_flags \
                or (nccl_flags and not base.startswith("nccl")) \
                or len(nccl_flags) > len({f[:2] for f in nccl_flags}) \
                or len(sched_flags) > 1 or any(f.removeprefix("sched=") not in schedules for f in sched_flags) \
                or (base == "peer" and "pure" in flags):
            p.error(f"unknown variant {variant!r}; choose from {list(VARIANTS) + ['peer']}, "
                    "optionally with +compile, +zero1, +pure (not the peer: --precision sets its precision), "
                    f"+sched=NAME (hetpipe: {', '.join(HETPIPE_SCHEDULES)}; peer: {', '.join(PEER_SCHEDULES)}) "
                    "and (nccl only) +ctaN and +smN")
        if base == "peer" and args.gpus != 2:
            p.error("the pipelining peer runs on two GPUs only")
        runs.append((variant, base, flags, next((f.removeprefix("sched=") for f in sched_flags), DEFAULT_SCHEDULE)))
    splits = {variant: _split_or_fail(args, variant, base, flags, schedule) for variant, base, flags, schedule in runs}
    results: dict[str, dict] = {}
    for variant, base, flags, schedule in runs:
        print(f"== {variant}", flush=True)
        # No "=" in the directory: it goes into hydra.run.dir's override.
        run_dir = out / variant.replace("+", "_").replace("=", "-")
        split = splits[variant]
        results[variant] = (run_peer(args, "compile" in flags, schedule, run_dir, split) if base == "peer"
                            else run_hetpipe(args, base, flags, schedule, run_dir, split))
        r = results[variant]
        outcome = f"FAILED ({r['failed']})" if "failed" in r else f"TFLOP/s/GPU {r.get('tflops_per_gpu')}"
        print(f"   rc={r['rc']} wall {r['wall_s']:.0f} s  split {split.describe() if split else 'even'}  {outcome}  "
              f"peak mem {r.get('peak_mem_gib')}  allocator retries {r.get('alloc_retries')}", flush=True)
        (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    text = table(results, args)
    (out / "results.md").write_text(text + "\n")
    for name, r in results.items():
        for report in (r.get("profile") or []) + (r.get("memory_peak") or []):
            print(f"-- {name}: {report}")
    print(text)


def _split_or_fail(args, variant: str, base: str, flags: set[str], schedule: str) -> Split | None:
    """:func:`run_split`, or one line and exit 2 (before any run starts)."""
    from hydra.errors import HydraException

    try:
        return run_split(args, base, flags, schedule)
    except HetpipeError as exc:
        fail(f"--layers {args.layers}, variant {variant}: {exc}")
    except HydraException as exc:
        fail(f"--layers {args.layers}, variant {variant}: {hydra_error_line(exc)}")


if __name__ == "__main__":
    main()
