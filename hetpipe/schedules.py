"""Pipeline schedules as plain data: what each pipeline rank does, in order.

The order of forwards, backwards, sends and receives is where pipeline bugs
live: a deadlock, a receive matched to the wrong message, gradients summed in
a different order than a single-process run. All of these can be found
without a GPU or a process, so schedules are pure functions returning one
list of :class:`Action` per pipeline rank, the engine executes its rank's list
verbatim, and :func:`hetpipe.schedule_check.simulate` runs all lists together
under the transport's rules (asynchronous sends, blocking receives, FIFO
matching per ordered pair of ranks, as NCCL point-to-point) to prove a
schedule correct. This module only generates; the checker is a module of its
own so that the engine, which imports the action types, carries no simulator.

Virtual stages follow Megatron's interleaving: chunk ``c`` on rank ``r`` is
virtual stage ``v = c * P + r``; stage 0 reads the inputs and stage
``P * num_chunks - 1`` computes the loss. A hand-off between consecutive
virtual stages on the *same* rank (only possible with ``P == 1`` and several
chunks) is local: no message, the engine passes the tensor in-process.

Every receive is immediately followed by the computation that consumes it,
and every send immediately follows the computation that produced it, so the
engine can pair them with their neighbour; :func:`_with_communication` says
why that order is also consistent with FIFO matching.
"""
from __future__ import annotations

from dataclasses import dataclass

from hetpipe.errors import ConfigError

FWD, BWD = "fwd", "bwd"
# Zero-bubble split backward (Qi et al., "Zero Bubble Pipeline Parallelism",
# ICLR 2024): BWD_INPUT ("B" in the paper) is the gradient with respect to
# the unit's input, which the previous stage waits for; BWD_WEIGHT ("W") the
# weight gradients, which nobody waits for and so can fill a bubble. A unit
# has either one BWD or one BWD_INPUT followed, later, by its BWD_WEIGHT.
BWD_INPUT, BWD_WEIGHT = "bwd_input", "bwd_weight"
SEND_FWD, RECV_FWD, SEND_BWD, RECV_BWD = "send_fwd", "recv_fwd", "send_bwd", "recv_bwd"
ACTION_KINDS = (RECV_FWD, FWD, SEND_FWD, RECV_BWD, BWD, BWD_INPUT, BWD_WEIGHT, SEND_BWD)
COMPUTE_KINDS = (FWD, BWD, BWD_INPUT, BWD_WEIGHT)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
# Schedules whose backward is split into B and W (models/split_backward.py).
SPLIT_BACKWARD_SCHEDULES = ("zb_h1",)

# (fwd|bwd, microbatch, chunk): one computation on one rank.
Compute = tuple[str, int, int]


@dataclass(frozen=True)
class Action:
    """One step of one pipeline rank.

    ``chunk`` is the model chunk on this rank that computes, or whose
    activations/gradients are sent or received; ``peer`` is the rank on the
    other end of a send or receive and ``None`` for computations.
    """

    kind: str
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    def __str__(self) -> str:
        letter = {FWD: "F", BWD: "B", BWD_INPUT: "Bi", BWD_WEIGHT: "W", SEND_FWD: "F", RECV_FWD: "F"}
        unit = f"{letter.get(self.kind, 'B')}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")
        if self.kind.startswith("send_"):
            return f"send{unit}->{self.peer}"
        if self.kind.startswith("recv_"):
            return f"recv{unit}<-{self.peer}"
        return unit


def gpipe(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """GPipe: every rank runs all forwards, then all backwards.

    Backwards run in increasing microbatch order (not GPipe's usual reverse)
    so gradients accumulate in the same order as a single-process run.
    """
    _check_sizes(num_stages, num_microbatches, 1)
    order = [(FWD, m, 0) for m in range(num_microbatches)]
    order += [(BWD, m, 0) for m in range(num_microbatches)]
    return _with_communication([order] * num_stages, 1)


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush, Megatron's non-interleaved schedule).

    Rank ``s`` runs ``min(P - s - 1, M)`` warm-up forwards, then alternates
    one forward and one backward, then drains the remaining backwards, so at
    most ``P - s`` microbatches hold activations on it at once.
    """
    _check_sizes(num_stages, num_microbatches, 1)
    orders = []
    for rank in range(num_stages):
        warmup = min(num_stages - rank - 1, num_microbatches)
        order = [(FWD, m, 0) for m in range(warmup)]
        for m in range(num_microbatches - warmup):
            order += [(FWD, m + warmup, 0), (BWD, m, 0)]
        order += [(BWD, m, 0) for m in range(num_microbatches - warmup, num_microbatches)]
        orders.append(order)
    return _with_communication(orders, 1)


def interleaved_one_f_one_b(
    num_stages: int, num_microbatches: int, num_chunks: int
) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B (Narayanan et al., 2021).

    Each rank holds ``num_chunks`` model chunks. Microbatches advance in groups
    of ``P``: the k-th forward of a rank runs chunk ``(k // P) % num_chunks``
    on the next microbatch of that chunk, and backwards visit the chunks in
    reverse. Rank ``r`` warms up with ``2 * (P - r - 1) + (num_chunks - 1) * P``
    forwards (capped at the total), then alternates, then drains.
    """
    _check_sizes(num_stages, num_microbatches, num_chunks)
    if num_chunks < 2:
        raise ConfigError(
            f"interleaved_1f1b needs num_chunks >= 2, got {num_chunks}; use 1f1b for one chunk per rank"
        )
    _check_groups("interleaved_1f1b", num_stages, num_microbatches)
    total = num_microbatches * num_chunks

    def unit(k: int, kind: str) -> Compute:
        return _interleaved_unit(k, kind, num_stages, num_chunks)

    orders = []
    for rank in range(num_stages):
        warmup = min((num_stages - rank - 1) * 2 + (num_chunks - 1) * num_stages, total)
        order = [unit(k, FWD) for k in range(warmup)]
        for k in range(total - warmup):
            order += [unit(k + warmup, FWD), unit(k, BWD)]
        order += [unit(k, BWD) for k in range(total - warmup, total)]
        orders.append(order)
    return _with_communication(orders, num_chunks)


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> list[list[Action]]:
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
    _check_sizes(num_stages, num_microbatches, 1)
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
    return _with_communication(orders, 1)


def forward_only(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> list[list[Action]]:
    """Validation: every rank receives, forwards and sends each microbatch; no backward.

    Each rank runs the forwards in the order its training schedule does
    (microbatch order; interleaved units for several chunks), so every pair
    of ranks carries its messages in the order the receiver consumes them,
    and a rank only ever waits for an earlier virtual stage: no deadlock, and
    nothing is kept once it has been sent on.
    """
    _check_sizes(num_stages, num_microbatches, num_chunks)
    if num_chunks > 1:
        _check_groups("forward_only with several chunks", num_stages, num_microbatches)
    order = [_interleaved_unit(k, FWD, num_stages, num_chunks) for k in range(num_microbatches * num_chunks)]
    return _with_communication([order] * num_stages, num_chunks)


def build_schedule(
    name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> list[list[Action]]:
    """The schedule called ``name`` (one of :data:`SCHEDULES`)."""
    if name == "interleaved_1f1b":
        return interleaved_one_f_one_b(num_stages, num_microbatches, num_chunks)
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if num_chunks != 1:
        raise ConfigError(f"schedule {name!r} runs one chunk per rank, got num_chunks={num_chunks}; "
                          "use interleaved_1f1b for several")
    if name == "gpipe":
        return gpipe(num_stages, num_microbatches)
    if name == "zb_h1":
        return zero_bubble_h1(num_stages, num_microbatches)
    return one_f_one_b(num_stages, num_microbatches)


def _check_sizes(num_stages: int, num_microbatches: int, num_chunks: int) -> None:
    for label, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                         ("num_chunks", num_chunks)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{label} must be a positive integer, got {value!r}")


def _check_groups(name: str, num_stages: int, num_microbatches: int) -> None:
    if num_microbatches % num_stages:
        raise ConfigError(
            f"{name} needs num_microbatches ({num_microbatches}) to be a multiple "
            f"of the pipeline size ({num_stages})"
        )


def _interleaved_unit(k: int, kind: str, num_stages: int, num_chunks: int) -> Compute:
    """The k-th forward (or backward) of a rank under interleaving: groups of
    ``num_stages`` microbatches per chunk, chunks in reverse for backwards.
    With one chunk it is simply microbatch ``k``."""
    group, within = divmod(k, num_stages * num_chunks)
    chunk = within // num_stages
    if kind == BWD:
        chunk = num_chunks - 1 - chunk
    return kind, group * num_stages + within % num_stages, chunk


def input_stage(kind: str, stage: int, last: int) -> int | None:
    """The virtual stage whose output a computation of ``stage`` consumes."""
    source = stage - 1 if kind == FWD else stage + 1
    return source if 0 <= source <= last else None


def output_stage(kind: str, stage: int, last: int) -> int | None:
    """The virtual stage that consumes what a computation of ``stage`` produces."""
    target = stage + 1 if kind == FWD else stage - 1
    return target if 0 <= target <= last else None


def _with_communication(orders: list[list[Compute]], num_chunks: int) -> list[list[Action]]:
    """Add sends and receives to each rank's computation order.

    A receive goes right before the computation that consumes it and a send
    right after the one that produced it. The transport matches messages FIFO
    per (sender, receiver) pair, so this is only correct if each receiver
    consumes a pair's messages in the order they were sent. With P >= 3 a pair
    carries one direction only and both ends walk microbatches in the same
    order. With P == 2 and interleaving, rank 0 sends rank 1 both activations
    (chunk c) and gradients (chunk c + 1); Megatron's warm-up, two forwards
    longer per rank, is what makes rank 1 need them in exactly the order rank
    0 produces them, so no receive has to move. :func:`hetpipe.schedule_check.simulate`
    checks it.
    """
    num_ranks = len(orders)
    last = num_ranks * num_chunks - 1
    schedules = []
    for rank, order in enumerate(orders):
        actions: list[Action] = []
        for kind, mb, chunk in order:
            stage = chunk * num_ranks + rank
            if kind == BWD_WEIGHT:  # local work: nothing to receive or send
                actions.append(Action(kind, mb, chunk))
                continue
            source = input_stage(kind, stage, last)
            if source is not None and source % num_ranks != rank:
                actions.append(Action(RECV_FWD if kind == FWD else RECV_BWD, mb, chunk, source % num_ranks))
            actions.append(Action(kind, mb, chunk))
            target = output_stage(kind, stage, last)
            if target is not None and target % num_ranks != rank:
                actions.append(Action(SEND_FWD if kind == FWD else SEND_BWD, mb, chunk, target % num_ranks))
        schedules.append(actions)
    return schedules
