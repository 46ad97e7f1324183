"""Which virtual stage each (rank, chunk) holds: the one place that says it.

A pipeline of ``P`` ranks with ``C`` model chunks each runs ``P * C``
virtual stages in pipeline order. Where they sit is the schedule's layout
(its registry entry, :mod:`hetpipe.pipeline.registry`; the shapes are in
:mod:`hetpipe.pipeline.layouts`): Megatron's interleaving (chunk ``c`` of
rank ``r`` is stage ``c * P + r``) for every schedule but ``zb_v``, whose two
chunks form a V (stages ``r`` and ``2P - 1 - r``).

Every consumer - the schedules and their simulator, the engine's chunks
(built by the trainer from the plan's per-stage unit ranges), the plan's
rank layout, the topology's neighbours and routes - asks :func:`virtual_stage`
or the :class:`Placement` built on it, so a schedule's placement is its
entry's layout and a new shape is one layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from hetpipe.pipeline.registry import schedule_spec


def virtual_stage(schedule: str, rank: int, chunk: int, num_ranks: int) -> int:
    """The virtual stage that chunk ``chunk`` of pipeline rank ``rank`` holds under ``schedule``."""
    return schedule_spec(schedule).layout.stage(rank, chunk, num_ranks)


@dataclass(frozen=True)
class Placement:
    """:func:`virtual_stage` for one pipeline shape, both ways, with the rank pairs it implies."""

    schedule: str
    num_ranks: int
    num_chunks: int = 1
    _stage: Callable[[int, int, int], int] = field(init=False, repr=False, compare=False)
    _where: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        spec = schedule_spec(self.schedule)
        spec.check_placement(self.num_chunks)
        object.__setattr__(self, "_stage", spec.layout.stage)  # looked up once: simulators call stage() often
        where = {self.stage(r, c): (r, c) for r in range(self.num_ranks) for c in range(self.num_chunks)}
        object.__setattr__(self, "_where", where)

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.num_chunks

    def stage(self, rank: int, chunk: int) -> int:
        return self._stage(rank, chunk, self.num_ranks)

    def location(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding virtual stage ``stage``."""
        return self._where[stage]

    def rank_of(self, stage: int) -> int:
        return self._where[stage][0]

    def rank_pairs(self) -> list[tuple[int, int]]:
        """Ordered (rank, rank) pairs that exchange messages (activations one
        way, gradients the other): both directions of every boundary between
        consecutive virtual stages on different ranks."""
        pairs = {(self.rank_of(v), self.rank_of(v + 1)) for v in range(self.num_stages - 1)}
        return sorted({d for a, b in pairs if a != b for d in ((a, b), (b, a))})

    def neighbours(self, rank: int) -> list[int]:
        """The other ranks ``rank`` exchanges messages with."""
        return sorted({b for a, b in self.rank_pairs() if a == rank})
