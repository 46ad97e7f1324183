"""Planning time of the cost-model partitioner for two-vendor clusters of 16 to 1024 GPUs.

Each cluster is half H200 nodes, half MI325X nodes (8 GPUs per node); the
planner searches group order, stages per group, TP per group, DP,
recomputation and the exact layer split. The process pins itself to one CPU
core and one BLAS/OpenMP thread, the setting of the goal (< 5 s for 1024
GPUs; Sailor, SOSP'25, reports 17 s for 512).

    python scripts/bench_planner.py [--model llama8b] [--seq-length 8192] [--global-batch-size 1024]
                                    [--schedule auto]   # every schedule, zb_v's simulated V included
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import time  # noqa: E402

from hetpipe.cluster import ClusterConfig, GroupConfig  # noqa: E402
from hetpipe.models import model_preset  # noqa: E402
from hetpipe.partitioner.planner_config import PlannerConfig  # noqa: E402
from hetpipe.partitioner.solver import solve  # noqa: E402
from hetpipe.pretrain_config import TrainConfig  # noqa: E402


def two_vendor_cluster(gpus: int) -> ClusterConfig:
    nodes = gpus // 16
    return ClusterConfig(name=f"h200_mi325x_{gpus}", groups=[
        GroupConfig(name="nvidia", vendor="nvidia", device_type="H200", nodes=nodes, ranks_per_node=8),
        GroupConfig(name="amd", vendor="amd", device_type="MI325X", nodes=nodes, ranks_per_node=8)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama8b")
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--global-batch-size", type=int, default=1024)
    parser.add_argument("--gpus", type=int, nargs="+", default=[16, 128, 512, 1024])
    parser.add_argument("--repeats", type=int, default=3, help="report the fastest of this many runs")
    parser.add_argument("--schedule", default="1f1b", help="planner.schedule: 1f1b (this bench's default: the 1F1B search alone), auto (the planner's default), ...")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    model = model_preset(args.model)
    train = TrainConfig(micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                        seq_length=args.seq_length)
    print(f"{model.name}, {args.seq_length} tokens x microbatch {args.micro_batch_size}, global batch "
          f"{args.global_batch_size}; planner.schedule={args.schedule}; one CPU core")
    print(f"{'GPUs':>5}  {'plan time':>9}  {'candidates':>10}  {'solved':>6}  {'step':>8}  {'TFLOP/s/GPU':>11}  plan")
    for gpus in args.gpus:
        cluster = two_vendor_cluster(gpus)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            solution = solve(model, cluster, train, PlannerConfig(schedule=args.schedule))
            times.append(time.perf_counter() - start)
        c = solution.candidate
        shape = " -> ".join(f"{g}:{c.stages[i]}xTP{c.tp[i]}" for g in solution.group_order
                            for i in [[x.name for x in cluster.groups].index(g)])
        layers = [s.chunk_layers if len(s.chunk_layers) > 1 else s.layers for s in solution.stages]
        print(f"{gpus:>5}  {min(times):>8.2f}s  {solution.candidates_total:>10}  {solution.candidates_solved:>6}  "
              f"{solution.step_s:>7.3f}s  {solution.tflops_per_gpu:>11.1f}  {shape}, DP{c.dp}, "
              f"{solution.schedule}, M={c.num_microbatches}, recompute {'/'.join(st.recompute for st in solution.stages)}, layers {layers}",
              flush=True)


if __name__ == "__main__":
    main()
