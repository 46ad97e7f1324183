#!/usr/bin/env bash
# The multi-process subset of the suite (pytest -m torch_matrix: the local
# launcher's mixed-vendor pipeline over tcp, gloo and direct, a restart after a
# killed rank, preemption, two emulated nodes, checkpoint resume and reshard,
# the doctor, and tests/test_torch_compat.py) on the oldest and newest torch
# hetpipe supports, each in its own virtual environment (.venv-torch<version>,
# made once by scripts/setup_env.sh and reused); then two emulated nodes, one
# on each (tests/test_mixed_releases.py).
#
# `versions` are exact releases so that a run is reproducible: the range's ends
# (hetpipe/process/torch_compat.py: TORCH_RANGE; a test holds the three equal). When a
# newer torch appears on the package index it enters the range by an edit of
# both, after this script passed on it - never by itself.
#
# The wheels come from the package index with pip's configuration files
# ignored (PIP_CONFIG_FILE=/dev/null): a machine's own pip configuration may
# cap or redirect torch (ours caps it at the build that lies on disk), and this
# script must not depend on a machine's edits. PyPI's Linux wheels bring their
# CUDA libraries (about 4.6 GB a version) and run on CPU.
#
# Usage: bash scripts/torch_matrix.sh [VERSION ...]   (extra pytest arguments: TORCH_MATRIX_PYTEST_ARGS)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
versions=(2.11.0 2.15.0)
[ $# -gt 0 ] && versions=("$@")
status=0
# As scripts/test.sh: pytest-xdist workers, one more than the cores (at most 4), whole modules each.
cores=$(nproc)
workers=${HETPIPE_TEST_WORKERS:-$((cores + 1 < 4 ? cores + 1 : 4))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one intra-op thread per process, as scripts/test.sh says why
export TORCHINDUCTOR_VEC_ISA_OK=${TORCHINDUCTOR_VEC_ISA_OK:-0}  # scalar CPU kernels, as scripts/test.sh says why
# Every command in a fresh interpreter, as users start them: the main suite forks its
# `python -m` commands from one that imported torch and hetpipe once (tests/cli_zygote.py),
# so here each release also runs the real start-up.
export HETPIPE_TEST_FRESH_PYTHON=${HETPIPE_TEST_FRESH_PYTHON:-1}
for version in "${versions[@]}"; do
  venv="$root/.venv-torch$version"
  echo "hetpipe: torch $version: the multi-process subset in $venv" >&2
  start=$SECONDS
  PIP_CONFIG_FILE=/dev/null PIP_CONSTRAINT= HETPIPE_VENV="$venv" HETPIPE_TORCH="torch==$version" \
    HETPIPE_MOONCAKE=none bash "$root/scripts/setup_env.sh"
  got=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
  case "$got" in
    "$version"|"$version"+*) ;;
    *) echo "hetpipe: error: $venv has torch $got, not $version" >&2; exit 2 ;;
  esac
  # shellcheck disable=SC2086
  (cd "$root" && "$venv/bin/python" -m pytest -q -m torch_matrix -p no:cacheprovider -n "$workers" --dist loadscope \
     --no-loadscope-reorder ${TORCH_MATRIX_PYTEST_ARGS:-}) ||
    status=1
  echo "hetpipe: torch $version: $((SECONDS - start)) s with the set-up" >&2
done
# Two emulated nodes, one on the first release and one on the last (either
# hosting the store): the doctor's rule on mixed releases rests on this run.
if [ ${#versions[@]} -ge 2 ]; then
  start=$SECONDS
  first="$root/.venv-torch${versions[0]}/bin/python" last="$root/.venv-torch${versions[-1]}/bin/python"
  (cd "$root" && HETPIPE_MIXED_PYTHONS="$first $last" "$first" -m pytest -q -p no:cacheprovider \
     tests/test_mixed_releases.py ${TORCH_MATRIX_PYTEST_ARGS:-}) || status=1
  echo "hetpipe: nodes on torch ${versions[0]} and ${versions[-1]}: $((SECONDS - start)) s" >&2
fi
exit $status
