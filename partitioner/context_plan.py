"""``plan=auto`` over context-parallel degrees: the solver's search once per CP degree, the fastest plan kept.

A CP degree ``C`` splits every stage's sequences over ``C`` ranks
(:mod:`hetpipe.parallel.context`), so a stage has TP x CP x DP ranks and each
rank is priced at its ``s / C`` tokens plus what CP adds
(:func:`hetpipe.partitioner.context_cost.context_unit_costs`): the attention
its queries pay for the other ranks' keys, the K/V exchange on the group's
links and its memory. Searching each degree exactly and keeping the fastest
keeps the whole search exact; CP wins when a sequence fits only split, or
when splitting is priced faster (long sequences, where TP's unsplit share
and the pipeline's bubble cost more than the exchange).

Degrees: divisors of every group's ranks per node (the CP group stays on a
node's fabric, as TP's does) that cut the sequence into ``2C`` equal chunks;
``planner.cp`` fixes one. Every group runs the same degree (a boundary hands
CP rank i's slice to CP rank i: partitioner/resolve.py).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

from hetpipe.devices.cluster import ClusterConfig
from hetpipe.errors import ConfigError
from hetpipe.partitioner.context_cost import cp_degrees
from hetpipe.partitioner.split import INF


def planned_cp_degrees(cluster: ClusterConfig, seq_length: int, fixed: Optional[int]) -> list[int]:
    """The CP degrees plan=auto searches (``fixed``: planner.cp, checked)."""
    per_node = math.gcd(*(g.ranks_per_node for g in cluster.groups))
    found = cp_degrees(per_node, seq_length)
    if fixed is None:
        return found
    if fixed not in found:
        raise ConfigError(f"planner.cp={fixed} must divide every group's ranks per node ({per_node} in common) "
                          f"and cut train.seq_length={seq_length} into 2 x {fixed} equal chunks; "
                          f"degrees that do: {found}")
    return [fixed]


def fastest_over_cp(solve_at: Callable, cluster: ClusterConfig, seq_length: int, fixed: Optional[int]):
    """The fastest of ``solve_at(cp, beat)`` over the degrees (ties to the
    smaller degree). After the first plan a degree searches only candidates
    whose lower bound beats it (``beat``: exact, and most are pruned unseen).
    Where none fits, the error of the smallest degree that raised.

    The largest degree goes first: where planning is slow (many GPUs, long
    sequences) a large degree tends to win and its step prunes the smaller
    degrees' searches, zb_v's walk included (docs/benchmarks.md, "Planning
    1024 GPUs with context parallelism's degrees"). A later degree is smaller,
    so it is searched for a step at most the best one (a tie goes to it)."""
    best, error, tried = None, None, []
    for cp in reversed(planned_cp_degrees(cluster, seq_length, fixed)):
        try:
            found = solve_at(cp, INF if best is None else best.step_s + abs(best.step_s) * 1e-9)
        except ConfigError as exc:
            error = exc
            continue
        if found is None:
            continue
        tried.insert(0, found)
        if best is None or found.step_s <= best.step_s + abs(best.step_s) * 1e-9:  # zb_v's climb may end above beat
            best = found
    if best is None:
        raise error
    return _with_every_option(best, tried)


def _with_every_option(best, tried: list):
    """``best`` with, per schedule, the fastest step any degree found (a later
    degree prunes the schedules an earlier one beat), and every degree's counts."""
    options = {}
    for solution in tried:
        for option in solution.schedule_options:
            held = options.get(option.schedule)
            if held is None or held.step_s is None or (option.step_s is not None and option.step_s < held.step_s):
                options[option.schedule] = option
    best.schedule_options = [options[o.schedule] for o in tried[0].schedule_options if o.schedule in options]
    best.candidates_solved = sum(s.candidates_solved for s in tried)
    best.candidates_total = sum(s.candidates_total for s in tried)
    return best
