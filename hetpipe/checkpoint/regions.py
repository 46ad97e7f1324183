"""Which part of a whole tensor a saved piece holds.

A rank saves what it holds, so a checkpoint tensor is made of pieces. A
:class:`Region` says which part of the whole (plan-neutral) tensor a piece
is, in two steps:

* ``dim`` and ``runs``: the tensor-parallel slice, ``whole.index_select(dim,
  cat(arange(a, b) for a, b in runs))`` - the rows (or columns) a TP rank
  holds, in its own order (a fused q/k/v rank holds three runs). ``dim`` None
  is the whole tensor (replicated over TP, or no TP at all);
* ``flat``: under ZeRO-1, the range ``[a, b)`` of that slice, flattened, that
  a data-parallel rank owns; None is all of it.

Runs are plain ``[start, stop)`` pairs, so a region is also its JSON form in
the manifest (``{"dim": 0, "index": [[0, 64], [128, 160]], "flat": [0, 100]}``,
absent keys meaning None).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

Runs = tuple[tuple[int, int], ...]


def runs_of(index: Sequence[int] | np.ndarray | torch.Tensor) -> Runs:
    """Consecutive ascending stretches of ``index``, in its order: [0,1,2,7,8] -> ((0, 3), (7, 9))."""
    idx = np.asarray(index.tolist() if isinstance(index, torch.Tensor) else index, dtype=np.int64).reshape(-1)
    if idx.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [idx.size]))
    return tuple((int(idx[a]), int(idx[b - 1]) + 1) for a, b in zip(starts, stops))


def indices(runs: Runs) -> np.ndarray:
    """The index list ``runs`` stands for."""
    if not runs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in runs])


def count(runs: Runs) -> int:
    return sum(b - a for a, b in runs)


@dataclass(frozen=True)
class Region:
    dim: Optional[int] = None
    runs: Optional[Runs] = None
    flat: Optional[tuple[int, int]] = None

    @property
    def sliced(self) -> bool:
        return self.dim is not None

    @property
    def slice(self) -> Region:
        """This region without its flat range: the TP slice it lies in."""
        return Region(self.dim, self.runs)

    def local_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of the TP slice (before ``flat``)."""
        out = list(shape)
        if self.dim is not None:
            out[self.dim] = count(self.runs or ())
        return tuple(out)

    def stored_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of the tensor a piece with this region stores."""
        if self.flat is not None:
            return (self.flat[1] - self.flat[0],)
        return self.local_shape(shape)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.dim is not None:
            out["dim"] = self.dim
            out["index"] = [list(r) for r in self.runs or ()]
        if self.flat is not None:
            out["flat"] = list(self.flat)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Region:
        dim = data.get("dim")
        runs = tuple((int(a), int(b)) for a, b in data["index"]) if dim is not None else None
        flat = tuple(int(x) for x in data["flat"]) if data.get("flat") is not None else None
        return cls(None if dim is None else int(dim), runs, flat)  # type: ignore[arg-type]

    def check(self, shape: Sequence[int]) -> Optional[str]:
        """Why this region does not fit a tensor of ``shape``, or None."""
        if self.dim is not None:
            if not 0 <= self.dim < len(shape):
                return f"dim {self.dim} of a {len(shape)}-d tensor"
            if any(not 0 <= a < b <= shape[self.dim] for a, b in self.runs or ()):
                return f"index runs {[list(r) for r in self.runs or ()]} outside [0, {shape[self.dim]})"
        if self.flat is not None:
            numel = int(np.prod(self.local_shape(shape), dtype=np.int64))
            if not 0 <= self.flat[0] < self.flat[1] <= numel:
                return f"flat range {list(self.flat)} outside [0, {numel})"
        return None


def without(mine: Runs, others: Sequence[Runs]) -> tuple[Runs, np.ndarray]:
    """``mine`` minus every index in ``others``, in ``mine``'s order, and the
    positions (within ``mine``'s index list) of what is left."""
    idx = indices(mine)
    if not others or idx.size == 0:
        return mine, np.arange(idx.size)
    taken = np.concatenate([indices(o) for o in others])
    keep = np.flatnonzero(~np.isin(idx, taken))
    return runs_of(idx[keep]), keep


def tp_region(param: object) -> Region:
    """The TP slice a parameter holds, from its ``tp_shard`` mark (:mod:`hetpipe.parallel.tp_shards`);
    the whole tensor for an unmarked or replicated parameter."""
    shard = getattr(param, "tp_shard", None)
    if shard is None or shard.rule is None or shard.tp.size == 1:
        return Region()
    return Region(shard.rule.dim, runs_of(shard.rule.index(shard.tp.rank)))


def whole_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The unsharded shape of (anything shaped like) a TP parameter."""
    shape = list(param.shape)
    shard = getattr(param, "tp_shard", None)
    if shard is not None and shard.rule is not None and shard.tp.size > 1:
        shape[shard.rule.dim] = shard.rule.full_size
    return tuple(shape)


@dataclass(frozen=True)
class Piece:
    """One saved piece of a tensor: the file that holds it and which part of the whole it is."""
    file: str
    region: Region


@dataclass
class TensorEntry:
    """A checkpoint tensor as its manifest records it: the whole's shape and dtype, and its pieces."""
    shape: tuple[int, ...]
    dtype: str
    pieces: list[Piece]
