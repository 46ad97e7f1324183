#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the whole suite
# (CPU only, real processes and emulated nodes; about 23 minutes on two cores,
# measured 2026-11-26 on a fresh clone: 1047 tests, 21.5 min of pytest, 22.6 with the install).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k hf -x`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest -q "$@"
