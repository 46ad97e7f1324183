"""The ``checkpoint`` config group: where checkpoints go, how often, and what
a run starts from.

A plain dataclass, free of hydra, so that ``hetpipe.pretrain_config`` can make it the
``checkpoint`` group's schema; the trainer calls :func:`should_save` and
:func:`resolve_save_dir` instead of re-deriving the rules.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hetpipe.errors import ConfigError


@dataclass
class CheckpointConfig:
    # Directory holding iter_NNNNNNN/ checkpoints and the `latest` pointer.
    # None means <run_dir>/checkpoints; set it explicitly to resume across
    # runs, since hydra gives every run a fresh time-stamped run_dir.
    save_dir: Optional[str] = None
    # Save every N optimizer steps and after the last step; 0 never saves
    # (a multi-GB write should be asked for, not a surprise at the end of a demo).
    save_interval: int = 0
    # Complete checkpoints to keep in save_dir; older ones are deleted only
    # after a newer one is complete. 0 keeps all.
    keep_last: int = 2
    # "latest" (the newest complete checkpoint in save_dir, or a fresh start
    # when there is none, so one command line survives preemption), or the
    # path of an iter_NNNNNNN/ directory or of a save_dir.
    resume: Optional[str] = None
    # A Hugging Face model directory (config.json + *.safetensors) whose
    # weights seed a fresh run (continued pretraining); a checkpoint found
    # through `resume` takes precedence.
    load_hf: Optional[str] = None

    def __post_init__(self) -> None:
        if self.save_interval < 0:
            raise ConfigError(f"checkpoint.save_interval={self.save_interval} must be >= 0 (0 never saves)")
        if self.keep_last < 0:
            raise ConfigError(f"checkpoint.keep_last={self.keep_last} must be >= 0 (0 keeps all)")
        if self.resume is not None and not self.resume.strip():
            raise ConfigError("checkpoint.resume is empty: use 'latest' or a checkpoint path")


def resolve_save_dir(cfg: CheckpointConfig, run_dir: str | Path) -> Path:
    """``cfg.save_dir``, or ``<run_dir>/checkpoints`` when unset."""
    return Path(cfg.save_dir) if cfg.save_dir is not None else Path(run_dir) / "checkpoints"


def should_save(cfg: CheckpointConfig, completed_steps: int, train_iters: int) -> bool:
    """Whether to save after ``completed_steps`` optimizer steps (1-based)."""
    if cfg.save_interval == 0:
        return False
    return completed_steps % cfg.save_interval == 0 or completed_steps == train_iters
