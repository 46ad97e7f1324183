"""Loading a checkpoint into whatever this rank holds now, under any plan.

Because tensors are keyed by model unit, resharding is just reading different
names: a rank asks the manifest for the tensors its chunks hold and reads
them from whichever shard files have them. Optimizer state follows its
parameter by name. Everything is checked before the first tensor is copied
(manifest, file checksums, model shape), so a bad checkpoint fails with one
sentence naming the file and never leaves a half-loaded model behind.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from hetpipe.checkpoint.compat import check_model_fits
from hetpipe.checkpoint.settings import CheckpointConfig, resolve_save_dir
from hetpipe.checkpoint.hf_import import load_hf_weights
from hetpipe.checkpoint.layout import (TRAINER_STATE, incomplete_checkpoints, latest_checkpoint,
                                       resolve_checkpoint, rng_file)
from hetpipe.checkpoint.manifest import Checkpoint, CheckpointError
from hetpipe.checkpoint.names import (canonical_name, chunk_units, load_targets, parameter_names,
                                     whole_model_shapes)
from hetpipe.checkpoint.rng import restore_rng
from hetpipe.models import CausalLM, ModelConfig

if TYPE_CHECKING:
    from hetpipe.data import MicrobatchLoader


@dataclass
class LoadedCheckpoint:
    path: Path
    # Optimizer steps completed when it was saved: the next step to run.
    step: int
    trainer_state: dict[str, Any]
    # RNG states are per rank and only meaningful for the same work: they are
    # restored when this rank holds exactly the units it held when saving.
    rng_restored: bool


def _optimizer_keys(ckpt: Checkpoint, names: Sequence[str]) -> dict[str, list[str]]:
    """Canonical name -> the optimizer state keys saved for it (exp_avg, ...)."""
    keys: dict[str, list[str]] = {name: [] for name in names}
    for tensor_name in ckpt.tensors:
        key, sep, name = tensor_name.partition("/")
        if sep and name in keys:
            keys[name].append(key)
    # A checkpoint saved before the first step has no state at all; anything
    # between "all" and "none" means state was lost, and is refused.
    kinds = {tuple(sorted(v)) for v in keys.values()}
    if len(kinds) > 1:
        full = max(kinds, key=len)
        lacking = next(name for name, v in keys.items() if tuple(sorted(v)) != full)
        raise CheckpointError(f"checkpoint {ckpt.path} has optimizer state {', '.join(full)} for some "
                              f"parameters but not for {lacking}")
    return keys


Shard = Callable[[str, torch.Tensor], torch.Tensor]


def _identity(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def read_optimizer_tensors(ckpt: Checkpoint, names: Sequence[str], shard: Optional[Shard] = None
                           ) -> dict[str, dict[str, torch.Tensor]]:
    """{canonical name: {state key: tensor}} for ``names``, each tensor passed
    through ``shard`` (this rank's tensor-parallel slice; ``step`` is left alone)."""
    shard = shard or _identity
    keys = _optimizer_keys(ckpt, list(names))
    wanted = [f"{key}/{name}" for name, ks in keys.items() for key in ks]
    out: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in ckpt.iter_tensors(wanted):
        key, _, name = tensor_name.partition("/")
        out.setdefault(name, {})[key] = tensor if key == "step" else shard(name, tensor)
    return out


def _optimizer_state_dict(ckpt: Checkpoint, chunks: Sequence[CausalLM],
                          optimizer: torch.optim.Optimizer, shard: Optional[Shard] = None) -> dict[str, Any]:
    """The optimizer's own state_dict, with state read from the checkpoint by name."""
    names = parameter_names(chunks)
    current = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(id(p) not in names for p in params):
        raise ValueError("the optimizer holds a parameter that is not in the chunks being loaded")
    # state_dict() numbers parameters in param_groups order; so does this.
    index_of = {names[id(p)][0]: [] for p in params}
    for i, p in enumerate(params):
        index_of[names[id(p)][0]].append(i)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensors in read_optimizer_tensors(ckpt, list(index_of), shard).items():
        for key, tensor in tensors.items():
            for i in index_of[name]:  # a tied head copy shares the embedding's state
                state.setdefault(i, {})[key] = tensor if len(index_of[name]) == 1 else tensor.clone()
    for i, p in enumerate(params):
        for key, value in state.get(i, {}).items():
            if key != "step" and value.shape != p.shape:
                raise CheckpointError(f"checkpoint {ckpt.path}: optimizer state {key}/{names[id(p)][0]} has "
                                      f"shape {list(value.shape)} but the parameter has {list(p.shape)}")
    return {"state": state, "param_groups": current["param_groups"]}


def load_checkpoint(path: str | Path, chunks: Sequence[CausalLM], optimizer: Optional[torch.optim.Optimizer] = None,
                    *, loader: Optional[MicrobatchLoader] = None, rank: int = 0,
                    world_size: int = 1, shard: Optional[Shard] = None) -> LoadedCheckpoint:
    """Load weights (and optimizer, sampler and RNG state when given) into this rank's chunks.

    ``path`` is a checkpoint directory or a save directory (its latest one).
    Checkpoints hold whole tensors; ``shard(name, tensor)`` cuts out the part
    this rank holds under tensor parallelism. An optimizer with its own
    sharded state (ZeRO-1) takes its state through ``load_full_state_dict``
    with the tensors :func:`read_optimizer_tensors` returns.
    """
    shard = shard or _identity
    ckpt = Checkpoint(resolve_checkpoint(path))
    cfg = chunks[0].cfg
    saved_shapes = {name: tuple(e["shape"]) for name, e in ckpt.tensors.items() if "/" not in name}
    check_model_fits(f"checkpoint {ckpt.path}", ckpt.model, saved_shapes, whole_model_shapes(cfg), cfg)

    targets = load_targets(chunks)
    names = sorted({name for name, _ in targets})
    files = {ckpt.tensors[name]["file"] for name in names} | {TRAINER_STATE}
    same_work = ckpt.world_size == world_size and ckpt.units_of(rank) == chunk_units(chunks)
    restore_rng_state = same_work and ckpt.has_file(rng_file(rank))
    if restore_rng_state:
        files.add(rng_file(rank))
    # Every checksum before any copy: these files, then the optimizer's
    # (read into memory whole, as it becomes the optimizer state anyway).
    ckpt.verify(sorted(files))
    trainer_state = ckpt.read_json(TRAINER_STATE)
    optim_state = None
    if optimizer is not None and hasattr(optimizer, "load_full_state_dict"):
        # Names the optimizer knows its parameters by are the chunks' own;
        # tied head copies read the embedding's state.
        own = {name: canonical for chunk in chunks
               for name, canonical in ((n, canonical_name(chunk.cfg, n)) for n, _ in chunk.named_parameters())}
        saved = read_optimizer_tensors(ckpt, sorted(set(own.values())), shard)
        full = {name: saved[canonical] for name, canonical in own.items() if canonical in saved}
    elif optimizer is not None:
        optim_state = _optimizer_state_dict(ckpt, chunks, optimizer, shard)
    if loader is not None:  # refuses a different data order before anything else changes
        loader.load_state_dict(trainer_state["sampler"])

    by_name: dict[str, list[torch.Tensor]] = {}
    for name, target in targets:
        by_name.setdefault(name, []).append(target)
    with torch.no_grad():
        for name, tensor in ckpt.iter_tensors(names):
            for target in by_name[name]:
                target.copy_(shard(name, tensor))
    if optim_state is not None:
        optimizer.load_state_dict(optim_state)
    elif optimizer is not None and full:
        optimizer.load_full_state_dict(full)
    if restore_rng_state:
        restore_rng(*ckpt.read_file(rng_file(rank)), next(chunks[0].parameters()).device)
    return LoadedCheckpoint(ckpt.path, ckpt.step, trainer_state, restore_rng_state)


def restore(cfg: CheckpointConfig, run_dir: str | Path, chunks: Sequence[CausalLM],
            optimizer: torch.optim.Optimizer, loader: Optional[MicrobatchLoader], rank: int, world_size: int,
            model_cfg: ModelConfig, shard: Optional[Shard] = None) -> int:
    """What a run starts from: a checkpoint (``cfg.resume``), else HF weights
    (``cfg.load_hf``), else its fresh init. Returns the optimizer steps already done.

    Call after the model, optimizer and loader are built and the RNGs seeded,
    right before the step loop, so restored RNG states are the last word.
    """
    path = None
    if cfg.resume == "latest":
        save_dir = resolve_save_dir(cfg, run_dir)
        path = latest_checkpoint(save_dir)
        if path is None and rank == 0:
            skipped = incomplete_checkpoints(save_dir)
            note = f" (ignored incomplete: {', '.join(p.name for p in skipped)})" if skipped else ""
            print(f"hetpipe: no complete checkpoint in {save_dir}{note}; starting from scratch", flush=True)
    elif cfg.resume is not None:
        path = resolve_checkpoint(cfg.resume)
    if path is not None:
        loaded = load_checkpoint(path, chunks, optimizer, loader=loader, rank=rank, world_size=world_size,
                                 shard=shard)
        if rank == 0:
            rng = "RNG states restored" if loaded.rng_restored else "RNG states not restored: the plan differs"
            print(f"hetpipe: resumed from {loaded.path} after step {loaded.step}; {rng}", flush=True)
        return loaded.step
    if cfg.load_hf is not None:
        load_hf_weights(cfg.load_hf, chunks, model_cfg, shard=shard)
        if rank == 0:
            print(f"hetpipe: initialised weights from Hugging Face model {cfg.load_hf}", flush=True)
    return 0
