"""The jobs of a hydra sweep (``-m``): where they are, what each overrode, how each ended.

Hydra lays a multirun out as ``<sweep dir>/<job num>/`` with the job's
overrides in ``<job num>/.hydra/overrides.yaml`` (configs/pretrain.yaml's
``hydra.sweep``). hetpipe adds ``job_status.json`` to each job directory as
the job ends: its exit status, the one a single run of it would have ended
with. A job that fails does not end the sweep: the next job runs, the
summary (hetpipe/cli/sweep_summary.py) lists the failed one with its status,
and the sweep's process ends with the first failed job's status. A job with
no record was killed, or is still running.
"""
from __future__ import annotations

import json
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import yaml

from hetpipe.errors import EXIT_CRASH, HetpipeError

STATUS_FILE = "job_status.json"
# Exit statuses of this process's failed sweep jobs, in job order.
_FAILED: list[int] = []


@dataclass
class SweepJob:
    num: str
    path: Path
    overrides: list[str]
    exit_status: Optional[int]  # None: no record (killed, or still running)


def sweep_jobs(sweep_dir: Path) -> list[SweepJob]:
    """The sweep's job directories in job order, or one line naming what is not a sweep."""
    if not sweep_dir.is_dir():
        raise HetpipeError(f"{sweep_dir}: no such sweep directory")
    dirs = [d for d in sweep_dir.iterdir() if (d / ".hydra" / "overrides.yaml").is_file()]
    if not dirs:
        raise HetpipeError(f"{sweep_dir}: no job directories with .hydra/overrides.yaml "
                           "(is it the directory of a `-m` sweep?)")
    dirs.sort(key=lambda d: (not d.name.isdigit(), int(d.name) if d.name.isdigit() else 0, d.name))
    return [SweepJob(d.name, d, job_overrides(d) or [], read_status(d)) for d in dirs]


def job_overrides(job_dir: Path) -> Optional[list[str]]:
    """A hydra job directory's command-line overrides, or None where it has none recorded."""
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    return [str(o) for o in yaml.safe_load(path.read_text(encoding="utf-8")) or []]


def override_labels(overrides: list[list[str]]) -> list[str]:
    """Each job's name: its overrides that not every job shares (all of them where none differ)."""
    shared = set.intersection(*map(set, overrides)) if overrides else set()
    return [" ".join(o for o in job if o not in shared) or " ".join(job) for job in overrides]


def read_status(job_dir: Path) -> Optional[int]:
    path = job_dir / STATUS_FILE
    if not path.is_file():
        return None
    return int(json.loads(path.read_text(encoding="utf-8"))["exit_status"])


def record_status(job_dir: Path, status: int) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / STATUS_FILE).write_text(json.dumps({"exit_status": status}) + "\n", encoding="utf-8")


def run_sweep_job(job: Callable[[], object], job_dir: Path) -> None:
    """Run one job of a sweep and record how it ended; a failure (its one line, or a
    traceback, already printed) lets the next job run. A stop by a signal (status
    128 + N: the user's Ctrl-C, a scheduler's kill) ends the sweep too."""
    try:
        job()
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else EXIT_CRASH
        if status >= 128:
            record_status(job_dir, status)
            raise
    except Exception:  # noqa: BLE001 - a bug: its traceback, as a single run prints it
        traceback.print_exc()
        status = EXIT_CRASH
    record_status(job_dir, status)
    if status:
        _FAILED.append(status)


def sweep_exit_status() -> int:
    """The status this process ends with: its first failed sweep job's, else 0."""
    return _FAILED[0] if _FAILED else 0
