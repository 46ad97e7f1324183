"""Which virtual stage each (rank, chunk) holds: the one place that says it.

A pipeline of ``P`` ranks with ``C`` model chunks each runs ``P * C``
virtual stages in pipeline order (stage 0 reads the tokens, the last one
computes the loss). Where they sit depends on the schedule:

* **interleaved** (every schedule but ``zb_v``; Megatron's interleaving):
  chunk ``c`` of rank ``r`` is stage ``c * P + r``, so the forward walks
  the ranks ``C`` times in the same direction.
* **V-shaped** (``zb_v``; Qi et al., "Pipeline Parallelism with
  Controllable Memory", 2024): two chunks, rank ``r`` holds stage ``r``
  (chunk 0) and stage ``2P - 1 - r`` (chunk 1). The forward goes down
  ranks 0..P-1 and back up P-1..0, so rank 0 holds both the embedding and
  the loss, and the hand-off between stages P-1 and P stays on rank P-1.

Every consumer - the schedules and their simulator, the engine's chunks
(built by the trainer from the plan's per-stage unit ranges), the plan's
rank layout, the topology's neighbours and routes - asks :func:`virtual_stage`
or the :class:`Placement` built on it, so a new placement is one edit here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hetpipe.errors import ConfigError

# Schedules that place their chunks in a V (two chunks per rank).
V_SHAPED_SCHEDULES = ("zb_v",)


def virtual_stage(schedule: str, rank: int, chunk: int, num_ranks: int) -> int:
    """The virtual stage that chunk ``chunk`` of pipeline rank ``rank`` holds under ``schedule``."""
    if schedule in V_SHAPED_SCHEDULES:
        return rank if chunk == 0 else 2 * num_ranks - 1 - rank
    return chunk * num_ranks + rank


def check_chunks(schedule: str, num_chunks: int) -> None:
    """Refuse a chunk count ``schedule``'s placement has no room for."""
    if schedule in V_SHAPED_SCHEDULES and num_chunks != 2:
        raise ConfigError(f"schedule {schedule} places exactly two chunks per rank (a V), got "
                          f"num_chunks={num_chunks}; set partition.num_chunks=2")


@dataclass(frozen=True)
class Placement:
    """:func:`virtual_stage` for one pipeline shape, both ways, with the rank pairs it implies."""

    schedule: str
    num_ranks: int
    num_chunks: int = 1
    _where: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_chunks(self.schedule, self.num_chunks)
        where = {virtual_stage(self.schedule, r, c, self.num_ranks): (r, c)
                 for r in range(self.num_ranks) for c in range(self.num_chunks)}
        object.__setattr__(self, "_where", where)

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.num_chunks

    def stage(self, rank: int, chunk: int) -> int:
        return virtual_stage(self.schedule, rank, chunk, self.num_ranks)

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
