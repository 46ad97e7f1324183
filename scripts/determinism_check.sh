#!/usr/bin/env bash
# train.deterministic on two GPUs (issue 31): does a run repeat bit for bit, do
# hetpipe's channels give NCCL's curve bit for bit, and what does the mode
# cost? Every run goes through python -m hetpipe.pretrain on this machine's two
# GPUs, every verdict through python -m hetpipe.compare; a table comes last.
#
#   bash scripts/determinism_check.sh [--cpu] [--phase all|det|plain] [--data PREFIX] [--out DIR]
#                                     [--steps N] [OVERRIDE...]
#
# (a) nccl_det_a, nccl_det_b: the pipeline boundary over NCCL (gpu2_homogeneous),
#     train.deterministic=true, twice: compare must call them bitwise identical;
# (b) direct_det, tcp_det: the second GPU declared amd (gpu2_mixed), the
#     boundary over the device-direct and the tcp channel, deterministic: each
#     must be bitwise identical to nccl_det_a;
# (c) nccl_a, nccl_b, direct, tcp: the same four without deterministic mode:
#     compare against nccl_a with --noise-ref nccl_b prints the noise floor
#     beside each verdict (informational: it does not set the exit status);
# (d) the table: each run's result and median step time, the verdicts of (a)
#     to (c), and deterministic mode's cost in step time per boundary.
# Exits 1 if a run failed or (a) or (b) is not bitwise identical, else 0.
# --phase det runs (a) and (b) only, --phase plain (c) only; a run already in
# --out with all its steps is kept, not run again, and every verdict whose runs
# are all there is given: two calls with the same --out (det, then plain) end
# with the whole table, for machines that limit one command's time.
#
# The model is LLaMA-3-8B's layer shape at hidden 2048 with 4 layers and
# LLaMA-3's vocabulary (751M parameters, the issue's ~0.75B), bf16 with fp32
# main weights, seq 1024, 8 microbatches of 1, split [2, 2], --steps steps
# (default 200, the issue's). --data is a Megatron indexed dataset prefix
# (PREFIX.bin/.idx, byte tokenizer, e.g. from scripts/preprocess_data.py);
# without it the runs use data=demo (needs the datasets package). Extra
# arguments are hydra overrides for every run (they come last and win). Logs,
# run directories and compare reports go to --out (default
# runs/determinism_check/<time>). Uses the python on PATH ($PYTHON overrides),
# with hetpipe importable from it.
#
# --cpu: the same eight runs on this machine's CPU with a tiny model and 5
# steps, the gloo boundary of cluster=cpu_homogeneous standing in for NCCL
# (runs gloo_det_a ... instead of nccl_det_a ...): it checks this script
# (tests/test_determinism.py runs it), not GPUs.
set -uo pipefail
cpu=0 phase=all data="" out="runs/determinism_check/$(date +%Y-%m-%d_%H-%M-%S)" steps="" extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) cpu=1 ;;
    --phase) phase=$2; shift ;;
    --data) data=$2; shift ;;
    --out) out=$2; shift ;;
    --steps) steps=$2; shift ;;
    -*) echo "determinism_check: unknown option $1 (usage: determinism_check.sh [--cpu] [--phase all|det|plain]" \
             "[--data PREFIX] [--out DIR] [--steps N] [OVERRIDE...])" >&2; exit 2 ;;
    *) extra+=("$1") ;;
  esac
  shift
done
case "$phase" in all|det|plain) ;; *) echo "determinism_check: --phase is all, det or plain, not $phase" >&2; exit 2 ;; esac
py=${PYTHON:-python3}
if [ "$cpu" = 1 ]; then
  ref=cpu_homogeneous mixed=cpu_mixed boundary=gloo steps=${steps:-5}
  model=(+model=tiny_llama model.hidden_size=64 model.ffn_hidden_size=160)
  shape=(train.seq_length=32 train.micro_batch_size=2 train.global_batch_size=8 optimizer.lr=3e-3)
else
  gpus=$("$py" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "$gpus" -lt 2 ]; then
    echo "determinism_check: needs two GPUs visible to $py (found $gpus); --cpu checks the script on CPU" >&2
    exit 2
  fi
  "$py" -c "import torch; print('determinism_check: torch', torch.__version__, '|', torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0))"
  ref=gpu2_homogeneous mixed=gpu2_mixed boundary=nccl steps=${steps:-200}
  model=(+model=llama8b model.num_layers=4 model.hidden_size=2048 model.ffn_hidden_size=7168
         model.num_attention_heads=16 model.num_query_groups=8)
  shape=(train.seq_length=1024 train.micro_batch_size=1 train.global_batch_size=8 optimizer.lr=3e-4
         optimizer.lr_warmup_iters=20 train.precision=bf16)
fi
common=("${model[@]}" "${shape[@]}" "train.train_iters=$steps" train.log_interval=10 logging.progress=false
        "partition.layers=[2,2]")
if [ -n "$data" ]; then common+=(data=megatron "data.path=$data" data.tokenizer=byte); else common+=(data=demo); fi
mkdir -p "$out"
rows=() failed=0

# complete NAME: $out/NAME holds a run that logged its last step (an earlier call's).
complete() {
  "$py" - "$out/$1/metrics.jsonl" "$steps" <<'EOF' 2>/dev/null
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
sys.exit(0 if any(r.get("step") == int(sys.argv[2]) and "loss" in r for r in rows) else 1)
EOF
}

# run NAME ARGS...: one pretrain run into $out/NAME (kept if complete already); its row: result,
# tracebacks, median step time, wall time.
run() {
  local name=$1; shift
  local log="$out/$name.log" start=$SECONDS status tb
  if complete "$name"; then
    kept "$name"
    return
  fi
  echo "== $name: python -m hetpipe.pretrain $*"
  "$py" -m hetpipe.pretrain "${common[@]}" "$@" "${extra[@]}" "hydra.run.dir=$out/$name" > "$log" 2>&1
  status=$?
  tb=$(grep -c Traceback "$log")
  if [ "$status" -ne 0 ] || [ "$tb" -ne 0 ]; then failed=1; fi
  rows+=("| $name | $([ "$status" -eq 0 ] && [ "$tb" -eq 0 ] && echo ok || echo "FAILED (exit $status)") | $tb |\
 $(step_time "$out/$name") | $((SECONDS - start)) |")
  tail -n 1 "$log"
}

# kept NAME: the row of a run an earlier call made (or "not run" where there is none).
kept() {
  if complete "$1"; then
    echo "== $1: kept from an earlier call ($out/$1)"
    rows+=("| $1 | ok (earlier call) | $(grep -c Traceback "$out/$1.log" 2>/dev/null) | $(step_time "$out/$1") | - |")
  else
    rows+=("| $1 | not run (--phase $phase) | - | - | - |")
  fi
}

# step_time DIR: median step_time_s of DIR's metrics.jsonl past the first 3 steps (warm-up, compilation).
step_time() {
  "$py" - "$1/metrics.jsonl" <<'EOF' 2>/dev/null || echo -
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
times = [r["step_time_s"] for r in rows if "loss" in r and r["step"] > 3] or \
        [r["step_time_s"] for r in rows if "loss" in r]
print(f"{statistics.median(times):.4f}")
EOF
}

# verdict NAME ARGS...: python -m hetpipe.compare ARGS into $out/NAME.txt; prints and returns its exit status.
verdict() {
  local name=$1; shift
  "$py" -m hetpipe.compare "$@" --markdown "$out/$name.md" > "$out/$name.txt" 2>&1
  local status=$?
  cat "$out/$name.txt"
  return $status
}

# said FILE NAME: the verdict of run NAME's training-loss row in compare's report FILE.
said() {
  awk -v run="$2" '/^training loss / { rows = 1; next } rows && $1 == run { print; exit }' "$1" |
    sed -E 's/.*  (PASS|FAIL)/\1/'
}

det=(train.deterministic=true) b=$boundary
deterministic_runs=(${b}_det_a ${b}_det_b direct_det tcp_det) plain_runs=(${b}_a ${b}_b direct tcp)
if [ "$phase" != plain ]; then
  run ${b}_det_a cluster=$ref "${det[@]}"
  run ${b}_det_b cluster=$ref "${det[@]}"
  run direct_det cluster=$mixed cluster.transport.kind=direct "${det[@]}"
  run tcp_det cluster=$mixed cluster.transport.kind=tcp "${det[@]}"
else
  for name in "${deterministic_runs[@]}"; do kept "$name"; done
fi
if [ "$phase" != det ]; then
  run ${b}_a cluster=$ref
  run ${b}_b cluster=$ref
  run direct cluster=$mixed cluster.transport.kind=direct
  run tcp cluster=$mixed cluster.transport.kind=tcp
else
  for name in "${plain_runs[@]}"; do kept "$name"; done
fi

all_complete() { local name; for name in "$@"; do complete "$name" || return 1; done; }
if all_complete "${deterministic_runs[@]}"; then
  echo "== (a) and (b): deterministic runs against ${b}_det_a, bitwise"
  verdict deterministic "$out/${b}_det_a" "$out/${b}_det_b" "$out/direct_det" "$out/tcp_det" || failed=1
elif [ "$phase" != plain ]; then
  failed=1  # a deterministic run failed: no verdict
fi
if all_complete "${plain_runs[@]}"; then
  echo "== (c): without deterministic mode, against ${b}_a, noise floor ${b}_a vs ${b}_b"
  verdict noise "$out/${b}_a" "$out/direct" "$out/tcp" --noise-ref "$out/${b}_b"
fi

cost() {  # BOUNDARY PLAIN DETERMINISTIC: one row of the speed table
  local plain det
  plain=$(step_time "$out/$2") det=$(step_time "$out/$3")
  echo "| $1 | $plain | $det | $("$py" -c "import sys; p, d = sys.argv[1:]; print(f'{float(d) / float(p):.3f}x')" \
    "$plain" "$det" 2>/dev/null || echo -) |"
}
echo
echo "| run | result | tracebacks | median step s | wall s |"
echo "| --- | --- | --- | --- | --- |"
printf '%s\n' "${rows[@]}"
echo
echo "| compared with | run | verdict |"
echo "| --- | --- | --- |"
for run in ${b}_det_b direct_det tcp_det; do
  echo "| ${b}_det_a (deterministic) | $run | $(said "$out/deterministic.txt" $run 2>/dev/null) |"
done
for run in direct tcp; do
  echo "| ${b}_a, noise floor ${b}_b | $run | $(said "$out/noise.txt" $run 2>/dev/null) |"
done
echo
echo "| boundary | step s | step s deterministic | cost |"
echo "| --- | --- | --- | --- |"
cost "$b" ${b}_a ${b}_det_a
cost direct direct direct_det
cost tcp tcp tcp_det
exit $failed
