"""ZB-V's order of computations: two chunks per rank in a V, zero bubble.

ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024, and
the V schedule of "Zero Bubble Pipeline Parallelism", ICLR 2024) places two
model chunks on each of ``P`` ranks in a V (:mod:`hetpipe.pipeline.placement`): the
forward runs down ranks 0..P-1 on chunk 0 and back up on chunk 1, so rank 0
holds the embedding and the loss and rank P-1 hands chunk 0's output to its
own chunk 1. Backwards are split into B (input gradient) and W (weight
gradients, :mod:`hetpipe.models.split_backward`), and Ws fill what would be
bubbles. Rank ``r``:

* warms up with ``2(P - r) - 1`` chunk-0 forwards (microbatch 0 is back on
  its chunk 1 only then), ``r`` pairs of chunk-1 and chunk-0 forwards, and
  ``P - r`` rounds of chunk-1 F, B, W (the loss's gradient coming down);
* in the steady state repeats F, B, W on chunk 0, then F, B, W on chunk 1;
* cools down with ``r`` pairs of Bs (chunk 0, chunk 1), then ``P - r``
  chunk-0 B and W, then the chunk-1 Ws and the chunk-0 Ws left.

The order is written for at least ``2P - 1`` microbatches, what it takes to
fill the V; with fewer, the missing microbatches are left out. Ws run in
microbatch order on each chunk, so weight gradients accumulate as under
1F1B and the two are bitwise equal (tests/test_zero_bubble.py).

Bubble and memory, in :func:`hetpipe.pipeline.schedule_check.simulate`'s unit costs
(a chunk's F = B = W = 1, a chunk being half of a 1F1B stage, so a rank's
work is ``6M``): with ``M >= 2P - 1`` the makespan is ``6M + P - 1``, a
bubble of ``P - 1`` chunk forwards. That is the least any schedule can have
(the last rank waits that long for microbatch 0's first activations), half
of ZB-H1's ``P - 1`` stage forwards and a sixth of 1F1B's ``3(P - 1)``.
Each rank then holds up to ``2P`` chunks' activations between F and W, the
activations of ``P`` whole stages: 1F1B's peak on its first rank, here on
every rank, as the paper states. Fewer microbatches hold ``2 min(P, M)`` at
most and leave a larger bubble (tests/test_schedules.py asserts both).
"""
from __future__ import annotations

from hetpipe.pipeline.actions import BWD_INPUT, BWD_WEIGHT, FWD, Compute

F0, F1, B0, B1, W0, W1 = ((kind, chunk) for kind in (FWD, BWD_INPUT, BWD_WEIGHT) for chunk in (0, 1))


def v_orders(num_ranks: int, num_microbatches: int) -> list[list[Compute]]:
    """Each rank's computations under ZB-V, (kind, microbatch, chunk) in order."""
    P, M = num_ranks, num_microbatches
    slots = max(M, 2 * P - 1)
    orders = []
    for rank in range(P):
        order: list[Compute] = []
        done = dict.fromkeys((F0, F1, B0, B1, W0, W1), 0)

        def run(*units: tuple[str, int]) -> None:
            for kind, chunk in units:
                order.append((kind, done[kind, chunk], chunk))
                done[kind, chunk] += 1

        run(*[F0] * (2 * (P - rank) - 1))
        for _ in range(rank):
            run(F1, F0)
        for _ in range(P - rank):
            run(F1, B1, W1)
        for _ in range(slots - P):
            run(*[F0] * (done[F0] < slots), B0, W0, F1, B1, W1)
        for _ in range(rank):
            run(B0, B1)
        for _ in range(P - rank):
            run(B0, W0)
        run(*[W1] * (slots - done[W1]), *[W0] * (slots - done[W0]))
        orders.append([unit for unit in order if unit[1] < M])
    return orders


def zb_v_orders(num_ranks: int, num_microbatches: int, num_chunks: int = 2) -> list[list[Compute]]:
    """:func:`v_orders` as the registry calls an order (``num_chunks``: the V's two, checked there)."""
    return v_orders(num_ranks, num_microbatches)


def zb_v_forwards(num_ranks: int, num_microbatches: int, num_chunks: int = 2) -> list[list[Compute]]:
    """Validation's forwards in a V: ZB-V's own forwards, in its order, so a
    rank only ever waits for an earlier stage and keeps nothing it has sent
    on (rank P-1 holds its chunk-0 output until its chunk-1 forward, the next)."""
    return [[unit for unit in order if unit[0] == FWD] for order in v_orders(num_ranks, num_microbatches)]
