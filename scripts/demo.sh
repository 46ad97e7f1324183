#!/usr/bin/env bash
# The demo: sets up .venv if needed, then pretrains the tiny LLaMA-3-shaped
# model on CPU three ways from the same seed, data order and microbatches:
#   1. on cpu_mixed: a two-stage pipeline whose stages sit in two emulated
#      vendor groups ("nvidia" and "amd"), joined by the TCP CPU-forwarding
#      channel;
#   2. on cpu_homogeneous: the same two stages in one vendor group, joined by
#      the group's own P2P;
#   3. in one process, the reference;
# and compares the loss curves (expected: bitwise identical).
# Extra arguments are hydra overrides for all runs, e.g. train.train_iters=50.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
py="$root/.venv/bin/python"
out="runs/demo/$(date +%Y-%m-%d_%H-%M-%S)"
common=(+model=tiny_llama data=demo train.train_iters=200 train.seq_length=128
        train.micro_batch_size=4 train.global_batch_size=16 train.log_interval=25
        optimizer.lr=2e-3 optimizer.min_lr=2e-4 optimizer.lr_warmup_iters=20)
echo "== 1/3 mixed: stage 0 on group nvidia, stage 1 on group amd, tcp channel at the boundary"
"$py" -m hetpipe.pretrain "${common[@]}" cluster=cpu_mixed partition.layers=[2,2] "hydra.run.dir=$out/mixed" "$@"
echo "== 2/3 homogeneous: both stages in one vendor group"
"$py" -m hetpipe.pretrain "${common[@]}" cluster=cpu_homogeneous partition.layers=[2,2] "hydra.run.dir=$out/homogeneous" "$@"
echo "== 3/3 single process reference"
"$py" -m hetpipe.pretrain "${common[@]}" cluster=single cluster.groups.0.device_type=CPU \
  "hydra.run.dir=$out/single" "$@"
echo "== loss curves"
"$py" -m hetpipe.compare "$out/single" "$out/mixed" "$out/homogeneous" --rtol 0 --out "$out"
