"""Reading any region of a tensor from the pieces that ranks saved.

A checkpoint tensor is a list of pieces (:mod:`hetpipe.checkpoint.regions`),
each in some rank's file; a reader asks for the region it holds now (the
whole tensor, a TP slice, a ZeRO flat range of one) under any plan. Reading
is planned before anything is read - which pieces, so which files - so the
loader can verify every file's checksum first, and name a file that is
needed but not here (a node's local directory holds only its own ranks'
files). Two routes, the cheaper first:

* the pieces of exactly the wanted TP slice, by flat range (a ZeRO rank
  resuming under the same TP degree reads only the ranges it owns);
* whole slices ("sources": a piece without a flat range, or the flat pieces
  that together make one slice) placed along one dim, then cut to the
  wanted region (resharding to another TP degree, or export).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from hetpipe.checkpoint.errors import CheckpointError
from hetpipe.checkpoint.regions import Piece, Region, TensorEntry, indices
from hetpipe.checkpoint.st_io import SafetensorsReader


@dataclass
class Route:
    """How to build one wanted region: ``flat`` pieces of its own slice, or whole ``sources`` along ``dim``."""
    name: str
    want: Region
    flat: list[Piece] = field(default_factory=list)
    sources: list[list[Piece]] = field(default_factory=list)
    dim: Optional[int] = None

    @property
    def files(self) -> list[str]:
        pieces = self.flat + [p for s in self.sources for p in s]
        return list(dict.fromkeys(p.file for p in pieces))


def _numel(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _cover(lo: int, hi: int, items: list[tuple[int, int, Piece]]) -> Optional[list[Piece]]:
    """Pieces whose [start, stop) ranges cover [lo, hi), fewest first-found; None if they cannot."""
    if lo >= hi:
        return []
    chosen, pos = [], lo
    while pos < hi:
        best = max((it for it in items if it[0] <= pos < it[1]), key=lambda it: it[1], default=None)
        if best is None:
            return None
        chosen.append(best[2])
        pos = best[1]
    return chosen


def plan_route(name: str, entry: TensorEntry, want: Region, usable: Callable[[str], bool]) -> Optional[Route]:
    """A way to read ``want`` of ``name`` from the pieces in ``usable`` files, or None."""
    shape = entry.shape
    pieces = [p for p in entry.pieces if usable(p.file)]
    local = _numel(want.local_shape(shape))
    lo, hi = want.flat or (0, local)
    same = [((p.region.flat or (0, local))[0], (p.region.flat or (0, local))[1], p)
            for p in pieces if p.region.slice == want.slice]
    chosen = _cover(lo, hi, same)
    if chosen is not None:
        return Route(name, want, flat=chosen)
    # Whole slices: unflattened pieces, and flat pieces that together make their slice.
    sources: list[list[Piece]] = [[p] for p in pieces if p.region.flat is None]
    groups: dict[Region, list[tuple[int, int, Piece]]] = {}
    for p in pieces:
        if p.region.flat is not None:
            groups.setdefault(p.region.slice, []).append((*p.region.flat, p))
    for part, items in groups.items():
        made = _cover(0, _numel(part.local_shape(shape)), items)
        if made is not None:
            sources.append(made)
    whole = next((s for s in sources if s[0].region.dim is None), None)
    if whole is not None:
        return Route(name, want, sources=[whole])
    dims = list(dict.fromkeys(([want.dim] if want.dim is not None else []) + [s[0].region.dim for s in sources]))
    for d in dims:
        needed = np.zeros(shape[d], dtype=bool)
        needed[indices(want.runs) if want.dim == d else slice(None)] = True
        picked = []
        for s in sources:
            idx = indices(s[0].region.runs or ())
            if s[0].region.dim == d and needed.any() and needed[idx].any():
                picked.append(s)
                needed[idx] = False
        if not needed.any():
            return Route(name, want, sources=picked, dim=d)
    return None


def _piece(read: Callable[[Piece], torch.Tensor], piece: Piece, entry: TensorEntry, name: str) -> torch.Tensor:
    tensor = read(piece)
    expected = piece.region.stored_shape(entry.shape)
    if tuple(tensor.shape) != tuple(expected) or str(tensor.dtype).removeprefix("torch.") != entry.dtype:
        raise CheckpointError(f"checkpoint file {piece.file} holds {name} as {list(tensor.shape)} "
                              f"{str(tensor.dtype).removeprefix('torch.')}, but the manifest says "
                              f"{list(expected)} {entry.dtype}")
    return tensor


def _flat_into(out: torch.Tensor, lo: int, pieces: list[Piece], local: int, get: Callable[[Piece], torch.Tensor]
               ) -> None:
    """Copy the parts of ``pieces`` (flat ranges of one slice) that fall in ``[lo, lo + out.numel())``."""
    hi = lo + out.numel()
    for p in pieces:
        pa, pb = p.region.flat or (0, local)
        a, b = max(lo, pa), min(hi, pb)
        if a < b:
            out[a - lo:b - lo].copy_(get(p).reshape(-1)[a - pa:b - pa])


def read_route(route: Route, entry: TensorEntry, read: Callable[[Piece], torch.Tensor]) -> torch.Tensor:
    """The tensor ``route.want`` describes, built from the pieces ``read`` returns."""
    def get(p: Piece) -> torch.Tensor:
        return _piece(read, p, entry, route.name)

    want, shape = route.want, entry.shape
    dtype = getattr(torch, entry.dtype)
    local_shape = want.local_shape(shape)
    local = _numel(local_shape)
    if route.flat:
        lo, hi = want.flat or (0, local)
        if len(route.flat) == 1 and route.flat[0].region == want:
            return get(route.flat[0])
        out = torch.empty(hi - lo, dtype=dtype)
        _flat_into(out, lo, route.flat, local, get)
        return out if want.flat is not None else out.view(local_shape)

    def materialise(source: list[Piece]) -> torch.Tensor:
        if len(source) == 1 and source[0].region.flat is None:
            return get(source[0])
        part = source[0].region.slice
        buf = torch.empty(_numel(part.local_shape(shape)), dtype=dtype)
        _flat_into(buf, 0, source, buf.numel(), get)
        return buf.view(part.local_shape(shape))

    d = route.dim
    if d is None:
        result = materialise(route.sources[0])
        if want.dim is not None:
            result = result.index_select(want.dim, torch.from_numpy(indices(want.runs)))
    elif want.dim == d:
        result = torch.empty(local_shape, dtype=dtype)
        position = np.full(shape[d], -1, dtype=np.int64)
        position[indices(want.runs)] = np.arange(local_shape[d])
        for source in route.sources:
            at = position[indices(source[0].region.runs or ())]
            keep = np.flatnonzero(at >= 0)
            result.index_copy_(d, torch.from_numpy(at[keep]),
                               materialise(source).index_select(d, torch.from_numpy(keep)))
    else:
        result = torch.empty(shape, dtype=dtype)
        for source in route.sources:
            result.index_copy_(d, torch.from_numpy(indices(source[0].region.runs or ())), materialise(source))
        if want.dim is not None:
            result = result.index_select(want.dim, torch.from_numpy(indices(want.runs)))
    if want.flat is not None:
        return result.reshape(-1)[want.flat[0]:want.flat[1]].clone()
    return result


class Readers:
    """Open safetensors files of one read, each opened once."""

    def __init__(self, path_of: Callable[[str], object]) -> None:
        self._path_of = path_of
        self._open: dict[str, SafetensorsReader] = {}

    def read(self, piece: Piece, key: str) -> torch.Tensor:
        if piece.file not in self._open:
            self._open[piece.file] = SafetensorsReader(self._path_of(piece.file))  # type: ignore[arg-type]
        return self._open[piece.file].get(key)
