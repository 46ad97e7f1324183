"""Loading a checkpoint into whatever this rank holds now, under any plan.

Tensors are keyed by model unit and saved as pieces of the whole tensor, so
resharding is reading different regions: a rank asks for the region each of
its tensors is now - the whole tensor, its TP slice (``shard.region``), a
ZeRO-1 range of that slice - and the manifest says which pieces, in which
files, cover it. Optimizer state follows its parameter by name. Everything
is checked before the first tensor is copied (manifest, file checksums,
model shape), so a bad checkpoint fails with one sentence naming the file
and never leaves a half-loaded model behind.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from hetpipe.checkpoint.compat import check_model_fits
from hetpipe.checkpoint.layout import TRAINER_STATE, resolve_checkpoint, rng_file
from hetpipe.checkpoint.manifest import WHOLE, Checkpoint, CheckpointError
from hetpipe.checkpoint.names import canonical_name, chunk_units, load_targets, parameter_names, whole_model_shapes
from hetpipe.checkpoint.regions import Region
from hetpipe.checkpoint.rng import restore_rng
from hetpipe.models import CausalLM

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


Shard = Callable[[str, torch.Tensor], torch.Tensor]


class _Cut:
    """This rank's part of a named tensor: read as its region (``shard.region``), or whole and cut by ``shard``."""

    def __init__(self, shard: Optional[Shard]) -> None:
        self.shard = shard
        self.region_of: Optional[Callable[[str], Region]] = getattr(shard, "region", None)

    def region(self, name: str, flat: Optional[tuple[int, int]] = None) -> Region:
        r = self.region_of(name) if self.region_of is not None else WHOLE
        return Region(r.dim, r.runs, flat) if flat is not None else r

    def finish(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.region_of is not None or self.shard is None else self.shard(name, tensor)


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


def _optimizer_requests(ckpt: Checkpoint, optimizer: torch.optim.Optimizer, chunks: Sequence[CausalLM],
                        cut: _Cut) -> list[tuple[str, str, Region]]:
    """(the optimizer's own parameter name, state key, region) of each tensor it needs."""
    cfg = chunks[0].cfg
    if hasattr(optimizer, "owned_ranges"):  # ZeRO-1: only the flat ranges this rank keeps
        owned = optimizer.owned_ranges()
        keys = _optimizer_keys(ckpt, sorted({canonical_name(cfg, n) for n in owned}))
        return [(own, key, WHOLE if key == "step" else cut.region(canonical_name(cfg, own), flat))
                for own, flat in owned.items() for key in keys[canonical_name(cfg, own)]]
    names = sorted({name for name, _ in parameter_names(chunks).values()})
    keys = _optimizer_keys(ckpt, names)
    return [(name, key, WHOLE if ckpt.entries[f"{key}/{name}"].shape == () else cut.region(name))
            for name in names for key in keys[name]]


def _optimizer_state(ckpt: Checkpoint, optimizer: torch.optim.Optimizer, chunks: Sequence[CausalLM],
                     saved: dict[str, dict[str, torch.Tensor]]) -> Any:
    """What to hand the optimizer: ``load_sharded_state_dict``'s entries, or a ``state_dict``.
    ``saved`` is {name: {key: tensor}} by the names of :func:`_optimizer_requests`."""
    if hasattr(optimizer, "owned_ranges"):
        return {own: {**saved[own], "range": flat} for own, flat in optimizer.owned_ranges().items() if own in saved}
    names = parameter_names(chunks)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(id(p) not in names for p in params):
        raise ValueError("the optimizer holds a parameter that is not in the chunks being loaded")
    sharing = {}
    for p in params:
        sharing[names[id(p)][0]] = sharing.get(names[id(p)][0], 0) + 1
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, p in enumerate(params):  # state_dict() numbers parameters in param_groups order
        name = names[id(p)][0]
        for key, tensor in saved.get(name, {}).items():
            if key != "step" and tensor.shape != p.shape:
                raise CheckpointError(f"checkpoint {ckpt.path}: optimizer state {key}/{name} has "
                                      f"shape {list(tensor.shape)} but the parameter has {list(p.shape)}")
            # A tied head copy shares the embedding's state.
            state.setdefault(i, {})[key] = tensor.clone() if sharing[name] > 1 else tensor
    return {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}


def load_checkpoint(path: str | Path, chunks: Sequence[CausalLM], optimizer: Optional[torch.optim.Optimizer] = None,
                    *, loader: Optional[MicrobatchLoader] = None, rank: int = 0,
                    world_size: int = 1, shard: Optional[Shard] = None) -> LoadedCheckpoint:
    """Load weights (and optimizer, sampler and RNG state when given) into this rank's chunks.

    ``path`` is a checkpoint directory or a save directory (its latest one).
    ``shard`` is this rank's tensor-parallel cut (:func:`hetpipe.checkpoint.tp_slices.shard_fn`):
    with a ``region(name)`` it reads just that slice, otherwise it cuts whole tensors.
    An optimizer with its own sharded state (ZeRO-1) reads only the ranges it owns.
    """
    cut = _Cut(shard)
    ckpt = Checkpoint(resolve_checkpoint(path))
    cfg = chunks[0].cfg
    saved_shapes = {name: tuple(e["shape"]) for name, e in ckpt.tensors.items() if "/" not in name}
    check_model_fits(f"checkpoint {ckpt.path}", ckpt.model, saved_shapes, whole_model_shapes(cfg), cfg)

    targets = load_targets(chunks)
    names = sorted({name for name, _ in targets})
    weights = ckpt.plan([(name, cut.region(name)) for name in names])
    wanted = _optimizer_requests(ckpt, optimizer, chunks, cut) if optimizer is not None else []
    optim = ckpt.plan([(f"{key}/{canonical_name(cfg, own)}", region) for own, key, region in wanted])
    files = {f for route in weights + optim for f in route.files} | {TRAINER_STATE}
    same_work = ckpt.world_size == world_size and ckpt.units_of(rank) == chunk_units(chunks)
    restore_rng_state = same_work and ckpt.has_file(rng_file(rank))
    if restore_rng_state:
        files.add(rng_file(rank))
    # Every checksum before any copy; the optimizer's tensors are read into
    # memory whole (they become its state anyway) before any weight is copied.
    ckpt.verify(sorted(files))
    trainer_state = ckpt.read_json(TRAINER_STATE)
    optim_state = None
    if optimizer is not None:
        saved: dict[str, dict[str, torch.Tensor]] = {}
        for (own, key, _), (name, tensor) in zip(wanted, ckpt.read(optim)):
            canonical = name.partition("/")[2]
            saved.setdefault(own, {})[key] = tensor if key == "step" else cut.finish(canonical, tensor)
        optim_state = _optimizer_state(ckpt, optimizer, chunks, saved)
    if loader is not None:  # refuses a different data order before anything else changes
        loader.load_state_dict(trainer_state["sampler"])

    by_name: dict[str, list[torch.Tensor]] = {}
    for name, target in targets:
        by_name.setdefault(name, []).append(target)
    with torch.no_grad():
        for name, tensor in ckpt.read(weights):
            for target in by_name[name]:
                target.copy_(cut.finish(name, tensor))
    if optimizer is not None and hasattr(optimizer, "load_sharded_state_dict"):
        optimizer.load_sharded_state_dict(optim_state)
    elif optimizer is not None:
        optimizer.load_state_dict(optim_state)
    if restore_rng_state:
        restore_rng(*ckpt.read_file(rng_file(rank)), next(chunks[0].parameters()).device)
    return LoadedCheckpoint(ckpt.path, ckpt.step, trainer_state, restore_rng_state)
