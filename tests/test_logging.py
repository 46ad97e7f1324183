"""Run logging: TensorBoard scalars, validation rows, wandb settings.

metrics.jsonl is the record (compare and resume read it); TensorBoard and
wandb must mirror exactly its values, and a validation row must reach every
sink without changing the training rows that readers select by ``loss``.
"""
import math
import re
import sys
import types

import pytest
import torch

from conftest import run_cli, run_pretrain
from hetpipe.observe.metrics import MetricsLogger, RunShape, read_metrics
from hetpipe.schema.pretrain_config import LoggingConfig

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

TINY_RUN = ["+model=tiny_llama", "data=demo", "train.train_iters=3", "train.seq_length=32",
            "train.global_batch_size=4", "train.micro_batch_size=2", "logging.progress=false"]


def _scalars(run_dir):
    """{tag: [(step, value)]} of a run's TensorBoard events."""
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _f32(x):
    return float(torch.tensor(x, dtype=torch.float32))  # TensorBoard stores scalars as float32


def _logger(run_dir, start_step=0, **logging):
    shape = RunShape(total_steps=4, tokens_per_step=64, flops_per_step=1e6, num_devices=1, peak_tflops=None,
                     log_interval=2)
    return MetricsLogger(run_dir, shape, LoggingConfig(progress=False, **logging), start_step=start_step)


@pytest.mark.timeout(240)
def test_tensorboard_scalars_equal_metrics_jsonl_of_a_real_run(tmp_path):
    run_dir = tmp_path / "run"
    _, rows = run_pretrain(run_dir, [*TINY_RUN, "logging.tensorboard=true"])
    scalars = _scalars(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
        assert scalars[f"train/{key}"] == [(r["step"], _f32(r[key])) for r in rows], key
    # TFLOP/s and MFU mean nothing on a CPU (no known peak): no field, no scalar,
    # not in the console line, rather than a fake 0.001.
    assert "train/mfu" not in scalars and "train/tflops_per_device" not in scalars
    assert not any("mfu" in r or "tflops_per_device" in r for r in rows)


@pytest.mark.timeout(60)
def test_each_row_times_its_own_step_and_the_console_line_its_interval(tmp_path, monkeypatch, capsys):
    now = [100.0]
    monkeypatch.setattr("hetpipe.observe.metrics.time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    shape = RunShape(total_steps=4, tokens_per_step=64, flops_per_step=4e12, num_devices=2, peak_tflops=4.0,
                     log_interval=2)
    log = MetricsLogger(tmp_path / "gpu", shape, LoggingConfig(progress=False))
    for step, took in enumerate([1.0, 3.0, 2.0, 2.0], 1):
        now[0] += took
        log.record(step, torch.tensor(1.0), torch.tensor(1.0), 1e-3, 8 * step)
    log.close()
    rows = read_metrics(tmp_path / "gpu")
    assert [r["step_time_s"] for r in rows] == [1.0, 3.0, 2.0, 2.0]
    assert [r["tokens_per_s"] for r in rows] == pytest.approx([64.0, 64 / 3, 32.0, 32.0])
    assert [r["tflops_per_device"] for r in rows] == pytest.approx([2.0, 2 / 3, 1.0, 1.0])
    assert [r["mfu"] for r in rows] == pytest.approx([0.5, 1 / 6, 0.25, 0.25])
    # The console line of steps 1-2 gives their average: 2 s a step.
    lines = capsys.readouterr().out.splitlines()
    line = next(x for x in lines if " step      2/4 " in x)
    # Off a terminal (this capture, Slurm, pretrain.log): a timestamp first, elapsed time and ETA last.
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d step      2/4 \| loss 1\.0000 \| lr 1\.000e-03 \| "
                        r"grad norm 1\.000 \| 32 tok/s \| 1\.000 TFLOP/s/device \| MFU 25\.0% \| "
                        r"elapsed 0:00:04, ETA 0:00:04", line), line
    assert next(x for x in lines if " step      4/4 " in x).endswith("| elapsed 0:00:08, ETA 0:00:00")

    # A CPU (no peak): neither TFLOP/s nor MFU, in the rows or the line.
    cpu = RunShape(total_steps=2, tokens_per_step=64, flops_per_step=4e12, num_devices=1, peak_tflops=None,
                   log_interval=2, reports_flops=False)
    log = MetricsLogger(tmp_path / "cpu", cpu, LoggingConfig(progress=False))
    for step in (1, 2):
        now[0] += 1.0
        log.record(step, torch.tensor(1.0), torch.tensor(1.0), 1e-3, 8 * step)
    log.close()
    assert not any("tflops_per_device" in r or "mfu" in r for r in read_metrics(tmp_path / "cpu"))
    assert capsys.readouterr().out.rstrip().endswith("| 64 tok/s | elapsed 0:00:02, ETA 0:00:00")


@pytest.mark.timeout(60)
def test_validation_rows_reach_every_sink_and_compare(tmp_path, capsys):
    run_dir = tmp_path / "a"
    log = _logger(run_dir, tensorboard=True)
    for step, loss in enumerate([5.25, 4.5, 4.125, 3.0625], 1):
        log.record(step, torch.tensor(loss), torch.tensor(1.0), 1e-3, 8 * step)
        if step in (2, 3):  # 2 ends a log interval, 3 is mid-interval
            log.record_validation(step, loss + 0.5, math.exp(loss + 0.5))
    log.close()
    rows = read_metrics(run_dir)
    # The training rows up to a validation step are written before its row,
    # so the file stays in step order; validation rows carry no "loss".
    assert [(r["step"], "loss" in r) for r in rows] == [(1, True), (2, True), (2, False), (3, True), (3, False),
                                                        (4, True)]
    assert rows[2] == {"step": 2, "val_loss": 5.0, "val_ppl": math.exp(5.0)}
    out = capsys.readouterr().out
    assert f"validation at step 3: loss 4.6250 | ppl {math.exp(4.625):.3f}" in out.splitlines()
    scalars = _scalars(run_dir)
    assert scalars["val/loss"] == [(2, 5.0), (3, 4.625)]
    assert scalars["val/ppl"] == [(2, _f32(math.exp(5.0))), (3, _f32(math.exp(4.625)))]
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4]

    # compare reads the validation curve next to the training curve.
    other = tmp_path / "b"
    other.mkdir()
    (other / "metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text().replace('"val_loss": 4.625',
                                                                                         '"val_loss": 4.75'))
    proc = run_cli(["-m", "hetpipe.compare", str(run_dir), str(other), "--rtol", "0.01"])
    assert proc.returncode == 1, proc.stderr
    # b's lines: its summary, its training comparison, its validation comparison.
    _, training, validation = [line for line in proc.stdout.splitlines() if line.startswith("b ")]
    assert training.endswith("PASS (bitwise identical)")
    assert validation.split()[1:3] == ["2", "0"] and validation.endswith("FAIL")


@pytest.mark.timeout(60)
def test_resume_replaces_rows_and_events_past_the_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    log = _logger(run_dir, tensorboard=True)
    for step in range(1, 5):
        log.record(step, torch.tensor(float(step)), torch.tensor(1.0), 1e-3, 8 * step)
        if step == 2:
            log.record_validation(2, 10.0, math.exp(10.0))
    log.close()
    # Resumed from the step-2 checkpoint: steps 3 and 4 are trained again.
    log = _logger(run_dir, tensorboard=True, start_step=2)
    for step in (3, 4):
        log.record(step, torch.tensor(step + 0.5), torch.tensor(1.0), 1e-3, 8 * step)
    log.close()
    assert [(r["step"], r.get("loss", r.get("val_loss"))) for r in read_metrics(run_dir)] == \
        [(1, 1.0), (2, 2.0), (2, 10.0), (3, 3.5), (4, 4.5)]
    scalars = _scalars(run_dir)
    assert scalars["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.5), (4, 4.5)]
    assert scalars["val/loss"] == [(2, 10.0)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["offline", "online"])
def test_wandb_gets_the_mode_and_the_same_values(tmp_path, monkeypatch, mode):
    # A stand-in for the wandb package: nothing here may reach a network.
    calls = []
    run = types.SimpleNamespace(log=lambda values, step: calls.append((step, values)), finish=lambda: None)
    init = {}
    stub = types.SimpleNamespace(init=lambda **kwargs: init.update(kwargs) or run)
    monkeypatch.setitem(sys.modules, "wandb", stub)
    log = _logger(tmp_path / "run", wandb=True, wandb_project="p", wandb_mode=mode)
    log.record(1, torch.tensor(5.0), torch.tensor(2.0), 1e-3, 8)
    log.record(2, torch.tensor(4.0), torch.tensor(2.0), 1e-3, 16)
    log.record_validation(2, 4.5, math.exp(4.5))
    log.close()
    assert init["mode"] == mode and init["project"] == "p" and init["dir"] == str(tmp_path / "run")
    assert [(step, values["train/loss"]) for step, values in calls[:2]] == [(1, 5.0), (2, 4.0)]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s"} <= set(calls[0][1])
    assert calls[2] == (2, {"val/loss": 4.5, "val/ppl": math.exp(4.5)})


@pytest.mark.timeout(60)
def test_a_bad_wandb_mode_is_one_line_and_exit_2(tmp_path):
    proc = run_cli(["-m", "hetpipe.pretrain", *TINY_RUN, "logging.wandb_mode=cloud",
                    f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == "hetpipe: error: logging.wandb_mode='cloud' must be offline or online\n"


@pytest.mark.timeout(120)
def test_tensorboard_without_the_package_names_the_extra(tmp_path):
    # Hides tensorboard even where it is installed (torch's writer imports it).
    run_dir = tmp_path / "run"
    argv = ["hetpipe.pretrain", *TINY_RUN, "logging.tensorboard=true", f"hydra.run.dir={run_dir}"]
    code = (f"import runpy, sys; sys.modules['tensorboard'] = None; sys.argv = {argv!r}; "
            "runpy.run_module('hetpipe.pretrain', run_name='__main__')")
    proc = run_cli(["-c", code])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == ("hetpipe: error: logging.tensorboard=true needs the tensorboard package: "
                           "pip install 'hetpipe[tensorboard]'\n")
    assert not (run_dir / "metrics.jsonl").exists()


# Two ranks across the emulated vendor line: rank 0's lines reach the console through the launcher.
CONSOLE_RUN = ["-m", "hetpipe.pretrain", *TINY_RUN, "cluster=cpu_mixed", "model.hidden_size=64",
               "model.ffn_hidden_size=160", "train.log_interval=1"]


@pytest.mark.timeout(240)
def test_the_run_directory_keeps_the_console_of_the_launcher_and_its_ranks(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli([*CONSOLE_RUN, f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = (run_dir / "pretrain.log").read_text()
    lines = log.splitlines()
    # Everything the user saw, in the order each stream printed it.
    assert [x for x in lines if x in proc.stdout.splitlines()] == proc.stdout.splitlines()
    assert all(x in lines for x in proc.stderr.splitlines())
    assert any(x.startswith("hetpipe: devices: ") for x in lines)  # printed by rank 0, a rank process
    steps = [x for x in lines if " step      " in x]
    assert len(steps) == 3 and all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d step ", x) for x in steps), steps
    assert all(re.search(r"\| [\d,]+ tok/s \| elapsed \d+:\d\d:\d\d, ETA \d+:\d\d:\d\d$", x) for x in steps), steps
    assert re.fullmatch(rf"hetpipe: done: step 3/3 in \d+:\d\d:\d\d, final loss \d\.\d{{4}}, [\d,]+ tok/s on average, "
                        rf"run dir {re.escape(str(run_dir))}", lines[-1]), lines[-1]


@pytest.mark.timeout(240)
def test_a_rank_s_traceback_is_kept_in_pretrain_log(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli([*CONSOLE_RUN, f"hydra.run.dir={run_dir}"], env={"HETPIPE_FAULT": "raise@step:rank=1:step=2"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback (most recent call last):" in proc.stderr
    log = (run_dir / "pretrain.log").read_text()
    assert "Traceback (most recent call last):" in log
    assert "RuntimeError: injected fault at step of step 2 on rank 1" in log
    errors = [x for x in proc.stderr.splitlines() if x.startswith("hetpipe: error:")]
    assert errors and all(x in log.splitlines() for x in errors), f"stderr:\n{proc.stderr}\npretrain.log:\n{log[-3000:]}"
