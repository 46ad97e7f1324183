"""Context parallelism through ``python -m hetpipe.pretrain`` across the
emulated vendor pipeline (cluster=cpu_mixed: an "nvidia" and an "amd" group of
CPU ranks, the boundary through the cross-vendor channel).

CP2 in each group (four ranks; CP rank i's slice crosses the vendor line to
CP rank i) trains with the losses of CP1 (two ranks) to fp32 rounding, with
document masking on so that per-chunk RoPE positions and block-causal masks
are in play; groups that ask for different CP degrees are refused in one line.
"""
import json

import pytest

from conftest import run_cli

RUN = ["+model=tiny_llama", "cluster=cpu_mixed", "train.seq_length=32", "train.global_batch_size=4",
       "train.micro_batch_size=2", "train.train_iters=3", "logging.progress=false", "model.num_layers=2",
       "data.reset_attention_mask=true", "data.reset_position_ids=true"]
TWO_PER_GROUP = ["cluster.groups.0.ranks_per_node=2", "cluster.groups.1.ranks_per_node=2"]


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(tmp_path, name, corpus_prefix, *overrides):
    run_dir = tmp_path / name
    proc = run_cli(["-m", "hetpipe.pretrain", *RUN, f"data.path={corpus_prefix}", f"hydra.run.dir={run_dir}",
                    *overrides], timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _losses(run_dir)


@pytest.mark.parametrize("method", ["allgather", "ring"])
def test_cp2_across_the_vendor_line_trains_as_cp1(tmp_path, corpus_prefix, method):
    cp1 = _train(tmp_path, "cp1", corpus_prefix)
    cp2 = _train(tmp_path, "cp2", corpus_prefix, *TWO_PER_GROUP, "partition.cp=2", f"partition.cp_method={method}")
    assert len(cp1) == 3
    assert "cp: 2" in (tmp_path / "cp2" / "plan.yaml").read_text()
    assert cp2 == pytest.approx(cp1, rel=1e-5)


def test_different_cp_degrees_across_the_vendor_line_are_one_line(tmp_path):
    proc = run_cli(["-m", "hetpipe.pretrain", *RUN, *TWO_PER_GROUP, "partition.cp_per_group=[2,1]",
                    f"hydra.run.dir={tmp_path}"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hetpipe: error:")]
    assert len(errors) == 1 and "same CP degree" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_cp2_checkpoint_resumes_under_cp1(tmp_path, corpus_prefix):
    """Checkpoints stay CP-neutral: every CP rank holds whole parameters, so a
    CP2 save is the same files as a CP1 one, and CP1 resumes it where CP1 would be."""
    ckpt = tmp_path / "ckpt"
    reference = _train(tmp_path, "reference", corpus_prefix, "train.train_iters=4")
    _train(tmp_path, "cp2", corpus_prefix, *TWO_PER_GROUP, "partition.cp=2", "train.train_iters=2",
           f"checkpoint.save_dir={ckpt}", "checkpoint.save_interval=2")
    resumed = _train(tmp_path, "cp1", corpus_prefix, "train.train_iters=4", f"checkpoint.save_dir={ckpt}",
                     "checkpoint.resume=latest")
    assert resumed[-2:] == pytest.approx(reference[-2:], rel=1e-5)


# -- composition: CP with TP, with a zero-bubble schedule, with EOD-masked losses -----------------

HOMOGENEOUS = ["cluster=cpu_homogeneous", "cluster.groups.0.ranks_per_node=4"]


def _train_on(tmp_path, name, corpus_prefix, cluster, *overrides):
    return _train(tmp_path, name, corpus_prefix, *cluster, *overrides)


def test_cp2_with_tp2_trains_as_tp2(tmp_path, corpus_prefix):
    """One stage of TP2 x CP2 (TP fastest, then CP) against one of TP2."""
    tp2 = _train_on(tmp_path, "tp2", corpus_prefix, ["cluster=cpu_homogeneous"], "partition.tp=2")
    both = _train_on(tmp_path, "tp2cp2", corpus_prefix, HOMOGENEOUS, "partition.tp=2", "partition.cp=2")
    assert both == pytest.approx(tp2, rel=1e-5)


def test_cp2_under_zb_h1_trains_as_cp1(tmp_path, corpus_prefix):
    """zb_h1 defers each layer's weight gradients (W) past its input gradients
    (B); the K/V exchange's gradients flow in B, so CP2 keeps CP1's losses."""
    cp1 = _train_on(tmp_path, "cp1", corpus_prefix, ["cluster=cpu_homogeneous"], "partition.schedule=zb_h1")
    cp2 = _train_on(tmp_path, "cp2", corpus_prefix, HOMOGENEOUS, "partition.schedule=zb_h1", "partition.cp=2")
    assert cp2 == pytest.approx(cp1, rel=1e-5)


def test_cp2_with_eod_mask_loss_trains_as_cp1(tmp_path, corpus_prefix):
    """EOD-masked labels count unevenly over the CP slices; each rank weighs
    its mean by its share of the microbatch's counted tokens."""
    cp1 = _train(tmp_path, "cp1", corpus_prefix, "data.eod_mask_loss=true")
    cp2 = _train(tmp_path, "cp2", corpus_prefix, *TWO_PER_GROUP, "partition.cp=2", "data.eod_mask_loss=true")
    assert cp2 == pytest.approx(cp1, rel=1e-5)
