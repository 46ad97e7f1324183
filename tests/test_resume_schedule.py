"""A resume whose command line changes the learning-rate schedule (here
train.train_iters, which sets the cosine's length) is named in one line with
old and new values; checkpoint.schedule says whether to stop (the default),
go on with the new values or take the checkpoint's."""
import json
import shutil

import pytest

from conftest import run_cli, run_pretrain
from hetpipe.schema.pretrain_config import OptimizerConfig, resolve
from hetpipe.training.schedule_change import schedule_changes, schedule_record
from hetpipe.training.trainer import lr_at

pytestmark = pytest.mark.timeout(300)

COMMON = ["+model=tiny_llama", "model.hidden_size=64", "model.ffn_hidden_size=160", "train.seq_length=32",
          "train.micro_batch_size=2", "train.global_batch_size=4", "optimizer.lr=3e-3", "optimizer.min_lr=3e-4",
          "optimizer.lr_warmup_iters=1", "logging.progress=false", "cluster.groups.0.device_type=CPU"]
OPT = OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=1)


@pytest.fixture(scope="module")
def two_step_checkpoint(tmp_path_factory, corpus_prefix):
    """A save directory holding the checkpoint of a 2-step run (its cosine decays over 2 steps)."""
    tmp = tmp_path_factory.mktemp("sched")
    run_pretrain(tmp / "run", [*COMMON, f"data.path={corpus_prefix}", "train.train_iters=2",
                               f"checkpoint.save_dir={tmp / 'ckpt'}"])
    return tmp / "ckpt"


def _resume(tmp_path, checkpoint, data, *overrides):
    """Resume a copy of ``checkpoint`` for train.train_iters=4; returns the process and the run dir."""
    save_dir = tmp_path / "ckpt"
    shutil.copytree(checkpoint, save_dir)
    run_dir = tmp_path / "run"
    proc = run_cli(["-m", "hetpipe.pretrain", *COMMON, f"data.path={data}", "train.train_iters=4",
                    f"checkpoint.save_dir={save_dir}", "checkpoint.resume=latest", *overrides,
                    f"hydra.run.dir={run_dir}"])
    return proc, run_dir


def _lrs(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in rows if "lr" in r}


def test_a_changed_schedule_stops_the_resume_in_one_line(tmp_path, two_step_checkpoint, corpus_prefix):
    proc, run_dir = _resume(tmp_path, two_step_checkpoint, corpus_prefix)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "hetpipe: error: the learning-rate schedule differs from the checkpoint's: train.train_iters 2 -> 4; "
        "checkpoint.schedule=config resumes with the new values, checkpoint.schedule=checkpoint with the "
        "checkpoint's")
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted(
        p.name for p in two_step_checkpoint.iterdir())  # nothing trained, nothing saved


@pytest.mark.parametrize("setting, decay_iters", [("config", 4), ("checkpoint", 2)])
def test_a_changed_schedule_resumes_with_the_values_asked_for(tmp_path, two_step_checkpoint, corpus_prefix,
                                                              setting, decay_iters):
    proc, run_dir = _resume(tmp_path, two_step_checkpoint, corpus_prefix, f"checkpoint.schedule={setting}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    which = "this run's new values" if setting == "config" else \
        "the checkpoint's schedule (train.train_iters stays 4)"
    assert ("hetpipe: note: the learning-rate schedule differs from the checkpoint's: train.train_iters 2 -> 4; "
            f"resuming with {which} (checkpoint.schedule={setting})") in proc.stdout
    # Steps 3 and 4 follow a cosine over 4 steps (config) or stay past the 2-step one at min_lr (checkpoint).
    assert _lrs(run_dir) == {s: pytest.approx(lr_at(s - 1, OPT, decay_iters)) for s in (3, 4)}
    assert lr_at(2, OPT, 4) != pytest.approx(lr_at(2, OPT, 2))


def _cfg(train_iters, **optimizer):
    return resolve({"model": {"name": "m"}, "train": {"train_iters": train_iters},
                    "optimizer": {"lr_warmup_iters": 1, **optimizer}})


@pytest.mark.parametrize("old, new, changes", [
    (_cfg(4), _cfg(8), [("train.train_iters", 4, 8)]),  # the cosine's end moves
    (_cfg(4, lr_decay_iters=8), _cfg(8, lr_decay_iters=8), []),  # a longer run on the same curve
    (_cfg(4, lr_warmup_iters=10), _cfg(8, lr_warmup_iters=10), []),  # every step still in its warmup
    (_cfg(4, lr_decay_style="constant"), _cfg(8, lr_decay_style="constant", min_lr=0.0), []),
    (_cfg(4), _cfg(4, lr=1e-3, lr_decay_iters=4), [("optimizer.lr", 3e-4, 1e-3)]),
    (_cfg(4), _cfg(8, lr_decay_iters=6), [("optimizer.lr_decay_iters", None, 6), ("train.train_iters", 4, 8)]),
])
def test_only_a_change_of_the_learning_rate_curve_is_a_change(old, new, changes):
    assert schedule_changes(schedule_record(old), new, lr_at) == changes
    assert schedule_changes({"optimizer.lr": 1.0}, new, lr_at) == []  # a record from another release: unchecked
