#!/usr/bin/env bash
# Loss-curve parity experiment: trains the same model from the same seed, data
# order and microbatches three ways and compares the curves bit for bit:
#   homogeneous_a  one vendor group (nvidia); stage boundaries use its own P2P
#   homogeneous_b  the same ranks declared amd: vendor labels alone change nothing
#   mixed          stage 0 in group nvidia, stage 1 in group amd, the boundary
#                  on hetpipe's tcp CPU-forwarding channel
# then runs `python -m hetpipe.compare` (reference homogeneous_a, --rtol 0) and
# exits with its code: 0 parity, 1 curves differ, 2 a run could not be read.
# A training run that fails stops the script with that run's exit code.
#
# Usage: scripts/parity_experiment.sh OUT_DIR [hydra overrides for every run]
#   OUT_DIR gets homogeneous_a/, homogeneous_b/, mixed/, compare.md, compare.png.
# Sets up nothing: $PYTHON (default python) must import hetpipe.
#
# The three cluster choices are hydra overrides in environment variables
# (words split on spaces), so the same experiment runs on GPUs, e.g.
#   HOMOGENEOUS_A="cluster=gpu2_homogeneous" \
#   HOMOGENEOUS_B="cluster=gpu2_homogeneous cluster.emulate=true cluster.groups.0.name=amd cluster.groups.0.vendor=amd" \
#   MIXED="cluster=gpu2_mixed" RTOL=0 \
#   scripts/parity_experiment.sh runs/parity_gpu train.train_iters=200 train.seq_length=1024
# MODEL picks the model preset (default +model=tiny_llama; its fields can be
# overridden like any other, e.g. model.num_layers=8).
# EXTRA_RUNS adds more runs to the comparison, ';'-separated NAME=OVERRIDES,
# e.g. EXTRA_RUNS="mixed_direct=cluster=gpu2_mixed cluster.transport.kind=direct"
set -euo pipefail
if [[ $# -lt 1 || $1 == -* ]]; then
  echo "usage: $0 OUT_DIR [hydra overrides]" >&2
  exit 2
fi
out=$1
shift
py=${PYTHON:-python}
read -ra homogeneous_a <<<"${HOMOGENEOUS_A:-cluster=cpu_homogeneous}"
read -ra homogeneous_b <<<"${HOMOGENEOUS_B:-cluster=cpu_homogeneous cluster.groups.0.name=amd cluster.groups.0.vendor=amd}"
read -ra mixed <<<"${MIXED:-cluster=cpu_mixed cluster.transport.kind=tcp}"
# Small enough for two CPU cores (about 25 s for all three); the caller's
# overrides come last and win. partition.layers is fixed so the split is the
# same in all three runs and only the transport (and the vendor labels) differ.
common=("${MODEL:-+model=tiny_llama}" train.train_iters=30 train.seq_length=64 train.micro_batch_size=2
        train.global_batch_size=8 train.log_interval=10 "partition.layers=[2,2]")

extra=("$@")

train() {  # train NAME CLUSTER_OVERRIDES...
  local name=$1
  shift
  echo "== $name: $*"
  "$py" -m hetpipe.pretrain "${common[@]}" "$@" "hydra.run.dir=$out/$name" "${extra[@]}"
}
train homogeneous_a "${homogeneous_a[@]}"
train homogeneous_b "${homogeneous_b[@]}"
train mixed "${mixed[@]}"
runs=("$out/homogeneous_a" "$out/homogeneous_b" "$out/mixed")
if [[ -n ${EXTRA_RUNS:-} ]]; then
  IFS=';' read -ra extra_runs <<<"$EXTRA_RUNS"
  for spec in "${extra_runs[@]}"; do
    name=${spec%%=*}
    read -ra overrides <<<"${spec#*=}"
    if [[ -z $name || $name == "$spec" ]]; then
      echo "EXTRA_RUNS entry '$spec' is not NAME=OVERRIDES" >&2
      exit 2
    fi
    train "$name" "${overrides[@]}"
    runs+=("$out/$name")
  done
fi
echo "== loss curves"
exec "$py" -m hetpipe.compare "${runs[@]}" --rtol "${RTOL:-0}" --out "$out"
