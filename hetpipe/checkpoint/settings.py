"""The ``checkpoint`` config group: where checkpoints go, how often, and what
a run starts from.

A plain dataclass, free of hydra, so that ``hetpipe.schema.pretrain_config`` can make it the
``checkpoint`` group's schema; the trainer calls :func:`should_save` and
:func:`resolve_save_dir` instead of re-deriving the rules.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hetpipe.errors import ConfigError

# What a resume does with a changed learning-rate schedule (hetpipe/training/schedule_change.py).
SCHEDULE_SETTINGS = ("check", "config", "checkpoint")


@dataclass
class CheckpointConfig:
    # Directory holding iter_NNNNNNN/ checkpoints and the `latest` pointer.
    # None means <run_dir>/checkpoints; set it explicitly to resume across
    # runs, since hydra gives every run a fresh time-stamped run_dir. It may
    # be on each node's local disk (each node keeps its own ranks' files; see
    # docs/checkpoints.md); "{node}" in it becomes the node's index, e.g.
    # 'checkpoint.save_dir="/ckpt/node{node}"' (quoted for hydra).
    save_dir: Optional[str] = None
    # Save every N optimizer steps and after the last step; 0 saves only after
    # the last step, and only when save_dir is set (as Megatron saves at the end
    # whenever --save is given). A run with neither writes no checkpoint: a
    # multi-GB write should be asked for, not a surprise at the end of a demo.
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
    # Write checkpoints in a background thread: the step waits only for a
    # copy of this rank's state to host memory. Measured on the 2-core CPU
    # machine (scripts/bench_checkpoint.py: 52M parameters, 0.63 GB of
    # weights and AdamW moments per save, docs/benchmarks.md): a synchronous
    # save stalled training 1.21 s, an asynchronous one 0.05 s (0.11 s the
    # first time, which allocates the host buffers), its write taking 1.8 s
    # beside training. false: the step writes and commits the checkpoint
    # before it continues (and needs no host copy of the state).
    async_save: bool = True
    # Take over the lock of the run or save directory that a job on another
    # host left (hetpipe/launch/dir_lock.py): hetpipe cannot tell from here
    # whether that job still runs, so it refuses such a lock unless told to.
    # A live owner on this host is never overridden.
    break_lock: bool = False
    # A resume whose learning-rate schedule (optimizer.lr, min_lr, warmup, decay,
    # train.train_iters where it sets the decay's length, train.global_batch_size)
    # differs from the checkpoint's: check stops in one line naming old and new
    # values (Megatron asserts likewise), config resumes with the new values
    # (Megatron's --override-opt_param-scheduler), checkpoint with the
    # checkpoint's (--use-checkpoint-opt_param-scheduler). hetpipe/training/schedule_change.py.
    schedule: str = "check"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULE_SETTINGS:
            raise ConfigError(f"checkpoint.schedule={self.schedule!r} must be one of {', '.join(SCHEDULE_SETTINGS)}")
        if self.save_interval < 0:
            raise ConfigError(f"checkpoint.save_interval={self.save_interval} must be >= 0 (0 never saves)")
        if self.keep_last < 0:
            raise ConfigError(f"checkpoint.keep_last={self.keep_last} must be >= 0 (0 keeps all)")
        if self.resume is not None and not self.resume.strip():
            raise ConfigError("checkpoint.resume is empty: use 'latest' or a checkpoint path")


NODE_PLACEHOLDER = "{node}"


def node_path(path: str, node: int) -> Path:
    """``path`` with ``{node}`` replaced by this rank's node index."""
    return Path(path.replace(NODE_PLACEHOLDER, str(node)))


def resolve_save_dir(cfg: CheckpointConfig, run_dir: str | Path, node: int = 0) -> Path:
    """``cfg.save_dir`` (``{node}`` replaced), or ``<run_dir>/checkpoints`` when unset."""
    return node_path(cfg.save_dir, node) if cfg.save_dir is not None else Path(run_dir) / "checkpoints"


def should_save(cfg: CheckpointConfig, completed_steps: int, train_iters: int) -> bool:
    """Whether to save after ``completed_steps`` optimizer steps (1-based): at each
    ``save_interval``, and once after the last step when an interval or a
    ``save_dir`` asks for checkpoints (Megatron-LM's pretrain() saves at the end
    whenever --save is set, megatron/training/training.py). The last step is saved
    once, whether or not the interval divides it."""
    if completed_steps == train_iters:
        return cfg.save_interval > 0 or cfg.save_dir is not None
    return cfg.save_interval > 0 and completed_steps % cfg.save_interval == 0
