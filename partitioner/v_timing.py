"""The zb_v order as a timing program: its makespan for given chunk and message times, fast.

The planner prices a V split by the makespan of the zb_v order run with each
(rank, chunk)'s F, B and W times and each boundary message's time
(:mod:`hetpipe.partitioner.v_split`). :func:`hetpipe.pipeline.schedule_check.simulate`
computes that makespan, but it also checks every pipeline rule on every
action: 0.95 ms per run at 4 ranks x 16 microbatches and 3.75 ms at 8 x 32
on this project's 2-core machine, against 0.025 and 0.100 ms here, for a
search that runs it thousands of times (planning 1024 GPUs took 6 s with
the simulator, 1.2 s with this). The order does not change
between runs, only the times do, so :func:`program` turns it once per
(ranks, microbatches) into a flat list of computations in an order that
respects every dependency, each naming the computation whose result it
waits for (the previous virtual stage's F, the next one's B) and the
boundary that result crosses; :func:`makespan` is then one pass over that
list. tests/test_partitioner_schedules.py checks it equals the simulator's
makespan for random times.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from hetpipe.pipeline.actions import BWD_INPUT, BWD_WEIGHT, FWD
from hetpipe.pipeline.placement import Placement
from hetpipe.pipeline.schedules import compute_orders

KINDS = (FWD, BWD_INPUT, BWD_WEIGHT)


@lru_cache(maxsize=64)
def program(schedule: str, num_ranks: int, num_microbatches: int) -> tuple[tuple[int, int, int, int, int], ...]:
    """Under the V schedule ``schedule`` (zb_v): (rank, kind index in KINDS, chunk, position of the computation it waits
    for or -1, boundary it crosses or -1) per computation, dependencies first."""
    P = num_ranks
    placement = Placement(schedule, P, 2)
    last = 2 * P - 1
    orders = compute_orders(schedule, P, num_microbatches, 2)
    position: dict[tuple[str, int, int], int] = {}  # (kind, microbatch, virtual stage) -> index
    out: list[tuple[int, int, int, int, int]] = []
    cursor = [0] * P
    while len(out) < sum(len(o) for o in orders):
        progressed = False
        for rank in range(P):
            while cursor[rank] < len(orders[rank]):
                kind, mb, chunk = orders[rank][cursor[rank]]
                stage = placement.stage(rank, chunk)
                wait = None
                if kind == FWD and stage > 0:
                    wait = (FWD, mb, stage - 1)
                elif kind == BWD_INPUT:
                    wait = (BWD_INPUT, mb, stage + 1) if stage < last else (FWD, mb, stage)
                if wait is not None and wait not in position:
                    break
                dep = -1 if wait is None else position[wait]
                other = None if wait is None else placement.rank_of(wait[2])
                boundary = -1 if other is None or other == rank else min(rank, other)
                position[kind, mb, stage] = len(out)
                out.append((rank, KINDS.index(kind), chunk, dep, boundary))
                cursor[rank] += 1
                progressed = True
        if not progressed:  # the simulator proves zb_v never gets here
            raise RuntimeError(f"{schedule} order for {P} ranks x {num_microbatches} microbatches deadlocks")
    return tuple(out)


def makespan(schedule: str, num_microbatches: int, times: Sequence[Sequence[Sequence[float]]],
             links: Sequence[float]) -> float:
    """When the last rank finishes ``schedule``'s order: ``times[kind][rank][chunk]`` (kinds as
    KINDS), ``links[l]`` one message's time between ranks l and l + 1."""
    P = len(times[0])
    finish: list[float] = []
    free = [0.0] * P
    for rank, kind, chunk, dep, boundary in program(schedule, P, num_microbatches):
        start = free[rank]
        if dep >= 0:
            ready = finish[dep] + (links[boundary] if boundary >= 0 else 0.0)
            if ready > start:
                start = ready
        end = start + times[kind][rank][chunk]
        finish.append(end)
        free[rank] = end
    return max(free)
