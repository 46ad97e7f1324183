"""Node-local checkpoint directories on two emulated nodes (network namespaces).

Each node is started with the real launcher (tests/cluster_nodes.py) and
writes into a directory of its own - ``checkpoint.save_dir`` with ``{node}``,
standing in for each node's local disk, since the emulated nodes share one
filesystem. What a user would notice: each directory holds its own node's
shards and the same manifest, the job resumes from them on both nodes, and
the losses after the resume are bitwise those of an uninterrupted run - also
when a crash fell between the two nodes' commits, leaving their newest
checkpoints at different steps. Skipped, with the reason, where namespaces cannot be made.
"""
from __future__ import annotations

import shutil

import pytest

from cluster_nodes import JOB, metrics, start_nodes, wait_all
from conftest import run_pretrain
from emulated_nodes import emulated_nodes, make_emulated_nodes, netns_available  # noqa: F401

pytestmark = pytest.mark.timeout(420)


def _run(emulated_nodes, args, tmp_path, name):
    where = tmp_path / name
    where.mkdir()
    runs = start_nodes(emulated_nodes, args, where)
    codes = wait_all(runs, timeout=150)
    assert codes == [0, 0], "".join(f"\n--- node {r.rank}:\n{r.output()[-3000:]}" for r in runs)
    return where, runs


def test_each_node_keeps_its_own_shards_and_the_job_resumes_from_them_bitwise(tmp_path, emulated_nodes,
                                                                               corpus_prefix):
    save_dir = tmp_path / "ckpt-node{node}"
    args = [*JOB, f"data.path={corpus_prefix}", f'checkpoint.save_dir="{save_dir}"', "checkpoint.save_interval=2"]
    first, runs = _run(emulated_nodes, [*args, "train.train_iters=2"], tmp_path, "first")
    assert sum(r.output().count("hetpipe: saved checkpoint") for r in runs) == 1  # rank 0 says it, once

    node_dirs = [tmp_path / f"ckpt-node{k}" / "iter_0000002" for k in (0, 1)]
    for path, ranks in zip(node_dirs, ((0, 1), (2, 3))):
        assert sorted(p.name for p in path.iterdir()) == [
            "manifest.json", *(f"{kind}-rank{r:05d}.safetensors" for kind in ("model", "optim", "rng") for r in ranks),
            "trainer_state.json"]
    assert node_dirs[0].joinpath("manifest.json").read_bytes() == node_dirs[1].joinpath("manifest.json").read_bytes()

    second, runs = _run(emulated_nodes, [*args, "train.train_iters=4", "checkpoint.resume=latest"], tmp_path, "second")
    assert f"resumed from {node_dirs[0]} after step 2; RNG states restored" in runs[0].output()
    assert "Traceback" not in runs[0].output() + runs[1].output()

    _, reference = run_pretrain(tmp_path / "single", [*JOB, f"data.path={corpus_prefix}", "train.train_iters=4",
                                                      "cluster=single", "cluster.groups.0.device_type=CPU"])
    got = metrics(first / "run0") + metrics(second / "run0")
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in got] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in reference]
    assert sorted(p.name for p in (tmp_path / "ckpt-node1").iterdir()) == ["iter_0000002", "iter_0000004", "latest"]

    # A crash between the two nodes' commits of step 4: node 1 never committed it.
    shutil.rmtree(tmp_path / "ckpt-node1" / "iter_0000004")
    (tmp_path / "ckpt-node1" / "latest").write_text("iter_0000002\n")
    third, runs = _run(emulated_nodes, [*args, "train.train_iters=4", "checkpoint.resume=latest"], tmp_path, "third")
    assert ("the nodes' latest checkpoints differ (steps 2 to 4: a save was cut off between their commits); "
            "resuming from step 2, which every node holds") in runs[0].output()
    assert [(r["step"], r["loss"]) for r in metrics(third / "run0")] == [(r["step"], r["loss"]) for r in reference[2:]]
