"""What keeps a days-long run alive, as a user sees it: a non-finite step is
skipped cleanly, a killed rank restarts the job, a preempted job saves and
exits 0, and the log names the straggler. Faults are injected with
HETPIPE_FAULT (hetpipe/process/faults.py) on a mixed (nvidia + amd group) CPU pipeline."""
import json

import pytest
import torch

from conftest import run_cli
from hetpipe.checkpoint import Checkpoint

pytestmark = pytest.mark.timeout(300)

COMMON = ["+model=tiny_llama", "model.hidden_size=64", "model.ffn_hidden_size=160", "train.seq_length=32",
          "train.micro_batch_size=2", "train.global_batch_size=8", "optimizer.lr=3e-3",
          "optimizer.lr_warmup_iters=2", "optimizer.lr_decay_iters=8", "train.log_interval=1",
          "logging.progress=false", "cluster=cpu_mixed"]


def _run(tmp_path, name, data, *overrides, fault=None, monkeypatch=None, expect=0):
    if fault is not None:
        monkeypatch.setenv("HETPIPE_FAULT", fault)
    run_dir = tmp_path / name
    proc = run_cli(["-m", "hetpipe.pretrain", *COMMON, f"data.path={data}", *overrides,
                    f"hydra.run.dir={run_dir}"])
    if fault is not None:
        monkeypatch.delenv("HETPIPE_FAULT")
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return proc, rows


def _losses(rows):
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _state(path):
    ckpt = Checkpoint(path)
    return dict(ckpt.iter_tensors(sorted(ckpt.tensors)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_prefix):
    _, rows = _run(tmp_path_factory.mktemp("ref"), "ref", corpus_prefix, "train.train_iters=6")
    return _losses(rows)


def test_non_finite_step_is_skipped_bitwise_and_logged(tmp_path, corpus_prefix, monkeypatch):
    ckpt = tmp_path / "ckpt"
    proc, rows = _run(tmp_path, "nan", corpus_prefix, "train.train_iters=4", f"checkpoint.save_dir={ckpt}",
                      "checkpoint.save_interval=1", "checkpoint.keep_last=0",
                      fault="nan@grads:rank=1:step=3", monkeypatch=monkeypatch)
    # The amd group's rank poisoned its gradients; every rank skipped the step:
    # weights and AdamW state after step 3 are those after step 2, bit for bit.
    before, after = _state(ckpt / "iter_0000002"), _state(ckpt / "iter_0000003")
    assert before.keys() == after.keys() and any(k.startswith("exp_avg/") for k in after)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    assert not torch.equal(after["layers.0.mlp.down.weight"], _state(ckpt / "iter_0000004")["layers.0.mlp.down.weight"])
    skipped = [r for r in rows if r.get("event") == "skipped"]
    assert skipped == [{"step": 3, "event": "skipped", "reason": "grad norm inf", "lr": skipped[0]["lr"],
                        "consumed_samples": 24, "consecutive_skips": 1, "skipped_steps": 1}]
    assert sorted(_losses(rows)) == [1, 2, 4]
    # The schedule counts applied updates (Megatron's train_step advances its scheduler
    # only on a successful update): step 4 trains at the lr the skipped step 3 had,
    # and the checkpoints carry the count for a resumed run.
    assert [r["lr"] for r in rows if r["step"] == 4] == [skipped[0]["lr"]]
    assert json.loads((ckpt / "iter_0000004" / "trainer_state.json").read_text())["extra"]["skipped_steps"] == 1
    assert "hetpipe: step 3 skipped: grad norm inf" in proc.stdout


def test_consecutive_non_finite_steps_stop_the_run_and_keep_the_good_checkpoint(tmp_path, corpus_prefix,
                                                                                monkeypatch):
    ckpt = tmp_path / "ckpt"
    proc, _ = _run(tmp_path, "diverged", corpus_prefix, "train.train_iters=6", f"checkpoint.save_dir={ckpt}",
                   "checkpoint.save_interval=2", "train.max_skipped_steps=2",
                   fault="nan@grads:rank=0:step=3;nan@grads:rank=0:step=4", monkeypatch=monkeypatch, expect=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hetpipe: error:")]
    assert len(set(e.split("] ", 1)[-1] for e in errors)) == 1, proc.stderr
    assert "training diverged: step 4 had grad norm inf, 2 non-finite steps in a row" in errors[0]
    assert "Traceback" not in proc.stderr
    # Steps 3 and 4 changed nothing, so the newest checkpoint is step 2's state.
    assert (ckpt / "latest").read_text().strip() == "iter_0000002"


def test_straggler_report_names_the_slow_rank(tmp_path, corpus_prefix, monkeypatch):
    proc, rows = _run(tmp_path, "slow", corpus_prefix, "train.train_iters=2", "logging.straggler=true",
                      fault="sleep=1.0@step:rank=1:attempt=any", monkeypatch=monkeypatch)
    # rank 1 (the amd stage) is slow to start each step, which is not a
    # neighbour wait, so it counts as busy; rank 0 spends that time waiting for it.
    assert all(r["straggler_rank"] == 1 and r["straggler_stage"] == 1 for r in rows)
    assert all(r["rank_busy_s"][1] > r["rank_busy_s"][0] + 0.5 for r in rows), rows
    assert "slowest rank 1 (stage 1) busy" in proc.stdout


def test_preemption_signal_saves_exits_zero_and_resumes_bitwise(tmp_path, corpus_prefix, reference, monkeypatch):
    ckpt = tmp_path / "ckpt"
    # Slurm signals every process of the job; here only the amd group's rank
    # gets SIGTERM, at the start of step 3: both ranks still stop after step 3.
    proc, rows = _run(tmp_path, "pre", corpus_prefix, "train.train_iters=6", f"checkpoint.save_dir={ckpt}",
                      fault="signal=SIGTERM@step:rank=1:step=3", monkeypatch=monkeypatch)
    assert "hetpipe: preempted by a signal on another rank after step 3" in proc.stdout  # rank 0's line
    assert (ckpt / "latest").read_text().strip() == "iter_0000003"
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert rows[-1]["event"] == "preempted"
    _, resumed = _run(tmp_path, "resumed", corpus_prefix, "train.train_iters=6", f"checkpoint.save_dir={ckpt}",
                      "checkpoint.resume=latest")
    assert {**_losses(rows), **_losses(resumed)} == reference


def test_killed_rank_restarts_the_job_and_converges_bitwise(tmp_path, corpus_prefix, reference, monkeypatch):
    ckpt = tmp_path / "ckpt"
    proc, rows = _run(tmp_path, "restart", corpus_prefix, "train.train_iters=6", f"checkpoint.save_dir={ckpt}",
                      "checkpoint.save_interval=2", "checkpoint.async_save=false", "train.max_restarts=1",
                      fault="kill@step:rank=1:step=4", monkeypatch=monkeypatch)
    # (Synchronous saves: the step-2 checkpoint is surely committed when rank 1
    # dies; an asynchronous one may still be in flight, and the job would
    # resume from step 0 - with the same losses, but not this test's lines.)
    assert "restarting" in proc.stdout + proc.stderr
    assert "hetpipe: restart 1 of 1: resumed after step 2" in proc.stdout
    # Steps 3 and 4 ran twice (before the kill, and after the restart); the
    # file keeps each step once, and a row says where the job restarted.
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert [r for r in rows if r.get("event") == "restart"] == [
        {"step": 2, "event": "restart", "restart": 1, "resumed_from_step": 2}]
    assert _losses(rows) == reference
