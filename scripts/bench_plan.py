"""Wall time of ``python -m hetpipe.plan`` as a user runs it, imports included.

Each case is the whole command in a fresh interpreter (one BLAS/OpenMP
thread), run ``--repeats`` times; the table gives the median, the fastest
and slowest run, and the chosen plan's schedule and split (the plan.yaml it
wrote, so runs before and after a change can be checked for the same plan).
The default cases are the issue-44 one (LLaMA-3-8B on h200_mi325x_2node
with 64 + 64 nodes, 1024 GPUs, ``planner.schedule=auto``) and the 2-node
default at three sequence lengths; results go to docs/benchmarks.md.

    python scripts/bench_plan.py [--repeats 3] [--nodes 64] [--case "train.seq_length=4096" ...]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

BASE = ["+model=llama8b", "cluster=h200_mi325x_2node"]


def run_once(overrides: list[str], out: Path) -> float:
    """One planning command's wall time; its plan goes to ``out``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    argv = [sys.executable, "-m", "hetpipe.plan", *BASE, *overrides, f"output={out}",
            f"hydra.run.dir={out.parent / 'hydra'}"]
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"bench_plan: {' '.join(overrides)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return elapsed


def plan_words(path: Path) -> str:
    plan = yaml.safe_load(path.read_text())
    return f"{plan['schedule']} [{', '.join(str(s['layers']) for s in plan['stages'])}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=64, help="nodes per group of the large case")
    parser.add_argument("--case", action="append", metavar="OVERRIDES",
                        help="space-separated overrides of one case (repeatable); replaces the defaults")
    args = parser.parse_args()
    cases = [c.split() for c in args.case] if args.case else [
        [f"cluster.groups.0.nodes={args.nodes}", f"cluster.groups.1.nodes={args.nodes}"],
        [], ["train.seq_length=4096"], ["train.seq_length=8192"]]
    print(f"{'case':<60} {'median':>8} {'min':>8} {'max':>8}  plan")
    with tempfile.TemporaryDirectory() as tmp:
        for k, case in enumerate(cases):
            out = Path(tmp) / str(k) / "plan.yaml"
            times = [run_once(case, out) for _ in range(args.repeats)]
            print(f"{' '.join(case) or '(2-node default)':<60} {statistics.median(times):>7.2f}s "
                  f"{min(times):>7.2f}s {max(times):>7.2f}s  {plan_words(out)}", flush=True)


if __name__ == "__main__":
    main()
