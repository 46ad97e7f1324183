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

Each schedule is an entry of :mod:`hetpipe.pipeline.registry`: its order of
computations (:mod:`hetpipe.pipeline.orders`) and its placement; this module
adds the messages. Which virtual stage a (rank, chunk) holds is
:mod:`hetpipe.pipeline.placement`'s answer: Megatron's interleaving (chunk ``c`` on rank ``r`` is stage
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
    BWD_WEIGHT,
    FWD,
    RECV_BWD,
    RECV_FWD,
    SEND_BWD,
    SEND_FWD,
    Action,
    Compute,
)
from hetpipe.pipeline.orders import check_sizes
from hetpipe.pipeline.placement import Placement
from hetpipe.pipeline.registry import GPIPE, INTERLEAVED_1F1B, ONE_F_ONE_B, ZB_H1, ZB_V, schedule_spec


def build_schedule(
    name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> list[list[Action]]:
    """The schedule called ``name`` (an entry of :data:`hetpipe.pipeline.registry.SCHEDULES`):
    its entry's computations with the sends and receives its placement implies."""
    orders = schedule_spec(name).computations(num_stages, num_microbatches, num_chunks)
    return _with_communication(orders, Placement(name, num_stages, num_chunks))


def gpipe(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """GPipe (:func:`hetpipe.pipeline.orders.gpipe_orders`)."""
    return build_schedule(GPIPE.name, num_stages, num_microbatches)


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """1F1B (:func:`hetpipe.pipeline.orders.one_f_one_b_orders`)."""
    return build_schedule(ONE_F_ONE_B.name, num_stages, num_microbatches)


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int, num_chunks: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B (:func:`hetpipe.pipeline.orders.interleaved_orders`)."""
    return build_schedule(INTERLEAVED_1F1B.name, num_stages, num_microbatches, num_chunks)


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-H1 (:func:`hetpipe.pipeline.orders.zero_bubble_h1_orders`)."""
    return build_schedule(ZB_H1.name, num_stages, num_microbatches)


def zb_v(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-V: two chunks per rank in a V, backwards split into B and W, for
    any number of microbatches; the order and its bubble and memory are in
    :mod:`hetpipe.pipeline.schedule_zbv`."""
    return build_schedule(ZB_V.name, num_stages, num_microbatches, 2)


def forward_only(num_stages: int, num_microbatches: int, num_chunks: int = 1,
                 schedule: str = ONE_F_ONE_B.name) -> list[list[Action]]:
    """Validation under ``schedule``'s placement: every rank receives, forwards
    and sends each microbatch; no backward.

    Each rank runs the forwards in the order its training schedule does
    (microbatch order; interleaved units for several chunks; ZB-V's forwards
    for a V: the entry's ``forwards``), so every pair of ranks carries its
    messages in the order the receiver consumes them, and a rank only ever
    waits for an earlier virtual stage: no deadlock, and nothing is kept once
    it has been sent on.
    """
    orders = schedule_spec(schedule).forward_computations(num_stages, num_microbatches, num_chunks)
    return _with_communication(orders, Placement(schedule, num_stages, num_chunks))


def compute_orders(name: str, num_stages: int, num_microbatches: int,
                   num_chunks: int = 1) -> list[list[Compute]]:
    """Each rank's computations under the schedule ``name``, in the order
    :func:`build_schedule` lists them, without its sends and receives (each
    send follows the computation that produced it: :func:`output_stage` and
    :func:`input_stage` on another rank say which do). What the planner's
    memory model walks (hetpipe/partitioner/schedule_model.py), cheaply."""
    check_sizes(num_stages, num_microbatches, num_chunks)
    spec = schedule_spec(name)
    if spec.chunks == num_chunks:  # the entry's own order, no lists to build
        return spec.orders(num_stages, num_microbatches, num_chunks)
    return [[(a.kind, a.microbatch, a.chunk) for a in actions if a.peer is None]
            for actions in build_schedule(name, num_stages, num_microbatches, num_chunks)]


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
