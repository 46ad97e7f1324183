"""The schedule checker: runs every rank's action list together and proves it.

:mod:`hetpipe.pipeline.schedules` generates the per-rank action lists; this module
executes all of them at once under the transport's rules (asynchronous sends,
blocking receives, FIFO matching per ordered pair of ranks, as NCCL
point-to-point) and refuses a deadlock, a mismatched message, a backward
before its forward, a W before its B, or gradients accumulated out of
order. It also measures what a schedule costs - peak activations per rank and
a unit-cost makespan - which is what the planner's schedule model
(:mod:`hetpipe.partitioner.schedule_model`) is checked against. It lives apart
from the generators because only tests and the planner's checks need it: the
engine imports the action types, never the simulator.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable

from hetpipe.pipeline.actions import (
    ACTION_KINDS,
    BWD,
    BWD_INPUT,
    BWD_WEIGHT,
    COMPUTE_KINDS,
    FWD,
    RECV_FWD,
    SEND_BWD,
    SEND_FWD,
    Action,
)
from hetpipe.pipeline.placement import Placement
from hetpipe.pipeline.registry import INTERLEAVED_1F1B
from hetpipe.pipeline.schedules import input_stage, output_stage

# Relative cost of each computation in SimulationResult.makespan: the paper's
# T_F = T_B = T_W, so a whole backward is two units.
COMPUTE_COST = {FWD: 1, BWD_INPUT: 1, BWD_WEIGHT: 1, BWD: 2}

# (fwd|bwd, microbatch, sender virtual stage): what the transport's header
# identifies, so what a FIFO match must agree on.
Message = tuple[str, int, int]


class ScheduleError(Exception):
    """A schedule breaks the pipeline's rules: a bug in a schedule, not user input."""


@dataclass
class SimulationResult:
    """What a successful :func:`simulate` run measured."""

    # Per rank, the peak number of (microbatch, chunk) units forwarded but not
    # yet backwarded (for a split backward: not yet through B): the
    # activation memory the schedule needs, in units. Forward-only, a unit's
    # activations are freed as soon as it is computed.
    max_live_activations: list[int]
    # Rounds until every list finished, each rank doing at most one action a
    # round: a rough makespan, larger when the pipeline bubble is.
    steps: int
    # Per rank, the peak number of units between their B and their W: what
    # a split backward holds for W (the inputs and output gradients of the
    # weight GEMMs), in units.
    max_held_for_weights: list[int] = field(default_factory=list)
    # Per rank, the peak number of units forwarded and not yet through their
    # whole backward (W included): the memory bound if a unit held for W
    # kept all its activations.
    max_in_flight: list[int] = field(default_factory=list)
    # Time until the last rank finished, computations costing COMPUTE_COST
    # and messages nothing: the schedule's makespan in units of one forward,
    # whose excess over a rank's own work is its bubble.
    makespan: int = 0


def _describe(msg: Message) -> str:
    kind, mb, stage = msg
    return f"{'F' if kind == FWD else 'B'}{mb} from virtual stage {stage}"


def simulate(schedules: list[list[Action]], num_chunks: int = 1, forward_only: bool = False,
             placement: Placement | None = None,
             cost: Callable[[int, Action], float] | None = None,
             link: Callable[[int, int], float] | None = None) -> SimulationResult:
    """Run all ranks' action lists together and check every pipeline rule.

    Each round every rank attempts its next action. Sends never block and are
    delivered at the end of the round into the (sender, receiver) FIFO; a
    receive waits until that FIFO is non-empty, and its head must be exactly
    the expected message. Raises :class:`ScheduleError` on a deadlock, a
    mismatched or missing message, a computation without its input, a
    backward before its forward, a W before its B or without one, weight
    gradients accumulated (BWD or W) out of microbatch order, or a
    (microbatch, virtual stage) not computed exactly once each way. With
    ``forward_only`` (validation) any backward action is an error and only
    forwards must be complete. ``placement`` says which virtual stage each
    (rank, chunk) holds; by default Megatron's interleaving of ``num_chunks``.
    ``cost(rank, action)`` is a computation's time in the makespan
    (:data:`COMPUTE_COST` by default), e.g. per chunk for unequal chunks, and
    ``link(src, dst)`` a message's time from send to arrival (none by default):
    with both, the makespan is a prediction of the step (the planner's for zb_v).
    """
    num_ranks = len(schedules)
    if num_ranks == 0:
        raise ScheduleError("a schedule needs at least one rank")
    if placement is None:
        placement = Placement(INTERLEAVED_1F1B.name, num_ranks, num_chunks)
    if (placement.num_ranks, placement.num_chunks) != (num_ranks, num_chunks):
        raise ScheduleError(f"{num_ranks} ranks x {num_chunks} chunk(s) simulated under a placement of "
                            f"{placement.num_ranks} x {placement.num_chunks}")
    last = placement.num_stages - 1
    rank_of = placement.rank_of
    fifos: dict[tuple[int, int], deque[Message]] = defaultdict(deque)
    stamps: dict[tuple[int, int], deque[int]] = defaultdict(deque)  # send time of each FIFO entry
    inbox: list[set[Message]] = [set() for _ in range(num_ranks)]  # received, not yet consumed
    forwarded: set[tuple[int, int]] = set()  # (microbatch, virtual stage)
    backwarded: set[tuple[int, int]] = set()  # whole backward or B done
    awaiting_weights: set[tuple[int, int]] = set()  # B done, W not yet
    weighted: set[tuple[int, int]] = set()  # W done
    last_accumulation: dict[tuple[int, int], int] = {}  # (rank, chunk) -> microbatch of the last BWD or W
    live, held = [0] * num_ranks, [0] * num_ranks
    peak, peak_held, peak_in_flight = [0] * num_ranks, [0] * num_ranks, [0] * num_ranks
    clock = [0] * num_ranks
    cursor = [0] * num_ranks
    steps = 0

    def consume_input(rank: int, action: Action, stage: int) -> None:
        direction = FWD if action.kind == FWD else BWD
        source = input_stage(direction, stage, last)
        if source is None:
            return  # stage 0's forward reads data; the last stage's backward starts at the loss
        if rank_of(source) == rank:
            done = forwarded if direction == FWD else backwarded
            if (action.microbatch, source) not in done:
                raise ScheduleError(f"rank {rank}: {action} runs before its local input "
                                    f"from virtual stage {source}")
            return
        msg = (direction, action.microbatch, source)
        if msg not in inbox[rank]:
            raise ScheduleError(f"rank {rank}: {action} runs without having received "
                                f"{_describe(msg)} from rank {rank_of(source)}")
        inbox[rank].remove(msg)

    def accumulate_in_order(rank: int, action: Action) -> None:
        previous = last_accumulation.get((rank, action.chunk), -1)
        if action.microbatch < previous:
            raise ScheduleError(f"rank {rank}: {action} runs after the weight gradients of microbatch "
                                f"{previous} on chunk {action.chunk}; gradients must accumulate in "
                                "increasing microbatch order")
        last_accumulation[rank, action.chunk] = action.microbatch

    def compute(rank: int, action: Action, stage: int) -> None:
        unit = (action.microbatch, stage)
        if action.peer is not None:
            raise ScheduleError(f"rank {rank}: computation {action} must not name a peer")
        if action.kind == FWD:
            if unit in forwarded:
                raise ScheduleError(f"rank {rank}: {action} runs twice")
            consume_input(rank, action, stage)
            forwarded.add(unit)
            live[rank] += 1
            peak[rank] = max(peak[rank], live[rank])
            peak_in_flight[rank] = max(peak_in_flight[rank], live[rank] + held[rank])
            if forward_only:
                live[rank] -= 1  # no graph is kept: nothing waits for a backward
        elif action.kind == BWD_WEIGHT:
            if unit in weighted:
                raise ScheduleError(f"rank {rank}: {action} runs twice")
            if unit not in awaiting_weights:
                raise ScheduleError(f"rank {rank}: {action} runs before its input backward "
                                    f"Bi{action.microbatch}" + (f"c{action.chunk}" if action.chunk else ""))
            accumulate_in_order(rank, action)
            awaiting_weights.remove(unit)
            weighted.add(unit)
            held[rank] -= 1
        else:
            if unit in backwarded:
                raise ScheduleError(f"rank {rank}: {action} runs twice")
            if unit not in forwarded:
                raise ScheduleError(f"rank {rank}: {action} runs before its forward")
            if action.kind == BWD:
                accumulate_in_order(rank, action)
            consume_input(rank, action, stage)
            backwarded.add(unit)
            live[rank] -= 1
            if action.kind == BWD_INPUT:
                awaiting_weights.add(unit)
                held[rank] += 1
                peak_held[rank] = max(peak_held[rank], held[rank])
        clock[rank] += COMPUTE_COST[action.kind] if cost is None else cost(rank, action)

    def execute(rank: int, action: Action, outgoing: list[tuple[int, int, Message]]) -> bool:
        """Do ``action``; False when it is a receive that must wait."""
        if action.kind not in ACTION_KINDS:
            raise ScheduleError(f"rank {rank}: unknown action kind {action.kind!r}")
        if forward_only and action.kind not in (RECV_FWD, FWD, SEND_FWD):
            raise ScheduleError(f"rank {rank}: {action} in a forward-only schedule")
        if not 0 <= action.chunk < num_chunks or action.microbatch < 0:
            raise ScheduleError(f"rank {rank}: {action} names a chunk or microbatch out of range")
        stage = placement.stage(rank, action.chunk)
        if action.kind in COMPUTE_KINDS:
            compute(rank, action, stage)
            return True

        direction = FWD if action.kind in (SEND_FWD, RECV_FWD) else BWD
        sending = action.kind in (SEND_FWD, SEND_BWD)
        other = (output_stage if sending else input_stage)(direction, stage, last)
        if other is None or rank_of(other) == rank or action.peer != rank_of(other):
            expected = "no message" if other is None or rank_of(other) == rank else f"rank {rank_of(other)}"
            raise ScheduleError(f"rank {rank}: {action} has the wrong peer; virtual stage "
                                f"{stage} exchanges {direction} with {expected}")
        if sending:
            if (action.microbatch, stage) not in (forwarded if direction == FWD else backwarded):
                raise ScheduleError(f"rank {rank}: {action} sends before computing it")
            outgoing.append((rank, action.peer, (direction, action.microbatch, stage)))
            return True
        fifo = fifos[action.peer, rank]
        if not fifo:
            return False
        expected_msg = (direction, action.microbatch, other)
        if fifo[0] != expected_msg:
            raise ScheduleError(
                f"rank {rank} posts a receive for {_describe(expected_msg)} from rank "
                f"{action.peer}, but the next message rank {action.peer} sent it is "
                f"{_describe(fifo[0])}")
        inbox[rank].add(fifo.popleft())
        clock[rank] = max(clock[rank], stamps[action.peer, rank].popleft())
        return True

    while any(cursor[r] < len(schedules[r]) for r in range(num_ranks)):
        steps += 1
        outgoing: list[tuple[int, int, Message]] = []
        progressed = False
        for rank in range(num_ranks):
            if cursor[rank] < len(schedules[rank]) and execute(rank, schedules[rank][cursor[rank]], outgoing):
                cursor[rank] += 1
                progressed = True
        # Delivering after the round keeps ranks symmetric: no rank sees a
        # message sent in the same round just because it was iterated later.
        for src, dst, msg in outgoing:
            fifos[src, dst].append(msg)
            stamps[src, dst].append(clock[src] + (0 if link is None else link(src, dst)))
        if not progressed:
            stuck = ", ".join(f"rank {r} waits at {schedules[r][cursor[r]]}"
                              for r in range(num_ranks) if cursor[r] < len(schedules[r]))
            raise ScheduleError(f"deadlock: {stuck}")

    for (src, dst), fifo in fifos.items():
        if fifo:
            raise ScheduleError(f"rank {src} sent {_describe(fifo[0])} to rank {dst}, "
                                "which never received it")
    for rank, msgs in enumerate(inbox):
        if msgs:
            raise ScheduleError(f"rank {rank} received {_describe(min(msgs))} but never used it")
    num_microbatches = 1 + max((mb for mb, _ in forwarded | backwarded), default=-1)
    required = ((forwarded, "forward"),) if forward_only else ((forwarded, "forward"), (backwarded, "backward"))
    for mb in range(num_microbatches):
        for stage in range(last + 1):
            for done, name in required:
                if (mb, stage) not in done:
                    raise ScheduleError(f"microbatch {mb} has no {name} on virtual stage {stage} "
                                        "(rank {}, chunk {})".format(*placement.location(stage)))
    if awaiting_weights:
        mb, stage = min(awaiting_weights)
        raise ScheduleError(f"microbatch {mb} has no weight backward (W) on virtual stage {stage} "
                            "(rank {}, chunk {}) after its input backward".format(*placement.location(stage)))
    return SimulationResult(max_live_activations=peak, steps=steps, max_held_for_weights=peak_held,
                            max_in_flight=peak_in_flight, makespan=max(clock))
