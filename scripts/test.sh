#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the whole suite
# (CPU only, real processes and emulated nodes; about 21 minutes on two cores,
# measured 2026-11-24 on a fresh clone: 887 tests, 20.1 min of pytest, 21.2 with the install).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k hf -x`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest -q "$@"
