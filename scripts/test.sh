#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the whole suite
# (CPU only, several real processes; about ten minutes on two cores).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k hf -x`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest -q "$@"
