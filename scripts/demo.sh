#!/usr/bin/env bash
# The demo: sets up .venv if needed, then pretrains the tiny LLaMA-3-shaped
# model on CPU on the built-in corpus (the Python standard library's source,
# byte-tokenized) and prints where its metrics went.
# Extra arguments are hydra overrides, e.g. `bash scripts/demo.sh train.train_iters=50`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
run_dir="runs/demo/$(date +%Y-%m-%d_%H-%M-%S)"
"$root/.venv/bin/python" -m hetpipe.pretrain +model=tiny_llama data=demo \
  train.train_iters=300 train.seq_length=256 train.micro_batch_size=8 train.global_batch_size=16 \
  train.log_interval=25 optimizer.lr=2e-3 optimizer.min_lr=2e-4 optimizer.lr_warmup_iters=20 \
  "hydra.run.dir=$run_dir" "$@"
echo "hetpipe demo: metrics in $run_dir/metrics.jsonl, config in $run_dir/config.yaml"
