"""Which rank writes which piece into a checkpoint directory.

Every rank holds some tensors (a :class:`Holding`: its TP slice of the whole
tensor). Tensors held alike by several ranks of one checkpoint directory are
written once there (:func:`plan_writes`): DP replicas' weights by the lowest
rank, a tensor replicated over TP (a norm) by the lowest TP rank, KV rows
replicated over TP by the first rank holding them, a tied output head's copy
of ``embedding.weight`` only where no embedding owner writes into the
directory. Dedup is per directory, not per job: with node-local directories
every node keeps what its own ranks need to resume under the same plan.
ZeRO-1 ranges of the moments are each rank's own and always written.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from hetpipe.checkpoint.names import canonical_name
from hetpipe.checkpoint.regions import Region, Runs, tp_region, whole_shape, without
from hetpipe.models import CausalLM


@dataclass(frozen=True)
class Holding:
    """A tensor this rank holds: its TP slice of the whole ``shape``; ``copy``: a tied head's copy."""
    region: Region
    shape: tuple[int, ...]
    copy: bool = False

    def to_json(self) -> dict[str, Any]:
        return {**self.region.to_json(), "shape": list(self.shape), "copy": self.copy}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Holding:
        return cls(Region.from_json(data), tuple(data["shape"]), bool(data["copy"]))


def holdings(chunks: Sequence[CausalLM]) -> dict[str, Holding]:
    """Canonical name -> what this rank holds of it (a rank holding the embedding and its copy: the embedding)."""
    out: dict[str, Holding] = {}
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for name, tensor in chunk.state_dict(keep_vars=True).items():
            canonical = canonical_name(chunk.cfg, name)
            held = Holding(tp_region(params.get(name)), whole_shape(tensor), canonical != name)
            if canonical not in out or out[canonical].copy:
                out[canonical] = held
    return out


@dataclass(frozen=True)
class Write:
    """What this rank writes of one tensor: ``region`` of the weight (None: nothing), ``keep`` the
    positions of that region within the rank's own slice along its dim (None: all of it), and whether
    its ZeRO ranges of the moments are written (False only for a tied copy beside its owner)."""
    region: Optional[Region]
    keep: Optional[np.ndarray] = None
    zero: bool = True


def plan_writes(rank: int, mine: Mapping[str, Holding], everyone: Optional[Mapping[int, Mapping[str, Holding]]],
                directory: Sequence[int]) -> dict[str, Write]:
    """For each tensor this rank holds, what it writes into its directory.

    ``everyone`` is every rank's :func:`holdings`, ``directory`` the ranks
    that write into the same directory. Without ``everyone`` (ranks played
    one after the other in one process) every rank writes all it holds but
    tied copies.
    """
    out: dict[str, Write] = {}
    for name, held in mine.items():
        if everyone is None:
            out[name] = Write(None if held.copy else held.region, zero=not held.copy)
            continue
        peers = [(s, everyone[s][name]) for s in directory if s != rank and name in everyone[s]]
        if held.copy and any(not h.copy for _, h in peers):
            out[name] = Write(None, zero=False)
            continue
        prior = [h.region for s, h in peers if (h.copy, s) < (held.copy, rank)]
        if any(not r.sliced for r in prior):
            out[name] = Write(None)  # a rank before this one writes the whole tensor
            continue
        if not prior:
            out[name] = Write(held.region)
            continue
        dim = held.region.dim if held.region.sliced else prior[0].dim
        runs: Runs = held.region.runs if held.region.sliced else ((0, held.shape[dim]),)  # type: ignore[index]
        left, keep = without(runs, [r.runs for r in prior if r.dim == dim and r.runs is not None])
        if not left:
            out[name] = Write(None)
        elif left == runs:
            out[name] = Write(held.region)
        else:
            out[name] = Write(Region(dim, left), keep)
    return out
