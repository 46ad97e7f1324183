"""Tensor and data parallelism inside vendor groups, through the user's entry point.

Every run is ``python -m hetpipe.pretrain`` with real processes (gloo on CPU
standing in for NCCL/RCCL inside a group). The reference is the one-process
run of the same model, data order and global batch: TP and DP change the
summation order of some reductions, so losses agree to rounding (1e-6
relative on one stage, 1e-5 with a pipeline boundary as well), not bitwise.
"""
import json

import pytest
import yaml

from conftest import run_cli, run_pretrain

pytestmark = pytest.mark.timeout(400)

STEPS = 10
COMMON = ["+model=tiny_llama", "model.hidden_size=64", "model.ffn_hidden_size=160",
          f"train.train_iters={STEPS}", "train.seq_length=32", "train.micro_batch_size=2",
          "train.global_batch_size=8", "train.log_interval=5", "optimizer.lr=3e-3",
          "optimizer.clip_grad=0.5", "cluster.groups.0.device_type=CPU", "logging.progress=false"]
MIXED_2X2 = ["cluster=cpu_mixed", "cluster.groups.0.ranks_per_node=2", "cluster.groups.1.ranks_per_node=2"]


def _train(run_dir, data, *overrides):
    return run_pretrain(run_dir, [*COMMON, f"data.path={data}", *overrides], timeout=300)


def _close(got, ref, rel):
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(got, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=rel), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=10 * rel), (a, b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_prefix):
    return _train(tmp_path_factory.mktemp("ref") / "single", corpus_prefix)[1]


def test_tp2_one_stage_matches_single_process(tmp_path, corpus_prefix, reference):
    proc, got = _train(tmp_path / "tp2", corpus_prefix, "cluster=cpu_homogeneous", "partition.tp=2")
    _close(got, reference, 1e-6)
    assert "TP2 x DP1" in proc.stdout
    plan = yaml.safe_load((tmp_path / "tp2" / "plan.yaml").read_text())
    assert [(s["tp"], s["dp"], s["ranks"]) for s in plan["stages"]] == [(2, 1, [0, 1])]
    # Clipping was active, so the norm really was assembled from both TP shards.
    assert max(r["grad_norm"] for r in reference) > 0.5


def test_tp2_with_sequence_parallelism_matches(tmp_path, corpus_prefix, reference):
    _, got = _train(tmp_path / "sp", corpus_prefix, "cluster=cpu_homogeneous", "partition.tp=2",
                    "partition.sequence_parallel=true")
    _close(got, reference, 1e-5)


@pytest.mark.parametrize("distributed", [False, True])
def test_dp2_matches_single_process(tmp_path, corpus_prefix, reference, distributed):
    proc, got = _train(tmp_path / "dp2", corpus_prefix, "cluster=cpu_homogeneous", "partition.dp=2",
                       f"optimizer.distributed={distributed}", "partition.grad_bucket_mb=0.01")
    _close(got, reference, 1e-6)
    assert "2 microbatches/step per DP rank" in proc.stdout


def test_pp2_with_tp2_on_one_vendor_group_only(tmp_path, corpus_prefix, reference):
    # Group nvidia: two ranks, TP2, one stage; group amd: one rank, TP1. The
    # cross-vendor boundary joins TP degrees 2 and 1.
    proc, got = _train(tmp_path / "pp2tp2", corpus_prefix, "cluster=cpu_mixed",
                       "cluster.groups.0.ranks_per_node=2", "partition.tp_per_group=[2,1]",
                       "partition.layers=[1,3]")
    _close(got, reference, 1e-5)
    plan = yaml.safe_load((tmp_path / "pp2tp2" / "plan.yaml").read_text())
    assert [(s["group"], s["tp"], s["ranks"]) for s in plan["stages"]] == [("nvidia", 2, [0, 1]), ("amd", 1, [2])]


def test_pp2_with_dp2_on_cpu_mixed(tmp_path, corpus_prefix, reference):
    _, got = _train(tmp_path / "pp2dp2", corpus_prefix, *MIXED_2X2, "partition.dp=2",
                    "partition.layers=[1,3]", "optimizer.distributed=true")
    _close(got, reference, 1e-5)
    plan = yaml.safe_load((tmp_path / "pp2dp2" / "plan.yaml").read_text())
    assert [(s["group"], s["dp"], s["ranks"]) for s in plan["stages"]] == [("nvidia", 2, [0, 1]), ("amd", 2, [2, 3])]


def test_tp2_checkpoint_resumes_at_tp1(tmp_path, corpus_prefix, reference):
    # Save after 5 steps at TP2 x DP1 on two ranks, resume on one process:
    # checkpoints hold whole tensors, so the degree may change.
    ckpt = ["checkpoint.save_interval=5", f"checkpoint.save_dir={tmp_path / 'ckpt'}"]
    _train(tmp_path / "a", corpus_prefix, "cluster=cpu_homogeneous", "partition.tp=2",
           "train.train_iters=5", *ckpt)
    proc, got = _train(tmp_path / "b", corpus_prefix, *ckpt, "checkpoint.resume=latest")
    assert "resumed from" in proc.stdout
    _close(got, reference[5:], 1e-5)


def test_distributed_optimizer_checkpoint_resumes(tmp_path, corpus_prefix, reference):
    ckpt = ["checkpoint.save_interval=5", f"checkpoint.save_dir={tmp_path / 'ckpt'}"]
    dp = ["cluster=cpu_homogeneous", "partition.dp=2", "optimizer.distributed=true"]
    _train(tmp_path / "a", corpus_prefix, *dp, "train.train_iters=5", *ckpt)
    manifest = json.loads(next((tmp_path / "ckpt").glob("iter_*/manifest.json")).read_text())
    assert "exp_avg/layers.0.mlp.down.weight" in manifest["tensors"]
    proc, got = _train(tmp_path / "b", corpus_prefix, *dp, *ckpt, "checkpoint.resume=latest")
    assert "resumed from" in proc.stdout
    _close(got, reference[5:], 1e-5)


@pytest.mark.parametrize("overrides, message", [
    (["cluster=cpu_homogeneous", "partition.tp=3"], "not a multiple of TP3 x DP1"),
    (["cluster=cpu_homogeneous", "partition.dp=2", "train.global_batch_size=6"],
     "global_batch_size=6 is not a multiple of micro_batch_size=2 x DP2"),
    (["cluster=cpu_mixed", "partition.tp_per_group=[1]"], "has 1 entries but cluster 'cpu_mixed' has 2 groups"),
])
def test_bad_parallel_layouts_are_one_clear_line(tmp_path, corpus_prefix, overrides, message):
    proc = run_cli(["-m", "hetpipe.pretrain", *COMMON, f"data.path={corpus_prefix}",
                    f"hydra.run.dir={tmp_path}", *overrides])
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert message in proc.stderr


def test_plan_with_unequal_dp_is_refused(tmp_path, corpus_prefix):
    plan = {"schedule": "1f1b", "num_chunks": 1, "stages": [
        {"group": "nvidia", "ranks": [0, 1], "layers": 2, "tp": 1, "dp": 2},
        {"group": "amd", "ranks": [2], "layers": 2, "tp": 1, "dp": 1}]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    proc = run_cli(["-m", "hetpipe.pretrain", *COMMON, f"data.path={corpus_prefix}",
                    f"hydra.run.dir={tmp_path / 'run'}", "cluster=cpu_mixed", "cluster.groups.0.ranks_per_node=2",
                    f"plan={path}"])
    assert proc.returncode == 2, proc.stderr
    assert "DP must be equal across stages" in proc.stderr


def test_planner_tp_plan_is_applied_by_pretrain(tmp_path, corpus_prefix, reference):
    # The partitioner's plan carries TP per stage; pretrain runs it as planned.
    plan_dir = tmp_path / "plan"
    proc = run_cli(["-m", "hetpipe.plan", *COMMON[:3], "cluster=cpu_homogeneous", "train.seq_length=32",
                    "train.micro_batch_size=2", "train.global_batch_size=8", "planner.tp=2",
                    f"hydra.run.dir={plan_dir}"])
    assert proc.returncode == 0, proc.stderr
    assert "2x1" in proc.stdout
    _, got = _train(tmp_path / "run", corpus_prefix, "cluster=cpu_homogeneous", f"plan={plan_dir / 'plan.yaml'}")
    plan = yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())
    assert [(s["tp"], s["ranks"]) for s in plan["stages"]] == [(2, [0, 1])]
    _close(got, reference, 1e-6)
