#!/usr/bin/env bash
# Creates (once) and refreshes the project's virtual environment in .venv:
# torch, then hetpipe in editable mode with its test extras. Re-runs the
# install only when pyproject.toml changed since the last one.
# Override the interpreter with PYTHON=..., the torch requirement with
# HETPIPE_TORCH=... (default: the CPU-friendly pin torch==2.13.0; on a GPU
# machine give the build that matches its CUDA or ROCm).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
python=${PYTHON:-python3}
torch_req=${HETPIPE_TORCH:-torch==2.13.0}

if [ ! -x "$venv/bin/python" ]; then
  echo "hetpipe: creating virtual environment in $venv" >&2
  "$python" -m venv "$venv"
fi
stamp="$venv/.hetpipe-installed"
want=$( (cat "$root/pyproject.toml"; echo "$torch_req") | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "hetpipe: installing dependencies (first run takes a minute or two)" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$torch_req"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$root[test]"
  echo "$want" > "$stamp"
fi
