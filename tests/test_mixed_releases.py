"""Two emulated nodes on two torch releases: the evidence for what may differ between nodes.

scripts/torch_matrix.sh runs this file after the subset, with
``HETPIPE_MIXED_PYTHONS="<oldest venv's python> <newest venv's python>"``.
Without that variable it is skipped (the suite's own venv holds one release).

Each node starts exactly as a user's would (scripts/launch_cluster.sh, its
pre-flight doctor on), one node on the oldest supported torch and one on the
newest, either one hosting the rendezvous store. What a user of such a
cluster meets: the doctor's line for each node's build and no blocker, a
job that trains, and losses and gradient norms equal bit for bit to a
one-process run's on either release (fp32 on CPU). This is why the doctor
allows any supported release on any node (hetpipe/doctor/report.py: torch_lines).
"""
from __future__ import annotations

import os
import subprocess

import pytest

from cluster_nodes import JOB, metrics, start_nodes, wait_all
from conftest import REPO
from emulated_nodes import emulated_nodes, make_emulated_nodes, netns_available  # noqa: F401

PYTHONS = os.environ.get("HETPIPE_MIXED_PYTHONS", "").split()
pytestmark = [pytest.mark.timeout(400),
              pytest.mark.skipif(len(PYTHONS) != 2, reason="needs HETPIPE_MIXED_PYTHONS (scripts/torch_matrix.sh)")]


def _release(python: str) -> str:
    return subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                          text=True, check=True).stdout.strip()


def _build(version: str) -> str:
    """The doctor's name of a PyPI wheel's build: ``2.15.0+cu132`` -> ``CUDA 13.2``."""
    local = version.partition("+")[2]
    return f"CUDA {local[2:-1]}.{local[-1]}" if local.startswith("cu") else "CPU"


@pytest.mark.parametrize("order", ["oldest_hosts_the_store", "newest_hosts_the_store"])
def test_nodes_on_the_oldest_and_newest_release_pass_the_doctor_and_train_like_one_process(
        tmp_path, emulated_nodes, corpus_prefix, order):
    pythons = PYTHONS if order == "oldest_hosts_the_store" else PYTHONS[::-1]
    releases = [_release(p) for p in pythons]
    args = [*JOB, f"data.path={corpus_prefix}", "train.train_iters=3"]
    runs = start_nodes(emulated_nodes, args, tmp_path, python=dict(enumerate(pythons)), doctor=True)
    codes = wait_all(runs, timeout=300)
    outputs = [r.output() for r in runs]
    assert codes == [0, 0], [o[-3000:] for o in outputs]
    for out in outputs:
        assert "Traceback" not in out, out[-3000:]
        for node, (label, release) in enumerate(zip(("nvidia", "amd"), releases)):
            assert (f"hetpipe doctor: node {node} ({label}): torch {release} ({_build(release)} build): supported; "
                    "nodes may run different supported releases") in out, out[-3000:]
        assert "hetpipe doctor: ok: a job can start" in out

    mixed = [(r["loss"], r["grad_norm"]) for r in metrics(tmp_path / "run0")]
    assert len(mixed) == 3
    for k, python in enumerate(PYTHONS):
        single = subprocess.run([python, "-m", "hetpipe.pretrain", *args, "cluster=single",
                                 "cluster.groups.0.device_type=CPU", f"hydra.run.dir={tmp_path / f'single{k}'}"],
                                cwd=REPO, capture_output=True, text=True, timeout=200)
        assert single.returncode == 0, single.stderr[-2000:]
        assert [(r["loss"], r["grad_norm"]) for r in metrics(tmp_path / f"single{k}")] == mixed, _release(python)
