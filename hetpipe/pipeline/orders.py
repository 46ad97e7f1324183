"""Each schedule's order of computations on every rank, without messages.

An order is one list of (kind, microbatch, chunk) per pipeline rank; a
schedule's registry entry (:mod:`hetpipe.pipeline.registry`) names its order
function, and :mod:`hetpipe.pipeline.schedules` adds the sends and receives
its placement implies. Every order function takes (ranks, microbatches,
chunks); those of a fixed chunk count get the count their entry checked.
ZB-V's order is a module of its own (:mod:`hetpipe.pipeline.schedule_zbv`).
"""
from __future__ import annotations

from hetpipe.errors import ConfigError
from hetpipe.pipeline.actions import BWD, BWD_INPUT, BWD_WEIGHT, FWD, Compute


def gpipe_orders(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> list[list[Compute]]:
    """GPipe: every rank runs all forwards, then all backwards.

    Backwards run in increasing microbatch order (not GPipe's usual reverse)
    so gradients accumulate in the same order as a single-process run.
    """
    order = [(FWD, m, 0) for m in range(num_microbatches)]
    order += [(BWD, m, 0) for m in range(num_microbatches)]
    return [order] * num_stages


def one_f_one_b_orders(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> list[list[Compute]]:
    """1F1B (PipeDream-flush, Megatron's non-interleaved schedule).

    Rank ``s`` runs ``min(P - s - 1, M)`` warm-up forwards, then alternates
    one forward and one backward, then drains the remaining backwards, so at
    most ``P - s`` microbatches hold activations on it at once.
    """
    orders = []
    for rank in range(num_stages):
        warmup = min(num_stages - rank - 1, num_microbatches)
        order = [(FWD, m, 0) for m in range(warmup)]
        for m in range(num_microbatches - warmup):
            order += [(FWD, m + warmup, 0), (BWD, m, 0)]
        order += [(BWD, m, 0) for m in range(num_microbatches - warmup, num_microbatches)]
        orders.append(order)
    return orders


def interleaved_orders(num_stages: int, num_microbatches: int, num_chunks: int) -> list[list[Compute]]:
    """Megatron-LM's interleaved 1F1B (Narayanan et al., 2021).

    Each rank holds ``num_chunks`` model chunks. Microbatches advance in groups
    of ``P``: the k-th forward of a rank runs chunk ``(k // P) % num_chunks``
    on the next microbatch of that chunk, and backwards visit the chunks in
    reverse. Rank ``r`` warms up with ``2 * (P - r - 1) + (num_chunks - 1) * P``
    forwards (capped at the total), then alternates, then drains.
    """
    total = num_microbatches * num_chunks

    def unit(k: int, kind: str) -> Compute:
        return interleaved_unit(k, kind, num_stages, num_chunks)

    orders = []
    for rank in range(num_stages):
        warmup = min((num_stages - rank - 1) * 2 + (num_chunks - 1) * num_stages, total)
        order = [unit(k, FWD) for k in range(warmup)]
        for k in range(total - warmup):
            order += [unit(k + warmup, FWD), unit(k, BWD)]
        order += [unit(k, BWD) for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def zero_bubble_h1_orders(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> list[list[Compute]]:
    """ZB-H1 (Qi et al., 2024, section 3.1): 1F1B with the backward split into
    B and W, and W postponed to fill the bubbles.

    Only B is on the critical path from the last stage back to the first, so
    the B chain reaches rank 0 sooner than 1F1B's whole backwards, and the
    postponed Ws run where 1F1B's ranks waited. Rank ``s`` warms up as in
    1F1B with ``P - s - 1`` forwards, then runs F, B and (once ``s`` Ws are
    pending) the oldest W; the cool-down runs each remaining B followed by a
    W, and the last ``s`` Ws at the end. At most ``P`` units are between their
    F and their W on any rank: the peak of 1F1B's rank 0, which the paper's
    ZB-H1 keeps, for a bubble of ``(P - 1)(T_F + T_B - T_W)`` instead of
    1F1B's ``(P - 1)(T_F + T_B + T_W)``: a third of it at equal costs.
    Ws run in microbatch order, so weight gradients accumulate as in 1F1B.
    """
    orders = []
    for rank in range(num_stages):
        warmup = min(num_stages - rank - 1, num_microbatches)
        order: list[Compute] = [(FWD, m, 0) for m in range(warmup)]
        next_w = 0

        def weight() -> Compute:
            nonlocal next_w
            next_w += 1
            return BWD_WEIGHT, next_w - 1, 0

        for m in range(num_microbatches - warmup):
            order += [(FWD, m + warmup, 0), (BWD_INPUT, m, 0)]
            if m + 1 - next_w > rank:
                order.append(weight())
        for m in range(num_microbatches - warmup, num_microbatches):
            order.append((BWD_INPUT, m, 0))
            if m + 1 - next_w > rank:
                order.append(weight())
        order += [weight() for _ in range(next_w, num_microbatches)]
        orders.append(order)
    return orders


def interleaved_forwards(num_stages: int, num_microbatches: int, num_chunks: int) -> list[list[Compute]]:
    """Validation's forwards under an interleaved placement: every rank in
    microbatch order (interleaved units for several chunks), as its training
    schedule runs them, so a rank only ever waits for an earlier stage."""
    if num_chunks > 1:
        check_groups("forward_only with several chunks", num_stages, num_microbatches)
    order = [interleaved_unit(k, FWD, num_stages, num_chunks) for k in range(num_microbatches * num_chunks)]
    return [order] * num_stages


def check_sizes(num_stages: int, num_microbatches: int, num_chunks: int) -> None:
    for label, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                         ("num_chunks", num_chunks)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{label} must be a positive integer, got {value!r}")


def check_groups(name: str, num_stages: int, num_microbatches: int) -> None:
    if num_microbatches % num_stages:
        raise ConfigError(
            f"{name} needs num_microbatches ({num_microbatches}) to be a multiple "
            f"of the pipeline size ({num_stages})"
        )


def interleaved_unit(k: int, kind: str, num_stages: int, num_chunks: int) -> Compute:
    """The k-th forward (or backward) of a rank under interleaving: groups of
    ``num_stages`` microbatches per chunk, chunks in reverse for backwards.
    With one chunk it is simply microbatch ``k``."""
    group, within = divmod(k, num_stages * num_chunks)
    chunk = within // num_stages
    if kind == BWD:
        chunk = num_chunks - 1 - chunk
    return kind, group * num_stages + within % num_stages, chunk
