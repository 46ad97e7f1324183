"""What a run starts from: a checkpoint, Hugging Face weights, or its fresh init.

With ``checkpoint.resume=latest`` each rank looks in its own ``save_dir``;
with node-local directories the nodes commit one after another, so a crash
between two commits leaves their newest checkpoints at different steps, and
the ranks agree on the newest step every directory holds (one all-reduce
over the world group, before the step loop).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from hetpipe.checkpoint.errors import CheckpointError
from hetpipe.checkpoint.hf_import import load_hf_weights
from hetpipe.checkpoint.layout import (complete_checkpoints, incomplete_checkpoints, iter_dir_name,
                                       latest_checkpoint, resolve_checkpoint)
from hetpipe.checkpoint.load import Shard, load_checkpoint
from hetpipe.checkpoint.settings import CheckpointConfig, node_path, resolve_save_dir
from hetpipe.models import CausalLM, ModelConfig

if TYPE_CHECKING:
    from hetpipe.data import MicrobatchLoader


def _agree(path: Optional[Path], save_dir: Path, rank: int, world_size: int) -> Optional[Path]:
    """The checkpoint every rank resumes from, when each found its own latest (node-local
    directories commit one after another, so a crash between two leaves them at different steps)."""
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return path
    mine = -1 if path is None else int(path.name.removeprefix("iter_"))
    bounds = torch.tensor([mine, -mine], dtype=torch.int64)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    newest, oldest = int(bounds[0]), -int(bounds[1])
    if newest == oldest:
        return path
    if oldest < 0:
        if mine < 0:
            raise CheckpointError(f"{save_dir} holds no complete checkpoint, but another rank's directory holds "
                                  f"step {newest}: copy that node's {iter_dir_name(newest)} here "
                                  "(docs/checkpoints.md)")
        raise CheckpointError(f"another rank's checkpoint directory holds no complete checkpoint while {save_dir} "
                              f"holds step {mine}: copy this node's {iter_dir_name(mine)} there "
                              "(docs/checkpoints.md)")
    found = dict(complete_checkpoints(save_dir))
    if oldest not in found:
        raise CheckpointError(f"the ranks' latest checkpoints differ (steps {oldest} to {newest}) and {save_dir} "
                              f"has no complete {iter_dir_name(oldest)}, the newest that every directory holds")
    if rank == 0:
        print(f"hetpipe: the nodes' latest checkpoints differ (steps {oldest} to {newest}: a save was cut off "
              f"between their commits); resuming from step {oldest}, which every node holds", flush=True)
    return found[oldest]


def restore(cfg: CheckpointConfig, run_dir: str | Path, chunks: Sequence[CausalLM],
            optimizer: torch.optim.Optimizer, loader: Optional[MicrobatchLoader], rank: int, world_size: int,
            model_cfg: ModelConfig, shard: Optional[Shard] = None, node: int = 0,
            on_resume: Optional[Callable[[Mapping[str, Any]], None]] = None) -> int:
    """What a run starts from: a checkpoint (``cfg.resume``), else HF weights
    (``cfg.load_hf``), else its fresh init. Returns the optimizer steps already done.

    Call after the model, optimizer and loader are built and the RNGs seeded,
    right before the step loop, so restored RNG states are the last word.
    ``node`` is this rank's node index (for ``{node}`` in the paths). With
    several ranks and ``resume=latest``, the ranks agree on one step (a
    collective over the world group). ``on_resume`` gets the trainer's own state from
    the checkpoint (``extra_state`` of the save; empty for a checkpoint written before
    the trainer kept any), after the resume line.
    """
    path = None
    if cfg.resume == "latest":
        save_dir = resolve_save_dir(cfg, run_dir, node)
        path = _agree(latest_checkpoint(save_dir), save_dir, rank, world_size)
        if path is None and rank == 0:
            skipped = incomplete_checkpoints(save_dir)
            note = f" (ignored incomplete: {', '.join(p.name for p in skipped)})" if skipped else ""
            print(f"hetpipe: no complete checkpoint in {save_dir}{note}; starting from scratch", flush=True)
    elif cfg.resume is not None:
        path = resolve_checkpoint(node_path(cfg.resume, node))
    if path is not None:
        loaded = load_checkpoint(path, chunks, optimizer, loader=loader, rank=rank, world_size=world_size,
                                 shard=shard)
        if world_size > 1 and dist.is_available() and dist.is_initialized():
            # "resumed" only once every rank has loaded its part: rank 0 said it
            # before rank 1 refused its corrupted shard. A rank that refuses ends
            # the job (job_watch), and this barrier with it.
            dist.barrier()
        if rank == 0:
            rng = "RNG states restored" if loaded.rng_restored else "RNG states not restored: the plan differs"
            print(f"hetpipe: resumed from {loaded.path} after step {loaded.step}; {rng}", flush=True)
        if on_resume is not None:
            on_resume(loaded.trainer_state.get("extra") or {})
        return loaded.step
    if cfg.load_hf is not None:
        load_hf_weights(cfg.load_hf, chunks, model_cfg, shard=shard)
        if rank == 0:
            print(f"hetpipe: initialised weights from Hugging Face model {cfg.load_hf}", flush=True)
    return 0
