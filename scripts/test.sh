#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the whole suite
# (CPU only, real processes and emulated nodes) on pytest-xdist workers, one
# more than the cores, at most 4 (each worker's tests start up to six
# interpreters of a few hundred MB), or HETPIPE_TEST_WORKERS of them (0: in this
# process, one test at a time). Most of the suite waits on processes rather than
# computing: one worker kept two cores 0.8 busy (19.7 CPU-minutes in 24.8
# minutes), two workers still left a third of them idle, so the third worker
# runs in that wait. Each worker takes whole modules (--dist loadscope: a
# module's shared reference runs are made once), longest first (tests/conftest.py).
# Every process of the suite runs torch on one intra-op thread (OMP_NUM_THREADS,
# unless set): the test models are too small to gain from more, and with three
# workers' processes on two cores, threads spinning in OpenMP barriers stole
# each other's cores (tests/test_pretrain.py's 40-step CLI run: 15 s alone,
# 100 s in the suite).
# The C++ kernels inductor compiles for the fused and compiled paths on a CPU are
# scalar (TORCHINDUCTOR_VEC_ISA_OK=0, unless set): the same graphs and fusions, the
# same comparisons with eager, for less compiler work on a cold cache, as CI has
# (docs/benchmarks.md, "The suite's time, third step"); GPU runs compile Triton.
# Each `python -m hetpipe...` command a test runs (and those of the scripts and
# emulated nodes it starts) is a process forked from one interpreter per worker
# that imported torch and hetpipe once (tests/cli_zygote.py): a fresh one spent
# 2 CPU-s importing, and its ranks' fork server 3.6 more (HETPIPE_TEST_FRESH_PYTHON=1:
# fresh interpreters, as scripts/torch_matrix.sh runs).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k hf -x`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
cores=$(nproc)
workers=${HETPIPE_TEST_WORKERS:-$((cores + 1 < 4 ? cores + 1 : 4))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCHINDUCTOR_VEC_ISA_OK=${TORCHINDUCTOR_VEC_ISA_OK:-0}
exec "$root/.venv/bin/python" -m pytest -q -n "$workers" --dist loadscope --no-loadscope-reorder "$@"
