"""Writing a checkpoint from every rank at once, committed by rank 0.

Each rank writes what it owns into the shared temporary directory: its
unit-keyed weights, its optimizer state keyed by the same names, its RNG
states, and a small part file listing those files (sha256, size, tensors).
After a barrier, rank 0 merges the part files into ``manifest.json``, checks
that the ranks together saved every tensor of the model, and renames the
directory into place; a second barrier makes the call return on every rank
only once the checkpoint is committed. Hashing happens on the rank that wrote
the file, so rank 0 never reads the whole model.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from hetpipe.checkpoint.settings import CheckpointConfig, resolve_save_dir
from hetpipe.checkpoint.layout import (TRAINER_STATE, commit, fsync_path, iter_dir_name, model_file,
                                       optim_file, part_file, prune, rng_file, tmp_dir_name)
from hetpipe.checkpoint.manifest import FORMAT, MANIFEST, VERSION, CheckpointError, file_record
from hetpipe.checkpoint.names import chunk_units, owned_state, parameter_names, whole_model_shapes
from hetpipe.checkpoint.rng import capture_rng
from hetpipe.models import CausalLM, ModelConfig
from hetpipe.partitioner.plan import Plan


def _world_barrier() -> None:
    dist.barrier()  # the default group: the world group, gloo on CPU


def optimizer_state(chunks: Sequence[CausalLM], optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as ``<key>/<canonical name>`` tensors.

    Hyper-parameters (lr, betas, weight decay) are not saved: they come from
    the run's config, and the LR is a function of the step.
    """
    names = parameter_names(chunks)
    out: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("the optimizer holds a parameter that is not in the chunks being saved")
            name, tied_copy = names[id(p)]
            if tied_copy:
                continue  # identical to the embedding owner's state
            for key, value in optimizer.state.get(p, {}).items():
                out[f"{key}/{name}"] = torch.as_tensor(value)
    return out


def _save_tensors(tensors: Mapping[str, torch.Tensor], path: Path, metadata: Optional[dict[str, str]] = None
                  ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Write CPU copies to ``path``; returns (file record, tensor index entries)."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    save_file(cpu, str(path), metadata=metadata)
    fsync_path(path)
    index = {name: {"file": path.name, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
             for name, t in cpu.items()}
    return file_record(path), index


def _write_json(path: Path, data: Any) -> dict[str, Any]:
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    fsync_path(path)
    return file_record(path)


def save_checkpoint(cfg: CheckpointConfig, run_dir: str | Path, step: int, chunks: Sequence[CausalLM],
                    optimizer: torch.optim.Optimizer, loader_state: Mapping[str, Any], rank: int,
                    world_size: int, model_cfg: ModelConfig, plan: Optional[Plan] = None, *,
                    barrier: Optional[Callable[[], None]] = None,
                    extra_state: Optional[Mapping[str, Any]] = None,
                    model_state: Optional[Mapping[str, torch.Tensor]] = None,
                    optim_state: Optional[Mapping[str, torch.Tensor]] = None) -> Path:
    """Save the state after ``step`` optimizer steps; a collective over all ranks.

    ``loader_state`` is the data loader's ``state_dict()``; ``extra_state`` is
    any further JSON-able trainer state (rank 0's is saved). ``barrier``
    defaults to a barrier over the world group when ``world_size`` > 1; tests
    pass a no-op and call rank 1 ... then rank 0 to play several ranks in one
    process. Returns the committed checkpoint directory.

    ``model_state`` / ``optim_state`` replace what this rank would save from
    ``chunks`` / ``optimizer``: under tensor or data parallelism the trainer
    gathers whole tensors onto one writer per stage and passes empty dicts on
    the other ranks (:func:`hetpipe.parallel.checkpoint.gather_for_save`).
    """
    if barrier is None:
        barrier = _world_barrier if world_size > 1 else (lambda: None)
    started = time.monotonic()
    save_dir = resolve_save_dir(cfg, run_dir)
    tmp, final = save_dir / tmp_dir_name(step), save_dir / iter_dir_name(step)
    tmp.mkdir(parents=True, exist_ok=True)
    device = next(chunks[0].parameters()).device

    # Weights and optimizer state go into the manifest's tensor index (any
    # rank of any plan may need them); RNG states are read back only by the
    # same rank of the same plan, as a whole file.
    if model_state is None:
        model_state = owned_state(chunks)
    if optim_state is None:
        optim_state = optimizer_state(chunks, optimizer)
    model_record, index = _save_tensors(model_state, tmp / model_file(rank))
    optim_record, optim_index = _save_tensors(optim_state, tmp / optim_file(rank))
    rng_tensors, rng_metadata = capture_rng(device)
    rng_record, _ = _save_tensors(rng_tensors, tmp / rng_file(rank), rng_metadata)
    index.update(optim_index)
    files = [model_record, optim_record, rng_record]
    if rank == 0:
        trainer_state = {"step": step, "sampler": dict(loader_state), "extra": dict(extra_state or {})}
        files.append(_write_json(tmp / TRAINER_STATE, trainer_state))
    part = {"rank": rank, "units": chunk_units(chunks), "files": files, "tensors": index}
    (tmp / part_file(rank)).write_text(json.dumps(part))

    barrier()
    if rank == 0:
        manifest = _merge_parts(tmp, step, world_size, model_cfg, plan)
        listed = {f["name"] for f in manifest["files"]}
        for child in tmp.iterdir():  # part files, and leftovers of a crashed save
            if child.name not in listed:
                child.unlink()
        _write_json(tmp / MANIFEST, manifest)
        commit(tmp, save_dir, step)
        removed = prune(save_dir, cfg.keep_last, step)
        size = sum(f["size"] for f in manifest["files"])
        note = f", removed {', '.join(p.name for p in removed)}" if removed else ""
        print(f"hetpipe: saved checkpoint {final} ({size / 2**20:.1f} MiB, "
              f"{time.monotonic() - started:.1f} s{note})", flush=True)
    barrier()
    return final


def _merge_parts(tmp: Path, step: int, world_size: int, model_cfg: ModelConfig, plan: Optional[Plan]) -> dict:
    parts = []
    for r in range(world_size):
        path = tmp / part_file(r)
        if not path.is_file():
            raise CheckpointError(f"rank {r} wrote no {path.name} into {tmp}; the checkpoint is incomplete")
        parts.append(json.loads(path.read_text()))
    files = [f for part in parts for f in part["files"]]
    position = {f["name"]: i for i, f in enumerate(files)}
    tensors: dict[str, dict[str, Any]] = {}
    owner: dict[str, int] = {}
    for part in parts:
        for name, entry in part["tensors"].items():
            if name in tensors:
                raise CheckpointError(f"tensor {name} was saved by both rank {owner[name]} and rank {part['rank']}")
            owner[name] = part["rank"]
            tensors[name] = {**entry, "file": position[entry["file"]]}
    # Refuse to commit a checkpoint that could not restore the whole model.
    for name, shape in whole_model_shapes(model_cfg).items():
        if name not in tensors:
            raise CheckpointError(f"no rank saved tensor {name}, so {tmp} would not hold the whole model")
        if tuple(tensors[name]["shape"]) != shape:
            raise CheckpointError(f"tensor {name} was saved with shape {tensors[name]['shape']}, "
                                  f"not the model's {list(shape)}")
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "model": model_cfg.to_dict(),
        "plan": dataclasses.asdict(plan) if plan is not None else None,
        "world_size": world_size,
        "ranks": [{"rank": p["rank"], "units": p["units"]} for p in parts],
        "files": files,
        "tensors": dict(sorted(tensors.items())),
    }
