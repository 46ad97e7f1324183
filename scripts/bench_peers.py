#!/usr/bin/env python3
"""hetpipe ``plan=auto`` against torchtitan and Megatron-Core on the GPUs of one host.

Runs, one after the other, each through its own entry point and config, on
the same model (a hetpipe preset: ``--model llama8b`` is ``+model=llama8b``),
sequence length, global and micro batch, data (a Megatron .bin/.idx made by
scripts/preprocess_data.py) and precision (bf16 compute, fp32 main weights):

  hetpipe         python -m hetpipe.pretrain +model=M plan=auto planner.schedule=auto (its metrics.jsonl)
  torchtitan      python -m torchtitan.train --job.config_file <generated TOML>: FSDP2 over every GPU
  torchtitan_pp   the same, PP over every GPU with Interleaved1F1B
  torchtitan_zbv  the same, PP with ZBVZeroBubble (uncompiled: torch's split backward refuses compile)
  megatron        scripts/peers/megatron_train.py (Megatron-Core's loop; the wheel has no
                  megatron.training): DP over every GPU, distributed optimizer
  megatron_pp     the same, PP (1F1B) over every GPU

The peers' configs come from scripts/peers/ (torchtitan_config.py,
megatron_config.py; examples for 2 GPUs at seq 8192 beside them), each
setting with why it is that peer's best documented choice; each run's
generated config is written beside its log. Every run that fails is in the
table with its exit and the tail of its log, never dropped. TFLOP/s per GPU
is one formula for all: Megatron's model FLOPs (hetpipe.models.flops) per
token times the run's tokens/s, over the GPUs. Writes results.json and
results.md to --out.

``--site DIR`` puts the wheels of scripts/peer_wheels.sh, installed in DIR, on
the runs' PYTHONPATH. Example (2 GPUs, one sequence length in one 10-minute call):
  python scripts/bench_peers.py --out $OUT/peers --data .gpu/shakespeare_text_document \\
      --gpus 2 --seq-length 8192 --global-batch 32 --steps 5 --warmup 2 --site /tmp/pw
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from pathlib import Path

from hetpipe.errors import HetpipeError, fail
from hetpipe.models.flops import megatron_model_flops

# The previous bench's run helper, and the peers' config generators, sit beside this script.
from bench_pp2_llm import _run as run_logged  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PEERS_DIR = REPO / "scripts" / "peers"
sys.path.insert(0, str(PEERS_DIR))
import megatron_config  # noqa: E402
import torchtitan_config  # noqa: E402
from run_spec import RunSpec  # noqa: E402

RUNS = ("hetpipe", *torchtitan_config.LAYOUTS, *megatron_config.LAYOUTS)
DEFAULT_RUNS = "hetpipe,torchtitan,megatron"
GPU_COUNTS = (2, 4, 8)  # hetpipe's configs/cluster/gpuN_homogeneous.yaml
ERROR_TAIL_LINES = 12
# One torchtitan metrics line: "[rank1]:... step:  3  loss: 11.9  grad_norm: ...  memory: 60.1GiB(43%)  tps: 1,234"
TITAN_LINE = re.compile(r"(?:\[rank(?P<rank>\d+)\]:)?.*step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)"
                        r".*memory:\s*(?P<mem>[\d.]+)GiB.*tps:\s*(?P<tps>[\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and status 2, as every hetpipe command
        fail(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="results.json, results.md and one folder per run")
    p.add_argument("--data", required=True, help="Megatron data prefix (PREFIX.bin, PREFIX.idx)")
    p.add_argument("--gpus", type=int, default=2, choices=GPU_COUNTS)
    p.add_argument("--model", default="llama8b", help="hetpipe model preset")
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--global-batch", type=int, default=32, help="sequences per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the averages (compilation)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp8"))
    p.add_argument("--runs", default=DEFAULT_RUNS, help=f"comma-separated, from {', '.join(RUNS)}")
    p.add_argument("--site", default=None, help="installed peer wheels, put on the runs' PYTHONPATH")
    p.add_argument("--launcher", default=None, help="replaces the peers' torchrun command (tests)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="extra hydra overrides for the hetpipe run")
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        fail(f"--warmup {args.warmup} must leave at least one of the {args.steps} steps to measure")
    unknown = [r for r in args.runs.split(",") if r not in RUNS]
    if unknown:
        fail(f"unknown --runs {unknown}; choose from {', '.join(RUNS)}")
    return args


def run_spec(args: argparse.Namespace) -> RunSpec:
    return RunSpec(model=args.model, seq_length=args.seq_length, global_batch_size=args.global_batch,
                   micro_batch_size=args.micro_batch_size, gpus=args.gpus, steps=args.steps,
                   data=str(Path(args.data).resolve()), precision=args.precision)


def tflops_per_gpu(spec: RunSpec, tokens_per_s: float | None) -> float | None:
    """Megatron's model FLOPs per token (hetpipe.models.flops) x tokens/s, per GPU."""
    if not tokens_per_s:
        return None
    per_token = megatron_model_flops(spec.model_config(), 1, spec.seq_length) / spec.seq_length
    return per_token * tokens_per_s / spec.gpus / 1e12


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def launcher(args: argparse.Namespace) -> list[str]:
    if args.launcher:
        return shlex.split(args.launcher)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}",
            "--role", "rank", "--tee", "3"]


def hetpipe_command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "hetpipe.pretrain", f"+model={args.model}", f"cluster=gpu{args.gpus}_homogeneous",
            "plan=auto", "planner.schedule=auto", f"train.seq_length={args.seq_length}",
            f"train.global_batch_size={args.global_batch}", f"train.micro_batch_size={args.micro_batch_size}",
            f"train.train_iters={args.steps}", "train.log_interval=1", f"train.precision={args.precision}",
            "optimizer.lr_warmup_iters=2000", "logging.progress=false", f"data.path={Path(args.data).resolve()}",
            *args.set, f"hydra.run.dir={run_dir}"]


def hetpipe_numbers(run_dir: Path, warmup: int) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in rows if r["step"] > warmup]
    records = [json.loads(p.read_text()) for p in sorted(run_dir.glob("memory_rank*.json"))]
    return {"tokens_per_s": mean([r["tokens_per_s"] for r in timed]), "steps_timed": len(timed),
            "loss": rows[-1]["loss"] if rows else None,
            "peak_mem_gib": [r["peak_allocated_gib"] for r in records], "memory": "allocated"}


def titan_numbers(log: Path, warmup: int, gpus: int) -> dict:
    """tokens/s (torchtitan's tps is per GPU), peak reserved memory per rank and the last loss, from its log."""
    steps: dict[int, dict[int, re.Match]] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = TITAN_LINE.search(ANSI.sub("", line))
        if m:
            steps.setdefault(int(m["step"]), {})[int(m["rank"] or 0)] = m
    timed = [ranks for step, ranks in sorted(steps.items()) if step > warmup]
    tps = [mean([float(m["tps"].replace(",", "")) for m in ranks.values()]) * gpus for ranks in timed]
    last = steps[max(steps)] if steps else {}
    mem: dict[int, float] = {}
    for ranks in steps.values():
        for rank, m in ranks.items():
            mem[rank] = max(mem.get(rank, 0.0), float(m["mem"]))
    return {"tokens_per_s": mean(tps), "steps_timed": len(timed), "memory": "reserved",
            "loss": float(last[max(last)]["loss"]) if last else None, "peak_mem_gib": [mem[r] for r in sorted(mem)]}


def megatron_numbers(run_dir: Path, warmup: int) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in rows if r["step"] > warmup]
    peaks = [max(col) for col in zip(*[r["peak_mem_gib"] for r in rows])] if rows else []
    return {"tokens_per_s": mean([r["tokens_per_s"] for r in timed]), "steps_timed": len(timed),
            "loss": rows[-1]["loss"] if rows else None, "peak_mem_gib": peaks, "memory": "allocated"}


def prepare(name: str, args: argparse.Namespace, spec: RunSpec, run_dir: Path) -> list[str]:
    """Write the run's config into ``run_dir``; its command."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if name == "hetpipe":
        return hetpipe_command(args, run_dir)
    if name in torchtitan_config.LAYOUTS:
        toml = run_dir / "job.toml"
        toml.write_text(torchtitan_config.render(spec, torchtitan_config.LAYOUTS[name], str(run_dir)))
        return [*launcher(args), "-m", "torchtitan.train", "--job.config_file", str(toml)]
    args_file = run_dir / "megatron.args"
    args_file.write_text(megatron_config.render(spec, megatron_config.LAYOUTS[name]))
    return [*launcher(args), str(PEERS_DIR / "megatron_train.py"), "--args-file", str(args_file), "--out", str(run_dir)]


def not_run_reason(name: str, spec: RunSpec) -> str | None:
    if spec.precision == "fp8" and name in megatron_config.LAYOUTS:
        return "Megatron-Core's fp8 needs Transformer Engine, which is not installed (source package only)"
    return None


def measure(name: str, args: argparse.Namespace, spec: RunSpec, out: Path) -> dict:
    reason = not_run_reason(name, spec)
    if reason:
        return {"failed": "not run", "error": reason}
    run_dir = out / name
    log = out / f"{name}.log"
    result = run_logged(prepare(name, args, spec, run_dir), log, args.timeout)
    if "failed" not in result:
        try:
            result.update(numbers(name, run_dir, log, args))
        except (OSError, ValueError, KeyError) as exc:
            result["failed"] = f"no measurement ({type(exc).__name__}: {exc})"
        if not result.get("tokens_per_s") and "failed" not in result:
            result["failed"] = "no timed step in its output"
    if "failed" in result:
        lines = log.read_text(errors="replace").splitlines()[-ERROR_TAIL_LINES:] if log.exists() else []
        result["error"] = "\n".join(ANSI.sub("", line) for line in lines)
    result["tflops_per_gpu"] = tflops_per_gpu(spec, result.get("tokens_per_s"))
    return result


def numbers(name: str, run_dir: Path, log: Path, args: argparse.Namespace) -> dict:
    if name == "hetpipe":
        return hetpipe_numbers(run_dir, args.warmup)
    if name in torchtitan_config.LAYOUTS:
        return titan_numbers(log, args.warmup, args.gpus)
    return megatron_numbers(run_dir, args.warmup)


def best_peer(results: dict[str, dict]) -> str | None:
    peers = {n: r for n, r in results.items() if n != "hetpipe" and "failed" not in r and r.get("tokens_per_s")}
    return max(peers, key=lambda n: peers[n]["tokens_per_s"]) if peers else None


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(results: dict[str, dict], spec: RunSpec) -> str:
    lines = [f"{spec.model}, seq {spec.seq_length}, global batch {spec.global_batch_size}, micro batch "
             f"{spec.micro_batch_size}, {spec.gpus} GPUs, {spec.precision}; TFLOP/s per GPU by Megatron's model FLOPs",
             "", "| run | status | tokens/s | TFLOP/s/GPU | peak mem GiB | loss (last step) |",
             "| --- | --- | ---: | ---: | --- | ---: |"]
    for name, r in results.items():
        status = r.get("failed", "ok")
        if "error" in r:
            # The log's last line (a traceback's exception); results.json keeps the tail.
            status += ": " + next((x.strip() for x in reversed(r["error"].splitlines()) if x.strip()), "")
        mem = ", ".join(f"{m:.1f}" for m in r.get("peak_mem_gib", [])) or "-"
        lines.append(f"| {name} | {status.replace('|', '/')} | {_num(r.get('tokens_per_s'), ',.0f')} | "
                     f"{_num(r.get('tflops_per_gpu'), '.1f')} | {mem} ({r.get('memory', '-')}) | "
                     f"{_num(r.get('loss'), '.4f')} |")
    lines += ["", f"hetpipe / best peer: {ratio_line(results)}"]
    return "\n".join(lines) + "\n"


def ratio_line(results: dict[str, dict]) -> str:
    best, mine = best_peer(results), results.get("hetpipe", {})
    if best is None or "failed" in mine or not mine.get("tokens_per_s"):
        return "- (no successful hetpipe run and peer run to compare)"
    return f"{mine['tokens_per_s'] / results[best]['tokens_per_s']:.3f} (best peer: {best})"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        spec = run_spec(args)
        for name in args.runs.split(","):  # every generator's refusal before the first GPU second
            if name != "hetpipe" and not not_run_reason(name, spec):
                prepare(name, args, spec, Path(args.out) / name)
    except HetpipeError as exc:
        fail(str(exc))
    for suffix in (".bin", ".idx"):
        if not Path(spec.data + suffix).is_file():
            fail(f"--data {args.data}: {spec.data}{suffix} does not exist (make it with scripts/preprocess_data.py)")
    out = Path(args.out)
    paths = [p for p in (str(PEERS_DIR), args.site, str(REPO), os.environ.get("PYTHONPATH")) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    results = {}
    for name in args.runs.split(","):
        results[name] = measure(name, args, spec, out)
        (out / "results.json").write_text(json.dumps({"spec": vars(spec), "results": results}, indent=1))
    (out / "results.md").write_text(table(results, spec))
    print(table(results, spec))


if __name__ == "__main__":
    main()
