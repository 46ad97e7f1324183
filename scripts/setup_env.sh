#!/usr/bin/env bash
# Creates (once) and refreshes the project's virtual environment in .venv:
# torch, then hetpipe in editable mode with its test extras. Re-runs the
# install only when pyproject.toml changed since the last one.
# Override the interpreter with PYTHON=..., the environment's folder with
# HETPIPE_VENV=... (default .venv; scripts/torch_matrix.sh makes one per torch
# release), the torch requirement with
# HETPIPE_TORCH=... (default: the CPU-friendly pin torch==2.13.0; on a GPU
# machine give the build that matches its CUDA or ROCm), and Mooncake's
# transfer engine (the mooncake movers) with HETPIPE_MOONCAKE=... : the extra
# of this machine's runtime, mooncake (no GPU, default), mooncake-cuda12,
# mooncake-cuda13 or mooncake-rocm, or none. Its wheels need rdma-core's
# libibverbs.so.1 from the OS; this script installs libibverbs1 through
# apt-get where it runs as root, and otherwise says what to install.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HETPIPE_VENV:-$root/.venv}
python=${PYTHON:-python3}
torch_req=${HETPIPE_TORCH:-torch==2.13.0}
mooncake=${HETPIPE_MOONCAKE:-mooncake}
case "$mooncake" in
  none) extras=test wheel= ;;
  mooncake) extras=test,mooncake wheel=mooncake-transfer-engine-non-cuda ;;
  mooncake-cuda12) extras=test,mooncake-cuda12 wheel=mooncake-transfer-engine ;;
  mooncake-cuda13|mooncake-rocm) extras="test,$mooncake" wheel="mooncake-transfer-engine-${mooncake#mooncake-}" ;;
  *) echo "hetpipe: HETPIPE_MOONCAKE=$mooncake is not one of mooncake, mooncake-cuda12, mooncake-cuda13," \
          "mooncake-rocm, none" >&2; exit 2 ;;
esac

# grep without -q reads ldconfig's whole output: an early exit would fail the pipe under pipefail.
if [ "$mooncake" != none ] && ! ldconfig -p 2>/dev/null | grep 'libibverbs\.so\.1 ' >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "hetpipe: installing libibverbs1 (Mooncake's wheels link rdma-core's libibverbs.so.1)" >&2
    # Never fatal: without it only the mooncake movers (and their tests) are unavailable.
    apt-get install -y -q libibverbs1 >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null 2>&1; } ||
      echo "hetpipe: could not install libibverbs1 with apt-get; the mooncake movers refuse to start" \
           "and their tests skip until it is installed" >&2
  else
    echo "hetpipe: Mooncake's wheels need rdma-core's libibverbs.so.1: install libibverbs1 (Debian/Ubuntu) or" \
         "libibverbs (RHEL); until then the mooncake movers refuse to start and their tests skip" >&2
  fi
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "hetpipe: creating virtual environment in $venv" >&2
  "$python" -m venv "$venv"
fi
stamp="$venv/.hetpipe-installed"
want=$( (cat "$root/pyproject.toml"; echo "$torch_req $extras") | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "hetpipe: installing dependencies (first run takes a minute or two)" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$torch_req"
  # The four Mooncake wheels install the same package: drop another runtime's before adding this one's.
  for other in mooncake-transfer-engine-non-cuda mooncake-transfer-engine mooncake-transfer-engine-cuda13 \
               mooncake-transfer-engine-rocm; do
    if [ "$other" != "$wheel" ]; then
      "$venv/bin/python" -m pip uninstall -q -y --disable-pip-version-check "$other" >/dev/null 2>&1 || true
    fi
  done
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$root[$extras]"
  echo "$want" > "$stamp"
fi
