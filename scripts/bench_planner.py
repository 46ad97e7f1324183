"""Planning time of the cost-model partitioner for two-vendor clusters of 16 to 1024 GPUs.

Each cluster is half H200 nodes, half MI325X nodes (8 GPUs per node); the
planner searches group order, stages per group, TP per group, DP,
recomputation and the exact layer split. The process pins itself to one CPU
core and one BLAS/OpenMP thread, the setting of the goal (< 5 s for 1024
GPUs with planner.schedule=auto, issue 44; Sailor, SOSP'25, reports 17 s for
512). Each size runs ``--repeats`` times; the table gives the median wall
time, the median CPU time (user + system) and the plan chosen, so runs
before and after a change can be checked for the same plan.

In-process (the default) times ``solve()`` alone. ``--cli`` times the whole
command a user runs, ``python -m hetpipe.plan +model=M cluster=h200_mi325x_2node
cluster.groups.0.nodes=N cluster.groups.1.nodes=N train...``, imports
included, each run in a fresh interpreter (on the same core); ``--set``
adds overrides to it and ``--plan-defaults`` leaves the train shape at the
plan config's defaults (seq 128, global batch 16, microbatch 4).
``--issue-44`` is issue 44's case, the whole command for 1024 GPUs at seq
4096, microbatch 1, global batch 128 with ``planner.schedule=auto``
(docs/benchmarks.md has its rows by date).

    python scripts/bench_planner.py [--model llama8b] [--seq-length 8192] [--global-batch-size 1024]
                                    [--schedule auto] [--gpus 16 1024] [--repeats 3]
    python scripts/bench_planner.py --cli [--plan-defaults] [--set planner.tp=1 ...]
    python scripts/bench_planner.py --issue-44 [--plan-defaults] [--repeats 3]
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import yaml  # noqa: E402

from hetpipe.devices.cluster import ClusterConfig, GroupConfig  # noqa: E402
from hetpipe.models import model_preset  # noqa: E402
from hetpipe.partitioner.planner_config import PlannerConfig  # noqa: E402
from hetpipe.partitioner.solver import solve  # noqa: E402
from hetpipe.schema.pretrain_config import TrainConfig  # noqa: E402


def two_vendor_cluster(gpus: int) -> ClusterConfig:
    nodes = gpus // 16
    return ClusterConfig(name=f"h200_mi325x_{gpus}", groups=[
        GroupConfig(name="nvidia", vendor="nvidia", device_type="H200", nodes=nodes, ranks_per_node=8),
        GroupConfig(name="amd", vendor="amd", device_type="MI325X", nodes=nodes, ranks_per_node=8)])


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def plan_command(args: argparse.Namespace, gpus: int, out: Path) -> list[str]:
    """``python -m hetpipe.plan`` for ``gpus`` GPUs, writing its plan to ``out``."""
    nodes = gpus // 16
    shape = [] if args.plan_defaults else [
        f"train.seq_length={args.seq_length}", f"train.micro_batch_size={args.micro_batch_size}",
        f"train.global_batch_size={args.global_batch_size}"]
    return [sys.executable, "-m", "hetpipe.plan", f"+model={args.model}", "cluster=h200_mi325x_2node",
            f"cluster.groups.0.nodes={nodes}", f"cluster.groups.1.nodes={nodes}", *shape,
            f"planner.schedule={args.schedule}", *args.set, f"output={out}", f"hydra.run.dir={out.parent}"]


def run_cli_once(argv: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of one planning command in a fresh interpreter; it must succeed."""
    cpu, start = children_cpu_s(), time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"bench_planner: {' '.join(argv[3:])} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return wall, children_cpu_s() - cpu


def plan_words(path: Path) -> str:
    """The written plan's schedule, stage layout and split."""
    plan = yaml.safe_load(path.read_text())
    stages = [f"{s['group']}:TP{s['tp']}xDP{s['dp']}" for s in plan["stages"]]
    return f"{plan['schedule']}, {len(stages)} stages ({stages[0]} ... {stages[-1]}), " \
           f"layers [{', '.join(str(s['layers']) for s in plan['stages'])}]"


def time_cli(args: argparse.Namespace, gpus: int) -> tuple[list[float], list[float], str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.yaml"
        runs = [run_cli_once(plan_command(args, gpus, out)) for _ in range(args.repeats)]
        return [w for w, _ in runs], [c for _, c in runs], plan_words(out)


def time_solve(args: argparse.Namespace, gpus: int) -> tuple[list[float], list[float], str]:
    model, cluster = model_preset(args.model), two_vendor_cluster(gpus)
    train = TrainConfig(micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                        seq_length=args.seq_length)
    walls, cpus = [], []
    for _ in range(args.repeats):
        cpu, start = time.process_time(), time.perf_counter()
        solution = solve(model, cluster, train, PlannerConfig(schedule=args.schedule))
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return walls, cpus, solution_words(solution, cluster)


def solution_words(solution, cluster: ClusterConfig) -> str:
    c = solution.candidate
    shape = " -> ".join(f"{g}:{c.stages[i]}xTP{c.tp[i]}" for g in solution.group_order
                        for i in [[x.name for x in cluster.groups].index(g)])
    layers = [s.chunk_layers if len(s.chunk_layers) > 1 else s.layers for s in solution.stages]
    return (f"{solution.candidates_total} candidates, {solution.candidates_solved} solved, step "
            f"{solution.step_s:.3f} s, {solution.tflops_per_gpu:.1f} TFLOP/s/GPU: {shape}, DP{c.dp}, "
            f"{solution.schedule}, M={c.num_microbatches}, recompute "
            f"{'/'.join(st.recompute for st in solution.stages)}, layers {layers}")


def issue_44(args: argparse.Namespace) -> argparse.Namespace:
    """``--issue-44``'s command: the whole plan command for 1024 GPUs in issue 44's shape."""
    if args.issue_44:
        args.cli, args.gpus, args.schedule = True, [1024], "auto"
        args.seq_length, args.micro_batch_size, args.global_batch_size = 4096, 1, 128
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama8b")
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--global-batch-size", type=int, default=1024)
    parser.add_argument("--gpus", type=int, nargs="+", default=[16, 128, 512, 1024])
    parser.add_argument("--repeats", type=int, default=3, help="report the median of this many runs")
    parser.add_argument("--schedule", default="1f1b", help="planner.schedule: 1f1b (this bench's default: the 1F1B search alone), auto (the planner's default), ...")
    parser.add_argument("--cli", action="store_true", help="time the whole python -m hetpipe.plan command")
    parser.add_argument("--plan-defaults", action="store_true", help="--cli: the plan config's train shape")
    parser.add_argument("--set", action="append", default=[], metavar="OVERRIDE", help="--cli: one more override")
    parser.add_argument("--issue-44", action="store_true",
                        help="--cli --gpus 1024 --seq-length 4096 --micro-batch-size 1 --global-batch-size 128 "
                             "--schedule auto: issue 44's case")
    args = issue_44(parser.parse_args())
    if (args.plan_defaults or args.set) and not args.cli:
        parser.error("--plan-defaults and --set shape the command of --cli")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    shape = "the plan config's train defaults" if args.plan_defaults else \
        f"{args.seq_length} tokens x microbatch {args.micro_batch_size}, global batch {args.global_batch_size}"
    print(f"{args.model}, {shape}; {' '.join([f'planner.schedule={args.schedule}', *args.set])}; one CPU core; "
          f"{'python -m hetpipe.plan, imports included' if args.cli else 'solve() in-process'}")
    print(f"{'GPUs':>5}  {'median':>8}  {'min':>8}  {'max':>8}  {'CPU s':>7}  plan")
    for gpus in args.gpus:
        walls, cpus, words = (time_cli if args.cli else time_solve)(args, gpus)
        print(f"{gpus:>5}  {statistics.median(walls):>7.2f}s  {min(walls):>7.2f}s  {max(walls):>7.2f}s  "
              f"{statistics.median(cpus):>6.2f}s  {words}", flush=True)


if __name__ == "__main__":
    main()
