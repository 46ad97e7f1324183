"""Pipeline schedules as plain data: what each pipeline rank does, in order.

The order of forwards, backwards, sends and receives is where pipeline bugs
live: a deadlock, a receive matched to the wrong message, gradients summed in
a different order than a single-process run. All of these can be found
without a GPU or a process, so schedules are pure functions returning one
list of :class:`Action` per pipeline rank, the engine executes its rank's list
verbatim, and :func:`hetpipe.pipeline.schedule_check.simulate` runs all lists together
under the transport's rules (asynchronous sends, blocking receives, FIFO
matching per ordered pair of ranks, as NCCL point-to-point) to prove a
schedule correct. This module only generates; the checker is a module of its
own so that the engine, which imports the action types, carries no simulator.

Which virtual stage a (rank, chunk) holds is :mod:`hetpipe.pipeline.placement`'s
answer: Megatron's interleaving (chunk ``c`` on rank ``r`` is stage
``c * P + r``) for all but ``zb_v``, whose two chunks form a V (stages ``r``
and ``2P - 1 - r``). Stage 0 reads the inputs and the last stage computes
the loss. A hand-off between consecutive virtual stages on the *same* rank
(the V's turn on rank P-1, or one rank with several chunks) is local: no
message, the engine passes the tensor in-process.

Every send immediately follows the computation that produced it, and every
receive immediately precedes the computation that consumes it, unless FIFO
matching needs it earlier (only zb_v's do); :func:`_with_communication` says
why.
"""
from __future__ import annotations

from hetpipe.pipeline.actions import (
    BWD,
    BWD_INPUT,
    BWD_WEIGHT,
    FWD,
    RECV_BWD,
    RECV_FWD,
    SEND_BWD,
    SEND_FWD,
    Action,
    Compute,
)
from hetpipe.errors import ConfigError
from hetpipe.pipeline.placement import Placement, check_chunks
from hetpipe.pipeline.schedule_zbv import v_orders

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v")
# Schedules whose backward is split into B and W (models/split_backward.py).
SPLIT_BACKWARD_SCHEDULES = ("zb_h1", "zb_v")


def gpipe(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """GPipe: every rank runs all forwards, then all backwards.

    Backwards run in increasing microbatch order (not GPipe's usual reverse)
    so gradients accumulate in the same order as a single-process run.
    """
    _check_sizes(num_stages, num_microbatches, 1)
    return _with_communication(_gpipe_orders(num_stages, num_microbatches), Placement("gpipe", num_stages))


def _gpipe_orders(num_stages: int, num_microbatches: int) -> list[list[Compute]]:
    order = [(FWD, m, 0) for m in range(num_microbatches)]
    order += [(BWD, m, 0) for m in range(num_microbatches)]
    return [order] * num_stages


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush, Megatron's non-interleaved schedule).

    Rank ``s`` runs ``min(P - s - 1, M)`` warm-up forwards, then alternates
    one forward and one backward, then drains the remaining backwards, so at
    most ``P - s`` microbatches hold activations on it at once.
    """
    _check_sizes(num_stages, num_microbatches, 1)
    return _with_communication(_one_f_one_b_orders(num_stages, num_microbatches), Placement("1f1b", num_stages))


def _one_f_one_b_orders(num_stages: int, num_microbatches: int) -> list[list[Compute]]:
    orders = []
    for rank in range(num_stages):
        warmup = min(num_stages - rank - 1, num_microbatches)
        order = [(FWD, m, 0) for m in range(warmup)]
        for m in range(num_microbatches - warmup):
            order += [(FWD, m + warmup, 0), (BWD, m, 0)]
        order += [(BWD, m, 0) for m in range(num_microbatches - warmup, num_microbatches)]
        orders.append(order)
    return orders


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
    return _with_communication(orders, Placement("interleaved_1f1b", num_stages, num_chunks))


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
    return _with_communication(_zero_bubble_h1_orders(num_stages, num_microbatches), Placement("zb_h1", num_stages))


def _zero_bubble_h1_orders(num_stages: int, num_microbatches: int) -> list[list[Compute]]:
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


def zb_v(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-V: two chunks per rank in a V, backwards split into B and W, for
    any number of microbatches; the order and its bubble and memory are in
    :mod:`hetpipe.pipeline.schedule_zbv`."""
    _check_sizes(num_stages, num_microbatches, 1)
    return _with_communication(v_orders(num_stages, num_microbatches), Placement("zb_v", num_stages, 2))


def forward_only(num_stages: int, num_microbatches: int, num_chunks: int = 1,
                 schedule: str = "1f1b") -> list[list[Action]]:
    """Validation under ``schedule``'s placement: every rank receives, forwards
    and sends each microbatch; no backward.

    Each rank runs the forwards in the order its training schedule does
    (microbatch order; interleaved units for several chunks; ZB-V's forwards
    for a V), so every pair of ranks carries its messages in the order the
    receiver consumes them, and a rank only ever waits for an earlier virtual
    stage: no deadlock, and nothing is kept once it has been sent on (in a V,
    rank P-1's chunk-0 output until its chunk-1 forward, the next one).
    """
    _check_sizes(num_stages, num_microbatches, num_chunks)
    if schedule == "zb_v":
        check_chunks(schedule, num_chunks)
        orders = [[unit for unit in order if unit[0] == FWD] for order in v_orders(num_stages, num_microbatches)]
        return _with_communication(orders, Placement(schedule, num_stages, 2))
    if num_chunks > 1:
        _check_groups("forward_only with several chunks", num_stages, num_microbatches)
    order = [_interleaved_unit(k, FWD, num_stages, num_chunks) for k in range(num_microbatches * num_chunks)]
    return _with_communication([order] * num_stages, Placement(schedule, num_stages, num_chunks))


def build_schedule(
    name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> list[list[Action]]:
    """The schedule called ``name`` (one of :data:`SCHEDULES`)."""
    if name == "interleaved_1f1b":
        return interleaved_one_f_one_b(num_stages, num_microbatches, num_chunks)
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name == "zb_v":
        check_chunks(name, num_chunks)
        return zb_v(num_stages, num_microbatches)
    if num_chunks != 1:
        raise ConfigError(f"schedule {name!r} runs one chunk per rank, got num_chunks={num_chunks}; "
                          "use interleaved_1f1b for several")
    if name == "gpipe":
        return gpipe(num_stages, num_microbatches)
    if name == "zb_h1":
        return zero_bubble_h1(num_stages, num_microbatches)
    return one_f_one_b(num_stages, num_microbatches)


def compute_orders(name: str, num_stages: int, num_microbatches: int,
                   num_chunks: int = 1) -> list[list[Compute]]:
    """Each rank's computations under the schedule ``name``, in the order
    :func:`build_schedule` lists them, without its sends and receives (each
    send follows the computation that produced it: :func:`output_stage` and
    :func:`input_stage` on another rank say which do). What the planner's
    memory model walks (hetpipe/partitioner/schedule_model.py), cheaply."""
    _check_sizes(num_stages, num_microbatches, num_chunks)
    makers = {"gpipe": _gpipe_orders, "1f1b": _one_f_one_b_orders, "zb_h1": _zero_bubble_h1_orders,
              "zb_v": v_orders}
    if name in makers and num_chunks == (2 if name == "zb_v" else 1):
        return makers[name](num_stages, num_microbatches)
    return [[(a.kind, a.microbatch, a.chunk) for a in actions if a.peer is None]
            for actions in build_schedule(name, num_stages, num_microbatches, num_chunks)]


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


def _with_communication(orders: list[list[Compute]], placement: Placement) -> list[list[Action]]:
    """Add sends and receives to each rank's computation order.

    A send goes right after the computation that produced it, and a receive
    right before the one that consumes it, unless FIFO matching needs it
    earlier. The transport matches messages FIFO per (sender, receiver) pair,
    so each receiver must post a pair's receives in the order they were sent.
    With P >= 3 and one chunk a pair carries one direction only and both ends
    walk microbatches in the same order. With P == 2 and interleaving, rank 0
    sends rank 1 both activations (chunk c) and gradients (chunk c + 1);
    Megatron's warm-up, two forwards longer per rank, is what makes rank 1
    need them in exactly the order rank 0 produces them. Under the V
    placement every pair carries activations of one chunk and gradients of
    the other, and zb_v's ranks consume them in another order than their
    neighbour produces them: such a receive moves up to just before the
    pair's next receive (:func:`_in_send_order`). That never waits longer
    than the next receive would have, so it adds no deadlock, and it keeps
    every existing schedule's lists as they were.
    :func:`hetpipe.pipeline.schedule_check.simulate` checks all of it.
    """
    actions = []
    for rank, order in enumerate(orders):
        listed: list[Action] = []
        for kind, mb, chunk in order:
            stage = placement.stage(rank, chunk)
            if kind == BWD_WEIGHT:  # local work: nothing to receive or send
                listed.append(Action(kind, mb, chunk))
                continue
            source = input_stage(kind, stage, placement.num_stages - 1)
            if source is not None and placement.rank_of(source) != rank:
                listed.append(Action(RECV_FWD if kind == FWD else RECV_BWD, mb, chunk, placement.rank_of(source)))
            listed.append(Action(kind, mb, chunk))
            target = output_stage(kind, stage, placement.num_stages - 1)
            if target is not None and placement.rank_of(target) != rank:
                listed.append(Action(SEND_FWD if kind == FWD else SEND_BWD, mb, chunk, placement.rank_of(target)))
        actions.append(listed)
    return [_in_send_order(rank, listed, actions, placement) for rank, listed in enumerate(actions)]


def _in_send_order(rank: int, listed: list[Action], everyone: list[list[Action]],
                   placement: Placement) -> list[Action]:
    """``listed`` with each receive moved up, where needed, to just before the
    next receive from the same peer in that peer's send order."""
    last = placement.num_stages - 1

    def message(owner: int, action: Action) -> tuple[str, int, int]:
        """(direction, microbatch, sender's virtual stage): what a send or receive
        in rank ``owner``'s list carries."""
        direction = FWD if action.kind in (SEND_FWD, RECV_FWD) else BWD
        stage = placement.stage(owner, action.chunk)
        return direction, action.microbatch, stage if action.kind.startswith("send_") else \
            input_stage(direction, stage, last)

    body: list[Action] = []
    before: dict[Action, int] = {}  # receive -> index in body of the action it precedes
    for action in listed:
        if action.kind.startswith("recv_"):
            before[action] = len(body)
        else:
            body.append(action)
    moved: dict[Action, int] = {}  # moved receive -> its place in the pair's messages
    for peer in sorted({a.peer for a in before}):
        mine = {message(rank, a): a for a in before if a.peer == peer}
        pair = [mine[message(peer, a)] for a in everyone[peer] if a.kind.startswith("send_") and a.peer == rank]
        nxt = len(body)
        for index in range(len(pair) - 1, -1, -1):
            if nxt < before[pair[index]]:
                before[pair[index]], moved[pair[index]] = nxt, index
            nxt = before[pair[index]]
    due: dict[int, list[Action]] = {}
    for recv in sorted(before, key=lambda r: (r not in moved, moved.get(r, 0))):  # moved first, in pair order
        due.setdefault(before[recv], []).append(recv)
    return [a for index, action in enumerate(body) for a in due.get(index, []) + [action]]
