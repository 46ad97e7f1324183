"""The shapes a placement can take: how (rank, chunk) maps to a virtual stage.

A pipeline of ``P`` ranks with ``C`` model chunks each runs ``P * C``
virtual stages in pipeline order (stage 0 reads the tokens, the last one
computes the loss). A schedule's registry entry (:mod:`hetpipe.pipeline.registry`)
names one of these layouts, and :mod:`hetpipe.pipeline.placement` answers
for a schedule by asking its layout:

* **interleaved** (Megatron's interleaving): chunk ``c`` of rank ``r`` is
  stage ``c * P + r``, so the forward walks the ranks ``C`` times in the
  same direction; one chunk is the plain pipeline.
* **V-shaped** (Qi et al., "Pipeline Parallelism with Controllable Memory",
  2024): two chunks, rank ``r`` holds stage ``r`` (chunk 0) and stage
  ``2P - 1 - r`` (chunk 1). The forward goes down ranks 0..P-1 and back up
  P-1..0, so rank 0 holds both the embedding and the loss, and the hand-off
  between stages P-1 and P stays on rank P-1.

This module sits below the registry (which names a layout per schedule)
and the placement (which reads a schedule's layout), so neither imports the
other's module in a loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


def interleaved_stage(rank: int, chunk: int, num_ranks: int) -> int:
    return chunk * num_ranks + rank


def v_stage(rank: int, chunk: int, num_ranks: int) -> int:
    return rank if chunk == 0 else 2 * num_ranks - 1 - rank


@dataclass(frozen=True)
class Layout:
    """One placement shape: its stage function and the chunks it has room for."""

    name: str
    # (rank, chunk, num_ranks) -> the virtual stage that chunk holds.
    stage: Callable[[int, int, int], int]
    # Chunks per rank the shape needs (None: any number), and how a refusal
    # words it ("exactly two chunks per rank (a V)").
    chunks: Optional[int] = None
    room: str = ""


INTERLEAVED = Layout("interleaved", interleaved_stage)
V_SHAPE = Layout("V", v_stage, chunks=2, room="exactly two chunks per rank (a V)")
