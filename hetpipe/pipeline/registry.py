"""One entry per pipeline schedule: everything hetpipe knows about it.

A schedule used to be a bare string whose facts lived in eight places (the
generators, the placement, the planner's in-flight and weight-credit tables,
the plan's and the resolver's checks, the plan command, the V split). Each
is now a field of its :class:`Schedule` here, and every one of those places
reads the entry:

* how to build it: its order of computations per rank
  (:mod:`hetpipe.pipeline.orders`, :mod:`hetpipe.pipeline.schedule_zbv`),
  and validation's forward-only order under the same placement; the
  messages follow from the placement (:mod:`hetpipe.pipeline.schedules`);
* its placement: a layout (:mod:`hetpipe.pipeline.layouts`) and its chunks
  per rank, fixed or the user's choice (interleaving);
* whether it splits backwards into B and W (then the trainer allows retained
  graphs, and full recomputation is refused: its deferred W would rerun a
  fully recomputed layer's forward again);
* how the planner prices it (:class:`Pricing`), or None where the planner
  does not model it.

Adding a schedule is its order function, its entry in :data:`SCHEDULES`, and
its tests (docs/architecture.md, "How to add a schedule"). This module
imports nothing above the pipeline's own vocabulary, so the partitioner may
read it; the partitioner keeps the pricing code, keyed by :attr:`Pricing.split`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from hetpipe.errors import ConfigError
from hetpipe.pipeline.actions import Compute
from hetpipe.pipeline.layouts import INTERLEAVED, V_SHAPE, Layout
from hetpipe.pipeline.orders import (
    check_groups,
    check_sizes,
    gpipe_orders,
    interleaved_forwards,
    interleaved_orders,
    one_f_one_b_orders,
    zero_bubble_h1_orders,
)
from hetpipe.pipeline.schedule_zbv import zb_v_forwards, zb_v_orders

# (ranks, microbatches, chunks) -> each rank's computations, in order.
Orders = Callable[[int, int, int], list[list[Compute]]]

# How the planner's split search prices a schedule (partitioner/schedule_model.py):
# one unit range per rank, by the step formula with the entry's in-flight
# counts and weight credit (partitioner/split.py), or two ranges per rank in a
# V, by running the entry's own order with each chunk's times (partitioner/v_split.py).
CONTIGUOUS, V_SPLIT = "contiguous", "v_split"

# What partition.schedule runs unless told otherwise.
DEFAULT_SCHEDULE = "1f1b"


def no_weight_credit(num_stages: int, num_microbatches: int) -> float:
    return 0.0


def zb_h1_weight_credit(num_stages: int, num_microbatches: int) -> float:
    """kappa in ``p_k = t_k - 2 kappa w_k``: 1 with M >= P, scaled down below
    (fewer Ws to fill the warm-up with; partitioner/schedule_model.py)."""
    P, M = num_stages, num_microbatches
    return 0.0 if P == 1 else (P - 2 + min(M, P)) / (2 * (P - 1))


def gpipe_in_flight(num_stages: int, num_microbatches: int) -> np.ndarray:
    return np.full(num_stages, num_microbatches)


def one_f_one_b_in_flight(num_stages: int, num_microbatches: int) -> np.ndarray:
    return np.minimum(num_stages - np.arange(num_stages), num_microbatches)


def zb_h1_in_flight(num_stages: int, num_microbatches: int) -> np.ndarray:
    return np.full(num_stages, min(num_stages, num_microbatches))


@dataclass(frozen=True)
class Pricing:
    """What the planner needs to price a schedule (partitioner/schedule_model.py)."""

    # The order the planner lists schedules in and breaks ties by: least memory first.
    preference: int
    # CONTIGUOUS or V_SPLIT: which split search prices it.
    split: str = CONTIGUOUS
    # CONTIGUOUS: per stage, the most microbatches between their F and their W
    # (or whole backward) at once, (stages, microbatches) -> array.
    in_flight: Optional[Callable[[int, int], np.ndarray]] = None
    # CONTIGUOUS: kappa of the fill/drain path p_k = t_k - 2 kappa w_k (k > 0),
    # and its largest value for the search's lower bounds (None: no credit).
    weight_credit: Callable[[int, int], float] = no_weight_credit
    max_weight_credit: Optional[float] = None
    # Messages each way over a boundary per microbatch (both chunks' in a V).
    boundary_messages: int = 1


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule's facts; see the module docstring."""

    name: str
    # Each rank's computations, and validation's forward-only ones (Orders).
    orders: Orders
    forwards: Orders
    layout: Layout
    # Chunks per rank: fixed, or None for the user's choice of at least two (interleaving).
    chunks: Optional[int]
    # Backwards split into B (input gradient) and W (weight gradients).
    split_backward: bool
    # None: the planner does not model it.
    pricing: Optional[Pricing] = None

    def check_placement(self, num_chunks: int) -> None:
        """Refuse a chunk count the layout has no room for."""
        if self.layout.chunks is not None and num_chunks != self.layout.chunks:
            raise ConfigError(f"schedule {self.name} places {self.layout.room}, got num_chunks={num_chunks}; "
                              f"set partition.num_chunks={self.layout.chunks}")

    def check_chunks(self, num_chunks: int) -> None:
        """Refuse a chunk count the schedule cannot run (fixed-count schedules)."""
        self.check_placement(num_chunks)
        if self.chunks == 1 and num_chunks != 1:
            raise ConfigError(f"schedule {self.name!r} runs one chunk per rank, got num_chunks={num_chunks}; "
                              f"use {_interleaving()} for several")

    def check_shape(self, num_stages: int, num_microbatches: int, num_chunks: int) -> None:
        """Refuse a pipeline shape the schedule cannot be built for."""
        if self.chunks is not None:
            self.check_chunks(num_chunks)
            check_sizes(num_stages, num_microbatches, 1)
            return
        # Interleaving: microbatches advance in groups of P over every chunk.
        check_sizes(num_stages, num_microbatches, num_chunks)
        if num_chunks < 2:
            raise ConfigError(f"{self.name} needs num_chunks >= 2, got {num_chunks}; "
                              f"use {DEFAULT_SCHEDULE} for one chunk per rank")
        check_groups(self.name, num_stages, num_microbatches)

    def computations(self, num_stages: int, num_microbatches: int, num_chunks: int) -> list[list[Compute]]:
        """Each rank's computations, once the shape is checked."""
        self.check_shape(num_stages, num_microbatches, num_chunks)
        return self.orders(num_stages, num_microbatches, num_chunks)

    def forward_computations(self, num_stages: int, num_microbatches: int,
                             num_chunks: int) -> list[list[Compute]]:
        """Validation's forwards under this schedule's placement, once the shape is checked."""
        check_sizes(num_stages, num_microbatches, num_chunks)
        self.check_placement(num_chunks)
        return self.forwards(num_stages, num_microbatches, num_chunks)


GPIPE = Schedule("gpipe", gpipe_orders, interleaved_forwards, INTERLEAVED, chunks=1, split_backward=False,
                 pricing=Pricing(preference=3, in_flight=gpipe_in_flight))
ONE_F_ONE_B = Schedule("1f1b", one_f_one_b_orders, interleaved_forwards, INTERLEAVED, chunks=1,
                       split_backward=False, pricing=Pricing(preference=0, in_flight=one_f_one_b_in_flight))
INTERLEAVED_1F1B = Schedule("interleaved_1f1b", interleaved_orders, interleaved_forwards, INTERLEAVED,
                            chunks=None, split_backward=False)
ZB_H1 = Schedule("zb_h1", zero_bubble_h1_orders, interleaved_forwards, INTERLEAVED, chunks=1, split_backward=True,
                 pricing=Pricing(preference=1, in_flight=zb_h1_in_flight, weight_credit=zb_h1_weight_credit,
                                 max_weight_credit=1.0))
ZB_V = Schedule("zb_v", zb_v_orders, zb_v_forwards, V_SHAPE, chunks=2, split_backward=True,
                pricing=Pricing(preference=2, split=V_SPLIT, boundary_messages=2))

# Every schedule, in the order messages list them.
SCHEDULES: dict[str, Schedule] = {s.name: s for s in (GPIPE, ONE_F_ONE_B, INTERLEAVED_1F1B, ZB_H1, ZB_V)}


def schedule_spec(name: str) -> Schedule:
    """The entry of the schedule called ``name``; an unknown name is refused in one line."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def planned() -> tuple[Schedule, ...]:
    """The schedules the planner models, in its order (least memory first)."""
    return tuple(sorted((s for s in SCHEDULES.values() if s.pricing is not None), key=lambda s: s.pricing.preference))


def several_chunks() -> str:
    """Which schedules run more than one chunk per rank, for messages:
    'interleaved_1f1b (or zb_v, for two)'."""
    fixed = [f"{s.name}, for {_NUMBERS.get(s.chunks, s.chunks)}" for s in SCHEDULES.values() if (s.chunks or 0) > 1]
    return _interleaving() + "".join(f" (or {f})" for f in fixed)


_NUMBERS = {2: "two", 3: "three", 4: "four"}


def _interleaving() -> str:
    return ", ".join(s.name for s in SCHEDULES.values() if s.chunks is None)
