"""Per-step training metrics and validation results: JSONL in the run
directory, console, wandb, TensorBoard.

``metrics.jsonl`` is the run's record: ``python -m hetpipe.compare`` and resume
read it, so it is written first and the same rows go everywhere else. A
training row carries ``loss``; a validation row is a row of its own with
``val_loss`` and ``val_ppl`` (no ``loss``), so readers of training curves
can keep selecting rows by ``loss``; an event row (a skipped non-finite
step, a restart, a preemption) has ``event`` and no ``loss``. A training row of
a ``train.deterministic`` run carries ``"deterministic": true``. wandb and TensorBoard are mirrors for
dashboards and get the same values under ``train/<key>`` and ``val/<key>``.

Values stay on the device until a log interval ends, so logging adds one host
synchronisation per interval, not per step (a per-step ``.item()`` would stall
the GPU). Each row describes its own step: ``step_time_s`` is the host's time
from the previous step's values being queued to this step's (see
:meth:`MetricsLogger.record` for what that means on a GPU), and
``tokens_per_s``, ``tflops_per_device`` and ``mfu`` follow from it. The
console line gives the interval's average instead (its wall time, measured
after a synchronisation, divided by its steps, as Megatron reports it),
after its timestamp, and ends with the run's elapsed time and ETA: a log
read off a terminal (Slurm, nohup, the run directory's ``pretrain.log``)
has no progress bar to tell them.
TFLOP/s per device uses Megatron's model-FLOPs formula
(``hetpipe.models.flops``); MFU divides it by the device's dense peak. MFU is
left out where no peak is known (an unlisted GPU), and both are left out on a
CPU (unless ``train.peak_tflops`` gives one): its TFLOP/s measures nothing a
reader compares.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from hetpipe.errors import ConfigError, HetpipeError
from hetpipe.schema.pretrain_config import LoggingConfig
from hetpipe.observe.sample_log import SampleLog
from hetpipe.observe.straggler import StragglerReport, describe


@dataclass
class _Pending:
    step: int
    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    consumed_samples: int
    step_time_s: float  # host time since the previous step's values were queued


@dataclass(frozen=True)
class RunShape:
    """What the console line and the throughput columns are measured against."""
    total_steps: int
    tokens_per_step: int
    flops_per_step: float  # Megatron's model FLOPs of one global batch
    num_devices: int
    peak_tflops: Optional[float]  # a device's dense peak for MFU; None where none is known
    log_interval: int = 10
    # Whether TFLOP/s means something here: false on a CPU without a given peak.
    reports_flops: bool = True
    # train.deterministic: every training row says so (python -m hetpipe.compare
    # then demands bitwise-equal curves of two such runs).
    deterministic: bool = False


@dataclass
class MetricsLogger:
    run_dir: Path
    shape: RunShape
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # First step of this run (> 0 when resuming): earlier rows are kept.
    start_step: int = 0
    wandb_config: dict[str, Any] = field(default_factory=dict)
    # logging.straggler: per-rank busy times, reported at each flush.
    straggler: Optional[StragglerReport] = None
    # logging.sample_log: each step's global batch (the trainer records it; closed here).
    samples: Optional[SampleLog] = None

    def __post_init__(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # The mirrors first: a missing package fails before metrics.jsonl is
        # rewritten or the progress bar takes over the terminal.
        self._wandb = self._start_wandb() if self.logging.wandb else None
        self._tensorboard = self._start_tensorboard() if self.logging.tensorboard else None
        self.path = self.run_dir / "metrics.jsonl"
        # Rows past the step this run starts from belong to a run that went on
        # after its last checkpoint; they are replaced, not duplicated.
        kept = [r for r in read_metrics(self.run_dir) if r["step"] <= self.start_step] \
            if self.start_step and self.path.is_file() else []
        self._file = self.path.open("w", encoding="utf-8")
        self._file.writelines(json.dumps(r) + "\n" for r in kept)
        self._pending: list[_Pending] = []
        self._last_time = time.perf_counter()  # start of the interval (after a synchronisation)
        self._step_end = self._last_time  # when the previous step's values were queued
        self._started = self._last_time  # the console line's elapsed time and ETA count from here
        self._last_row: Optional[dict[str, Any]] = None  # the last console line's row, for the summary
        self.console = Console(highlight=False)
        self._bar = None
        if self.logging.progress and self.console.is_terminal:
            self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[loss]}"), TimeRemainingColumn(),
                                 console=self.console)
            self._task = self._bar.add_task("train", total=self.shape.total_steps, completed=self.start_step, loss="")
            self._bar.start()

    def _start_wandb(self) -> Any:
        try:
            import wandb
        except ImportError:
            raise ConfigError("logging.wandb=true needs the wandb package: pip install 'hetpipe[wandb]'") from None
        return wandb.init(project=self.logging.wandb_project, dir=str(self.run_dir), mode=self.logging.wandb_mode,
                          name=self.run_dir.name, config=self.wandb_config)

    def _start_tensorboard(self) -> Any:
        try:
            # torch's writer imports the tensorboard package, which torch does not depend on.
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("logging.tensorboard=true needs the tensorboard package: "
                              "pip install 'hetpipe[tensorboard]'") from None
        # A resumed run hides the events past its checkpoint, as it replaces
        # those rows of metrics.jsonl: TensorBoard purges steps >= purge_step.
        return SummaryWriter(log_dir=str(self.run_dir / "tensorboard"),
                             purge_step=self.start_step + 1 if self.start_step else None)

    def record(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float,
               consumed_samples: int) -> None:
        """Queue one optimizer step's values; flushes at the end of each interval.

        The step's time is taken here, on the host, without a synchronisation: the
        time since the previous step's values were queued. On a GPU the host runs
        ahead of the device, so this is when the host got through the step, not
        when the device finished it; the step's reads of its grad norm and loss
        (hetpipe.training.nonfinite) already wait for its forwards and backwards, so it is
        the step's wall time except that its optimizer update, queued after those
        reads, overlaps the next step and is counted there. Over an interval the
        steps' times add up to its wall time, less what was still queued at the end.
        """
        now = time.perf_counter()
        self._pending.append(_Pending(step, loss.detach(), grad_norm.detach(), lr, consumed_samples,
                                      now - self._step_end))
        self._step_end = now
        if step % self.shape.log_interval == 0 or step == self.shape.total_steps:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        interval_step_time = (now - self._last_time) / len(self._pending)
        self._last_time = now
        # Non-finite steps never get here: they are skipped (record_event).
        rows = [self._row(p) for p in self._pending]
        self._pending.clear()
        straggler = self.straggler.take() if self.straggler is not None else {}
        rows[-1].update(straggler)
        for row in rows:
            self._write(row, "train")
        self._finish_writes()
        self._log_line(rows[-1], interval_step_time, describe(straggler))

    def _row(self, p: _Pending) -> dict[str, Any]:
        """One step's row of metrics.jsonl, its throughput from its own time."""
        row = {"step": p.step, "loss": p.loss.item(), "lr": p.lr, "grad_norm": p.grad_norm.item(),
               "consumed_samples": p.consumed_samples, "step_time_s": p.step_time_s,
               "tokens_per_s": self.shape.tokens_per_step / p.step_time_s}
        row.update(self._flops_fields(p.step_time_s))
        if self.shape.deterministic:
            row["deterministic"] = True
        return row

    def _flops_fields(self, step_time: float) -> dict[str, float]:
        """``tflops_per_device`` and ``mfu`` for a step of ``step_time`` seconds, each
        only where it means something (see the module's docstring)."""
        if not self.shape.reports_flops:
            return {}
        tflops = self.shape.flops_per_step / step_time / self.shape.num_devices / 1e12
        if not self.shape.peak_tflops:
            return {"tflops_per_device": tflops}
        return {"tflops_per_device": tflops, "mfu": tflops / self.shape.peak_tflops}

    def record_event(self, step: int, event: str, line: Optional[str] = None, **fields: Any) -> None:
        """A row that is not a step's loss: ``skipped`` (a non-finite step),
        ``restart`` (the job restarted and resumed here), ``preempted``.
        Rows queued before it go first, so the file stays in step order;
        ``line`` is printed. The time up to the event stays out of throughput.
        """
        self.flush()
        self._file.write(json.dumps({"step": step, "event": event, **fields}) + "\n")
        self._finish_writes()
        if line:
            self._print(line)
        self._restart_clock()

    def record_validation(self, step: int, val_loss: float, val_ppl: float) -> None:
        """Log one validation result, taken after optimizer step ``step``.
        Validation's time stays out of the next interval's throughput; a
        caller validating mid-interval calls :meth:`flush` before it to keep
        it out of the current one too."""
        # Training rows up to this step go first: metrics.jsonl stays in step
        # order, and wandb drops values logged at a step below one it has seen.
        self.flush()
        self._write({"step": step, "val_loss": float(val_loss), "val_ppl": float(val_ppl)}, "val")
        self._finish_writes()
        self._print(f"validation at step {step}: loss {val_loss:.4f} | ppl {val_ppl:.3f}")
        # The next interval's throughput starts here, without validation's time.
        self._restart_clock()

    def _restart_clock(self) -> None:
        """The next interval and the next step are timed from now."""
        self._last_time = self._step_end = time.perf_counter()

    def _write(self, row: dict[str, Any], section: str) -> None:
        """``row`` into metrics.jsonl as it is, and its numbers into the
        mirrors as ``<section>/<key>`` (``val_loss`` as ``val/loss``)."""
        self._file.write(json.dumps(row) + "\n")
        scalars = {f"{section}/{key.removeprefix(section + '_')}": value for key, value in row.items()
                   if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self._wandb is not None:
            self._wandb.log(scalars, step=row["step"])
        if self._tensorboard is not None:
            for tag, value in scalars.items():
                self._tensorboard.add_scalar(tag, value, global_step=row["step"])

    def _finish_writes(self) -> None:
        # On disk once per log interval, like the JSONL: TensorBoard would
        # otherwise hold events for up to two minutes (its flush_secs).
        self._file.flush()
        if self._tensorboard is not None:
            self._tensorboard.flush()

    def _print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.console.print(line, markup=False)
        else:
            print(line, flush=True)

    def _log_line(self, row: dict[str, Any], step_time: float, suffix: str = "") -> None:
        """The console line of the interval ending at ``row``: its losses are the
        step's, its throughput the interval's average (``step_time`` per step)."""
        flops = self._flops_fields(step_time)
        tflops = f" | {flops['tflops_per_device']:.3f} TFLOP/s/device" if "tflops_per_device" in flops else ""
        mfu = f" | MFU {100 * flops['mfu']:.1f}%" if "mfu" in flops else ""
        line = (f"{_now()} step {row['step']:>6}/{self.shape.total_steps} | loss {row['loss']:.4f} | "
                f"lr {row['lr']:.3e} | grad norm {row['grad_norm']:.3f} | "
                f"{self.shape.tokens_per_step / step_time:,.0f} tok/s{tflops}{mfu} | "
                f"{self._clock(row['step'])}{suffix}")
        if self._bar is not None:
            self._bar.update(self._task, completed=row["step"], loss=f"loss {row['loss']:.4f}")
        self._print(line)
        self._last_row = row

    def summary(self) -> None:
        """The run's last line, once its steps are over: how far, how long, the final loss, the
        average throughput."""
        row = self._last_row
        if row is None:
            return
        elapsed = time.perf_counter() - self._started
        tokens = self.shape.tokens_per_step * (row["step"] - self.start_step)
        self._print(f"hetpipe: done: step {row['step']}/{self.shape.total_steps} in {_duration(elapsed)}, final loss "
                    f"{row['loss']:.4f}, {tokens / max(elapsed, 1e-9):,.0f} tok/s on average, run dir {self.run_dir}")

    def _clock(self, step: int) -> str:
        """``elapsed 0:12:03, ETA 2:10:11``: this run's time so far, and the steps left at its
        average pace (a log read off a terminal - Slurm, nohup, pretrain.log - has no bar to tell)."""
        elapsed = time.perf_counter() - self._started
        done = max(step - self.start_step, 1)
        left = elapsed / done * (self.shape.total_steps - step)
        return f"elapsed {_duration(elapsed)}, ETA {_duration(left)}"

    def close(self) -> None:
        self._pending.clear()
        if self.samples is not None:
            self.samples.close()
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if not self._file.closed:
            self._file.close()


def _now() -> str:
    """The console line's timestamp: ``2026-11-28 15:48:49``, local time."""
    return datetime.now().strftime("%Y-%m-%d %H:%M:%S")


def _duration(seconds: float) -> str:
    """``2:10:11``; ``1 day, 2:10:11`` past a day."""
    return str(timedelta(seconds=round(seconds)))


def read_metrics(run_dir: Path | str) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl, in step order: training rows
    (with ``loss``) and validation rows (with ``val_loss``)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise HetpipeError(f"{path}: no metrics file (is {run_dir} a hetpipe run directory?)")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
