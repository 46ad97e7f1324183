"""What a restarted job resumes from.

With ``train.max_restarts`` > 0 the elastic agent (torchrun's, or the local
launcher's) starts every rank again after one dies, and tells them which
attempt this is in ``TORCHELASTIC_RESTART_COUNT``. A restarted rank must not
repeat the run from its configured start: it resumes from the newest complete
checkpoint of the run's save directory, whatever ``checkpoint.resume`` said
(that setting named the run's *first* start), and starts from it as
configured only when no checkpoint was committed before the failure.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from hetpipe.checkpoint import CheckpointConfig, latest_checkpoint, resolve_save_dir


def restart_attempt() -> int:
    """Which restart of the job this process belongs to (0: the first run)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def resume_setting(cfg: CheckpointConfig, run_dir: str | Path) -> CheckpointConfig:
    """``cfg``, or on a restart with a committed checkpoint, ``cfg`` with ``resume=latest``."""
    if restart_attempt() == 0 or latest_checkpoint(resolve_save_dir(cfg, run_dir)) is None:
        return cfg
    return dataclasses.replace(cfg, resume="latest")
