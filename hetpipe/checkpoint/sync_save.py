"""A synchronous save from every rank at once, for scripts and tests (the trainer's
saver, asynchronous or not, is :mod:`hetpipe.checkpoint.saver`).

:func:`save_checkpoint` is the :class:`~hetpipe.checkpoint.saver.CheckpointSaver`
path without a background thread and without the job's store: the ranks
share one directory and pass their parts of the manifest as files between
two barriers (over the world group by default), and rank 0 commits. Tests
pass a no-op barrier and call rank 1 ... then rank 0 to play several ranks in
one process. The trainer uses a ``CheckpointSaver`` instead.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from hetpipe.checkpoint.board import FileBoard, LocalBoard
from hetpipe.checkpoint.saver import CheckpointSaver
from hetpipe.checkpoint.settings import CheckpointConfig
from hetpipe.models import CausalLM, ModelConfig
from hetpipe.partitioner.plan_data import Plan


def _world_barrier() -> None:
    dist.barrier()  # the default group: the world group, gloo on CPU


def save_checkpoint(cfg: CheckpointConfig, run_dir: str | Path, step: int, chunks: Sequence[CausalLM],
                    optimizer: torch.optim.Optimizer, loader_state: Mapping[str, Any], rank: int,
                    world_size: int, model_cfg: ModelConfig, plan: Optional[Plan] = None, *,
                    barrier: Optional[Callable[[], None]] = None,
                    extra_state: Optional[Mapping[str, Any]] = None) -> Path:
    """Save the state after ``step`` optimizer steps; a collective over all ranks. Returns the
    committed checkpoint directory.

    ``loader_state`` is the data loader's ``state_dict()``; ``extra_state`` is
    any further JSON-able trainer state (rank 0's is saved). Each rank writes
    what its chunks hold, tied head copies aside (the embedding owner's
    tensor stands for them).
    """
    if barrier is None:
        barrier = _world_barrier if world_size > 1 else (lambda: None)
    board = FileBoard(rank, world_size, barrier) if world_size > 1 else LocalBoard()
    saver = CheckpointSaver(dataclasses.replace(cfg, async_save=False), run_dir, model_cfg=model_cfg, rank=rank,
                            world_size=world_size, plan=plan, board=board)
    try:
        saver.save(step, chunks, optimizer, loader_state, extra_state)
        path = saver.wait()
    finally:
        saver.close(wait=False)
    assert path is not None
    return path
