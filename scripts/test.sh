#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the whole suite
# (CPU only, real processes and emulated nodes) on one pytest-xdist worker per
# core, at most 4 (each worker's tests start up to six interpreters of a few
# hundred MB), or HETPIPE_TEST_WORKERS of them (0: in this process, one test at
# a time). Most of the suite waits on processes rather than computing (one
# worker kept 2 cores 0.8 busy: 19.7 CPU-minutes in 24.8 minutes), so two
# workers on two cores take about 15 minutes instead of 21.5 (measured
# 2026-11-26 on a fresh clone; numbers in the commit that made it so).
# Each worker takes whole modules (--dist loadscope: a module's shared reference
# runs are made once), longest first (tests/conftest.py).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k hf -x`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
cores=$(nproc)
workers=${HETPIPE_TEST_WORKERS:-$((cores < 4 ? cores : 4))}
exec "$root/.venv/bin/python" -m pytest -q -n "$workers" --dist loadscope --no-loadscope-reorder "$@"
