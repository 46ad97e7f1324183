"""One table for a hydra sweep: ``sweep.md`` and ``sweep.csv`` in the sweep directory.

A sweep of plans (``-m 'partition.layers=[1,3],[3,1]'``) is about which runs
fastest, so each job is a row: its overrides, its plan (split, schedule,
TP x DP, from the ``plan.yaml`` the job wrote), median tokens/s, median
TFLOP/s per GPU (GPU runs only: metrics.py leaves it out on a CPU), peak
memory (the largest ``memory_rank<r>.json`` of a GPU run), final loss and
exit status (hetpipe/cli/sweep_jobs.py). A job that failed is a row with its
status. The plots come from hetpipe/cli/sweep_plot.py.

Written at the end of every ``python -m hetpipe.pretrain -m`` (the hydra
callback :class:`SweepSummaryCallback`, configs/pretrain.yaml) and on demand
by ``python -m hetpipe.compare --sweep DIR``.
"""
from __future__ import annotations

import csv
import io
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from hydra.experimental.callback import Callback

from hetpipe.errors import HetpipeError
from hetpipe.cli.sweep_jobs import SweepJob, override_labels, sweep_jobs

COLUMNS = ("job", "overrides", "split", "schedule", "TP x DP", "tokens/s", "TFLOP/s/GPU",
           "peak memory GiB", "final loss", "exit status")


@dataclass
class SweepRow:
    job: SweepJob
    label: str  # the overrides that set this job apart
    split: Optional[str] = None  # decoder layers per (virtual) stage, "1+3"
    schedule: Optional[str] = None
    tp_dp: Optional[str] = None  # "1x1", or per stage "2x1/1x1" where stages differ
    tokens_per_s: Optional[float] = None
    tflops_per_gpu: Optional[float] = None
    peak_memory_gib: Optional[float] = None
    final_loss: Optional[float] = None
    loss: dict[int, float] = field(default_factory=dict)

    @property
    def plan(self) -> str:
        return "-" if self.split is None else f"{self.split} {self.schedule} {self.tp_dp}"

    @property
    def status(self) -> str:
        return "-" if self.job.exit_status is None else str(self.job.exit_status)

    def cells(self) -> list[str]:
        return [self.job.num, self.label, self.split or "-", self.schedule or "-", self.tp_dp or "-",
                _fmt(self.tokens_per_s, ".4g"), _fmt(self.tflops_per_gpu, ".4g"),
                _fmt(self.peak_memory_gib, ".2f"), _fmt(self.final_loss, ".6f"), self.status]


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def sweep_rows(sweep_dir: Path) -> list[SweepRow]:
    """One row per job of the sweep, in job order."""
    jobs = sweep_jobs(sweep_dir)
    labels = override_labels([job.overrides for job in jobs])
    return [_row(job, label) for job, label in zip(jobs, labels)]


def _row(job: SweepJob, label: str) -> SweepRow:
    row = SweepRow(job, label)
    _add_plan(row, job.path / "plan.yaml")
    rows = _training_rows(job.path / "metrics.jsonl")
    row.loss = {r["step"]: float(r["loss"]) for r in rows}
    row.final_loss = row.loss[max(row.loss)] if row.loss else None
    row.tokens_per_s = _median(rows, "tokens_per_s")
    row.tflops_per_gpu = _median(rows, "tflops_per_device")
    peaks = [json.loads(p.read_text())["peak_allocated_gib"] for p in job.path.glob("memory_rank*.json")]
    row.peak_memory_gib = max(peaks) if peaks else None
    return row


def _add_plan(row: SweepRow, path: Path) -> None:
    """The split, schedule and TP x DP of the plan the job ran (none before it started)."""
    if not path.is_file():
        return
    plan = yaml.safe_load(path.read_text(encoding="utf-8"))
    stages = plan["stages"]
    row.split = "+".join(str(s["layers"]) for s in stages)
    row.schedule = plan.get("schedule", "-")
    degrees = [f"{s.get('tp', 1)}x{s.get('dp', 1)}" for s in stages]
    row.tp_dp = degrees[0] if len(set(degrees)) == 1 else "/".join(degrees)


def _training_rows(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows with a loss; a row cut short by a killed job is left out."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and isinstance(row.get("loss"), (int, float)):
            rows.append(row)
    return rows


def _median(rows: list[dict[str, Any]], key: str) -> Optional[float]:
    # The median: a short run's first steps carry warm-up (as compare's summary).
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def markdown_table(sweep_dir: Path, rows: list[SweepRow]) -> str:
    shared = set.intersection(*(set(r.job.overrides) for r in rows))
    lines = [f"# Sweep {sweep_dir}", "",
             f"Overrides of every job: `{' '.join(o for o in rows[0].job.overrides if o in shared) or '-'}`. "
             "Exit status `-`: the job left no status (killed, or still running).", "",
             "| " + " | ".join(COLUMNS) + " |",
             "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += ["| " + " | ".join(_md(c) for c in row.cells()) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _md(cell: str) -> str:
    return cell.replace("|", "\\|")


def csv_table(rows: list[SweepRow]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    writer.writerows([["" if c == "-" else c for c in row.cells()] for row in rows])
    return out.getvalue()


def write_summary(sweep_dir: Path) -> list[Path]:
    """Write sweep.md, sweep.csv and (with matplotlib) the plots; returns what was written."""
    from hetpipe.cli.sweep_plot import plot_loss, plot_throughput

    rows = sweep_rows(sweep_dir)
    written = [sweep_dir / "sweep.md", sweep_dir / "sweep.csv"]
    written[0].write_text(markdown_table(sweep_dir, rows), encoding="utf-8")
    written[1].write_text(csv_table(rows), encoding="utf-8")
    try:
        written.append(plot_throughput(rows, sweep_dir / "sweep_throughput.png"))
        written.append(plot_loss(rows, sweep_dir / "sweep_loss.png"))
    except ImportError:
        print("hetpipe: the sweep's plots need the matplotlib package: pip install 'hetpipe[plot]'", flush=True)
    return written


def print_summary(sweep_dir: Path) -> None:
    """Write the summary and print its table and the files."""
    written = write_summary(sweep_dir)
    print(written[0].read_text(encoding="utf-8"), end="")
    for path in written:
        print(f"wrote {path}", flush=True)


class SweepSummaryCallback(Callback):
    """Hydra calls this at the end of a multirun (configs/pretrain.yaml's hydra.callbacks)."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        try:
            print_summary(Path(str(config.hydra.sweep.dir)))
        except HetpipeError as exc:  # the jobs' own status stands; the summary says why it is missing
            print(f"hetpipe: no sweep summary: {exc}", flush=True)
