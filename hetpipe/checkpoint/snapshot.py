"""What one rank writes in a checkpoint, copied to host memory in the step.

A rank saves what it holds, never gathered: its TP slice of each weight and
of the weight's optimizer state (as :mod:`hetpipe.checkpoint.writes` decides
against the other ranks of its directory), and under ZeRO-1
(``optimizer.distributed``) its own flat ranges of the AdamW moments.

:func:`take_snapshot` runs on the main thread and is all a step waits for:
the pieces are copied into host buffers (kept from one save to the next, so
later saves allocate nothing) and the RNG, sampler and trainer state
captured; the files are written afterwards, in the background.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from hetpipe.checkpoint.layout import model_file, optim_file, rng_file
from hetpipe.checkpoint.names import canonical_name, chunk_units
from hetpipe.checkpoint.regions import Region
from hetpipe.checkpoint.rng import capture_rng
from hetpipe.checkpoint.writes import Holding, Write
from hetpipe.models import CausalLM


@dataclass
class Snapshot:
    """One rank's part of a checkpoint, in host memory."""
    step: int
    rank: int
    files: dict[str, dict[str, torch.Tensor]]          # file name -> {tensor name: host tensor}
    metadata: dict[str, dict[str, str]]                # file name -> safetensors metadata
    index: dict[str, dict[str, Any]]                   # tensor name -> {"shape", "dtype", "pieces"}
    units: list[list[int]]
    trainer_state: Optional[str] = None                # rank 0: trainer_state.json's text
    stall_s: float = 0.0
    started: float = 0.0                               # time.monotonic() when it began


class HostBuffers:
    """Host copies reused from one save to the next (pinned for GPU tensors)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._used: dict[tuple[str, str], torch.Tensor] = {}
        self._pending_gpu = False

    def copy(self, key: tuple[str, str], tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        gpu = tensor.device.type != "cpu"
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=gpu)
        buf.copy_(tensor, non_blocking=gpu)
        self._pending_gpu |= gpu
        self._used[key] = buf
        return buf

    def finish(self) -> None:
        """Wait for the copies; keep only the buffers this save used."""
        if self._pending_gpu:
            torch.cuda.synchronize()
        self._buffers, self._used, self._pending_gpu = self._used, {}, False


def _entry(index: dict[str, dict[str, Any]], name: str, shape: Sequence[int], tensor: torch.Tensor,
           file: str, region: Region) -> None:
    slot = index.setdefault(name, {"shape": list(shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                                   "pieces": []})
    slot["pieces"].append({"file": file, **region.to_json()})


def _cut(tensor: torch.Tensor, write: Write) -> torch.Tensor:
    if write.keep is None or write.region is None or write.region.dim is None:
        return tensor
    return tensor.index_select(write.region.dim, torch.from_numpy(write.keep).to(tensor.device))


def take_snapshot(step: int, rank: int, chunks: Sequence[CausalLM], optimizer: torch.optim.Optimizer,
                  writes: Mapping[str, Write], held: Mapping[str, Holding], buffers: Optional[HostBuffers],
                  loader_state: Optional[Mapping[str, Any]], extra_state: Optional[Mapping[str, Any]]) -> Snapshot:
    """This rank's pieces as host tensors (copied into ``buffers``; None: not copied, for a save
    written before the step continues). ``loader_state`` is saved by rank 0 only."""
    started = time.monotonic()
    mfile, ofile, rfile = model_file(rank), optim_file(rank), rng_file(rank)
    files: dict[str, dict[str, torch.Tensor]] = {mfile: {}, ofile: {}, rfile: {}}
    index: dict[str, dict[str, Any]] = {}
    fresh: set[tuple[str, str]] = set()

    def put(file: str, name: str, tensor: torch.Tensor, region: Region, shape: Sequence[int], new: bool) -> None:
        files[file][name] = tensor
        if new:
            fresh.add((file, name))
        _entry(index, name, shape, tensor, file, region)

    # id(parameter) -> (canonical name, whether it is a tied copy that this rank's embedding stands for)
    params = {}
    for c in chunks:
        for n, p in c.named_parameters():
            canonical = canonical_name(c.cfg, n)
            params[id(p)] = (canonical, canonical != n and not held[canonical].copy)
    for chunk in chunks:
        for name, tensor in chunk.state_dict(keep_vars=True).items():
            canonical = canonical_name(chunk.cfg, name)
            w = writes.get(canonical)
            if w is None or w.region is None or (canonical != name and not held[canonical].copy):
                continue
            put(mfile, canonical, _cut(tensor.detach(), w), w.region, held[canonical].shape, w.keep is not None)
    if hasattr(optimizer, "sharded_state_dict"):  # ZeRO-1: this rank's flat ranges, whatever the directory holds
        cfg = chunks[0].cfg
        for own_name, entry in optimizer.sharded_state_dict().items():
            canonical = canonical_name(cfg, own_name)
            w = writes[canonical]
            if not w.zero or (own_name != canonical and not held[canonical].copy):
                continue
            region = Region(held[canonical].region.dim, held[canonical].region.runs, tuple(entry["range"]))
            for key in ("exp_avg", "exp_avg_sq"):
                put(ofile, f"{key}/{canonical}", entry[key], region, held[canonical].shape, True)
        step_count = optimizer.state_step()
        if step_count is not None:
            for canonical in sorted({c for c, _ in params.values()}):
                if writes[canonical].region is not None:
                    put(ofile, f"step/{canonical}", torch.tensor(float(step_count)), Region(), (), True)
    else:
        for group in optimizer.param_groups:
            for p in group["params"]:
                canonical, shadowed = params[id(p)]
                w = writes[canonical]
                if w.region is None or shadowed:
                    continue
                for key, value in optimizer.state.get(p, {}).items():
                    value = torch.as_tensor(value).detach()
                    if value.dim() == 0:
                        put(ofile, f"{key}/{canonical}", value, Region(), (), False)
                    else:
                        put(ofile, f"{key}/{canonical}", _cut(value, w), w.region, held[canonical].shape,
                            w.keep is not None)
    device = next(chunks[0].parameters()).device
    rng, rng_meta = capture_rng(device)
    files[rfile] = {k: v.detach().cpu().clone() for k, v in rng.items()}
    if buffers is not None:
        for file in (mfile, ofile):
            for name, tensor in files[file].items():
                if (file, name) not in fresh or tensor.device.type != "cpu":
                    files[file][name] = buffers.copy((file, name), tensor)
        buffers.finish()
    else:
        for file in (mfile, ofile):
            for name, tensor in files[file].items():
                if tensor.device.type != "cpu":
                    files[file][name] = tensor.to("cpu")
    trainer_state = None
    if rank == 0:
        state = {"step": step, "sampler": dict(loader_state or {}), "extra": dict(extra_state or {})}
        trainer_state = json.dumps(state, indent=1, sort_keys=True) + "\n"
    return Snapshot(step, rank, {f: t for f, t in files.items() if t}, {rfile: rng_meta}, index,
                    chunk_units(chunks), trainer_state, time.monotonic() - started, started)
