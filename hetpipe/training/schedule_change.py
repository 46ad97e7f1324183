"""A resumed run's learning-rate schedule against the one its checkpoint followed.

Every checkpoint records the settings that shape the schedule (peak and floor,
warmup, decay, the global batch). A resume whose command line changes one of
them would otherwise go on along another curve without a word: a longer
``train.train_iters`` moves the cosine's end, so the learning rate jumps at
the first resumed step. As Megatron-LM's scheduler checks do, the change is
named, old and new values, and ``checkpoint.schedule`` says what to do:
``check`` (the default) stops the run in that line, as Megatron asserts unless
told which to use; ``config`` goes on with the new values (Megatron's
``--override-opt_param-scheduler``); ``checkpoint`` takes the checkpoint's
(``--use-checkpoint-opt_param-scheduler``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from hetpipe.errors import ConfigError

# The recorded settings, as the command line names them (group, field).
FIELDS = (("optimizer", "lr"), ("optimizer", "min_lr"), ("optimizer", "lr_warmup_iters"),
          ("optimizer", "lr_warmup_init"), ("optimizer", "lr_decay_style"), ("optimizer", "lr_decay_iters"),
          ("train", "train_iters"), ("train", "global_batch_size"))
DECAY_LENGTH = ("optimizer.lr_decay_iters", "train.train_iters")
# The learning rate of a step: (steps taken, OptimizerConfig, train_iters) -> lr.
LrAt = Callable[[int, Any, int], float]


def schedule_record(cfg: Any) -> dict[str, Any]:
    """What a checkpoint keeps of ``cfg``'s schedule (a PretrainConfig)."""
    return {f"{group}.{name}": getattr(getattr(cfg, group), name) for group, name in FIELDS}


def _decay_length(schedule: Mapping[str, Any]) -> Any:
    """The steps the decay lasts: lr_decay_iters, else train_iters (as the trainer's lr_at reads them)."""
    return schedule["optimizer.lr_decay_iters"] or schedule["train.train_iters"]


def _matters(key: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether ``key`` shapes the schedule: train_iters and lr_decay_iters only through
    the decay's length, and neither they nor min_lr under a constant learning rate."""
    constant = old["optimizer.lr_decay_style"] == new["optimizer.lr_decay_style"] == "constant"
    if key in DECAY_LENGTH:
        return not constant and _decay_length(old) != _decay_length(new)
    return not (constant and key == "optimizer.min_lr")


def schedule_changes(saved: Mapping[str, Any], cfg: Any, lr_at: LrAt) -> list[tuple[str, Any, Any]]:
    """(setting, checkpoint's value, this run's) for each change that moves the schedule:
    none where the learning rate of every step up to train.train_iters and the global
    batch stay what they were (a longer run that never leaves its warmup), or for a
    checkpoint that recorded no schedule (written before the record)."""
    if not isinstance(saved, Mapping) or set(saved) != {f"{g}.{n}" for g, n in FIELDS}:
        return []
    now = schedule_record(cfg)
    if saved["train.global_batch_size"] == now["train.global_batch_size"] and _same_curve(saved, cfg, lr_at):
        return []
    changed = [(key, saved[key], now[key]) for key in now if saved[key] != now[key]]
    return [c for c in changed if _matters(c[0], saved, now)] or changed


def _same_curve(saved: Mapping[str, Any], cfg: Any, lr_at: LrAt) -> bool:
    """Whether the checkpoint's schedule gives every step of this run the learning rate this run's does."""
    old = dataclasses.replace(cfg.optimizer, **{k.split(".")[1]: v for k, v in saved.items()
                                                if k.startswith("optimizer.")})
    old_iters, iters = saved["train.train_iters"], cfg.train.train_iters
    return all(lr_at(s, old, old_iters) == lr_at(s, cfg.optimizer, iters) for s in range(iters))


def _described(changes: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{key} {old} -> {new}" for key, old, new in changes)


def reconcile_schedule(saved: Mapping[str, Any], cfg: Any, rank: int, lr_at: LrAt) -> None:
    """Stop, note or undo a change of schedule against the checkpoint's (``saved``),
    as ``cfg.checkpoint.schedule`` says; ``cfg`` is changed in place for ``checkpoint``.
    ``lr_at`` is the trainer's learning rate of a step (hetpipe.training.trainer.lr_at)."""
    changes = schedule_changes(saved, cfg, lr_at)
    setting = cfg.checkpoint.schedule
    if not changes:
        return
    if setting == "check":
        raise ConfigError(f"the learning-rate schedule differs from the checkpoint's: {_described(changes)}; "
                          "checkpoint.schedule=config resumes with the new values, "
                          "checkpoint.schedule=checkpoint with the checkpoint's")
    if setting == "checkpoint":
        _take_checkpoint_schedule(changes, saved, cfg)
    if rank == 0:
        which = "this run's new values" if setting == "config" else \
            f"the checkpoint's schedule (train.train_iters stays {cfg.train.train_iters})"
        print(f"hetpipe: note: the learning-rate schedule differs from the checkpoint's: {_described(changes)}; "
              f"resuming with {which} (checkpoint.schedule={setting})", flush=True)


def _take_checkpoint_schedule(changes: list[tuple[str, Any, Any]], saved: Mapping[str, Any], cfg: Any) -> None:
    """Set the checkpoint's values into ``cfg``. A changed decay length becomes the
    checkpoint's as optimizer.lr_decay_iters, so a longer train.train_iters still runs
    its steps (past the decay, at min_lr). A global batch is refused: the data loader
    and the plan were built for this run's before the checkpoint was read."""
    for key, old, new in changes:
        if key == "train.global_batch_size":
            raise ConfigError(f"checkpoint.schedule=checkpoint cannot take the checkpoint's global batch "
                              f"({old}, this run {new}): set train.global_batch_size={old}")
    for key, old, _ in changes:
        if key in DECAY_LENGTH:
            cfg.optimizer.lr_decay_iters = _decay_length(saved)
        else:
            group, name = key.split(".")
            setattr(getattr(cfg, group), name, old)
