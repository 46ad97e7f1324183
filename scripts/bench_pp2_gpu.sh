#!/usr/bin/env bash
# Two-GPU pipeline check and throughput table (needs 2 local GPUs).
# Trains the same ~1B LLaMA-3-shaped model, seed and data order four ways:
#   single GPU (reference) | PP2 in one NVIDIA group (NCCL boundary) |
#   PP2 across an emulated vendor line over tcp | ... over gloo
# then compares the loss curves and prints per-run throughput, and finally
# runs the channel microbenchmark on the GPUs.
# Usage: bash scripts/bench_pp2_gpu.sh OUT_DIR [extra hydra overrides]
set -euo pipefail
out=${1:?give an output directory}; shift || true
py=${PYTHON:-python3}
data=${HETPIPE_DATA:-demo}
model=(+model=llama8b model.num_layers=8 model.hidden_size=2048 model.ffn_hidden_size=7168
       model.num_attention_heads=16 model.num_query_groups=8)
train=(train.seq_length=2048 train.micro_batch_size=1 train.global_batch_size=16 train.train_iters=30
       train.log_interval=10 optimizer.lr=3e-4 optimizer.lr_warmup_iters=5 logging.progress=false
       "data.path=$data")
run() { # name, overrides...; the run's exit status goes to $out/$name.status
  local name=$1; shift
  echo "== $name"
  set +e
  timeout "${RUN_TIMEOUT:-240}" "$py" -m hetpipe.pretrain "${model[@]}" "${train[@]}" "hydra.run.dir=$out/$name" "$@" "${EXTRA[@]}" \
    2>&1 | tee "$out/$name.log" | grep -E "^hetpipe|step +30/"
  local status=${PIPESTATUS[0]}
  set -e
  echo "$status" > "$out/$name.status"
}
EXTRA=("$@")
mkdir -p "$out"
run single cluster=single
run pp2_nccl cluster=gpu2_homogeneous partition.layers=[4,4]
run pp2_tcp cluster=gpu2_mixed cluster.transport.kind=tcp partition.layers=[4,4]
run pp2_gloo cluster=gpu2_mixed cluster.transport.kind=gloo partition.layers=[4,4]
echo "== loss curves (reference: single GPU)"
# Only runs that exited 0: a failed run's partial curve is no comparison.
ok=()
for name in single pp2_nccl pp2_tcp pp2_gloo; do
  [[ $(cat "$out/$name.status") == 0 ]] && ok+=("$out/$name")
done
if [[ $(cat "$out/single.status") == 0 && ${#ok[@]} -gt 1 ]]; then
  "$py" -m hetpipe.compare "${ok[@]}" --rtol 1e-2 || true
else
  echo "(not compared: the single-GPU reference or every pipelined run failed)"
fi
echo "== throughput (mean over steps 11-30)"
"$py" - "$out" <<'PY'
import json, sys, pathlib, signal
out = pathlib.Path(sys.argv[1])

def failure(status):
    """timeout's exit status: 124 its deadline, 128+N signal N, else the run's own."""
    if status == 124:
        return "timeout"
    if status > 128:
        try:
            return f"signal {signal.Signals(status - 128).name}"
        except ValueError:
            pass
    return f"exit {status}"

print(f"{'run':<10} {'tokens/s':>10} {'TFLOP/s/GPU':>12} {'final loss':>11}")
for name in ("single", "pp2_nccl", "pp2_tcp", "pp2_gloo"):
    status = int((out / f"{name}.status").read_text())
    p = out / name / "metrics.jsonl"
    if status != 0:
        print(f"{name:<10} failed ({failure(status)}): see {name}.log"); continue
    if not p.exists():
        print(f"{name:<10} (no metrics: see {name}.log)"); continue
    rows = [json.loads(l) for l in p.read_text().splitlines()][10:]
    tok = sum(r["tokens_per_s"] for r in rows) / len(rows)
    tf = sum(r["tflops_per_device"] for r in rows) / len(rows)
    print(f"{name:<10} {tok:>10.0f} {tf:>12.1f} {rows[-1]['loss']:>11.4f}")
PY
echo "== channel microbenchmark"
"$py" scripts/bench_channel.py --device cuda --streams 4 --quick 2>&1 | tee "$out/bench_channel.log" | tail -30
