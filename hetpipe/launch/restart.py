"""What a restarted job resumes from.

With ``train.max_restarts`` > 0 the elastic agent (torchrun's, or the local
launcher's) starts every rank again after one dies; :func:`restart_attempt`
says which attempt this is, the same on every node. A restarted rank must not
repeat the run from its configured start: it resumes from the newest complete
checkpoint of the run's save directory, whatever ``checkpoint.resume`` said
(that setting named the run's *first* start), and starts from it as
configured only when no checkpoint was committed before the failure.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from hetpipe.checkpoint import CheckpointConfig, latest_checkpoint, resolve_save_dir
from hetpipe.process.rank_env import restart_attempt


def resume_setting(cfg: CheckpointConfig, run_dir: str | Path, node: int = 0) -> CheckpointConfig:
    """``cfg``, or on a restart ``cfg`` with ``resume=latest``: always when the
    run had no ``resume`` of its own (every node then takes the same path, and
    the load agrees on the newest step every node's directory holds, or starts
    afresh when none has one); else only once a checkpoint of this run is in
    node ``node``'s save directory, so a run that died before its first save
    restarts from the checkpoint it was started from."""
    if restart_attempt() == 0:
        return cfg
    if cfg.resume is not None and latest_checkpoint(resolve_save_dir(cfg, run_dir, node)) is None:
        return cfg
    return dataclasses.replace(cfg, resume="latest")
