"""Pipeline schedules: every schedule runs to completion under FIFO matching,
computes each (microbatch, virtual stage) once each way, accumulates gradients
in single-process order, and keeps the memory bound it promises; the simulator
rejects broken schedules with a message that points at the culprit."""
from __future__ import annotations

from collections import Counter

import pytest

from hetpipe.errors import ConfigError
from hetpipe.pipeline.placement import Placement, virtual_stage
from hetpipe.pipeline.schedule_check import ScheduleError, simulate
from hetpipe.pipeline.schedules import (
    Action,
    build_schedule,
    forward_only,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    zb_v,
    zero_bubble_h1,
)

STAGES = range(1, 7)
MICROBATCHES = (1, 2, 3, 5, 8, 13)  # includes M < P for the larger P


def computations_once(schedules: list[list[Action]], num_microbatches: int, num_chunks: int) -> None:
    """Each (microbatch, virtual stage) is forwarded once and backwarded once, read off the lists."""
    num_ranks = len(schedules)
    counts = Counter(
        (a.kind, a.microbatch, a.chunk * num_ranks + rank)
        for rank, actions in enumerate(schedules)
        for a in actions
        if a.kind in ("fwd", "bwd")
    )
    expected = {(kind, mb, v) for kind in ("fwd", "bwd") for mb in range(num_microbatches)
                for v in range(num_ranks * num_chunks)}
    assert set(counts) == expected and set(counts.values()) == {1}


def backwards_in_microbatch_order(schedules: list[list[Action]]) -> None:
    for actions in schedules:
        for chunk in {a.chunk for a in actions}:
            order = [a.microbatch for a in actions if a.kind == "bwd" and a.chunk == chunk]
            assert order == sorted(order)


def receives_precede_their_consumer(schedules: list[list[Action]]) -> None:
    """The engine may pair a receive with the computation right after it."""
    for actions in schedules:
        for recv, nxt in zip(actions, actions[1:]):
            if recv.kind.startswith("recv_"):
                consumers = ("fwd",) if recv.kind == "recv_fwd" else ("bwd", "bwd_input")
                assert nxt.kind in consumers and (nxt.microbatch, nxt.chunk) == (recv.microbatch, recv.chunk)


@pytest.mark.parametrize("P", STAGES)
@pytest.mark.parametrize("M", MICROBATCHES)
def test_gpipe_runs_and_holds_every_microbatch(P, M):
    schedules = gpipe(P, M)
    result = simulate(schedules)
    computations_once(schedules, M, 1)
    backwards_in_microbatch_order(schedules)
    receives_precede_their_consumer(schedules)
    assert result.max_live_activations == [M] * P


@pytest.mark.parametrize("P", STAGES)
@pytest.mark.parametrize("M", MICROBATCHES)
def test_1f1b_runs_and_bounds_live_activations(P, M):
    schedules = one_f_one_b(P, M)
    result = simulate(schedules)
    computations_once(schedules, M, 1)
    backwards_in_microbatch_order(schedules)
    receives_precede_their_consumer(schedules)
    assert result.max_live_activations == [min(P - s, M) for s in range(P)]


@pytest.mark.parametrize("P", STAGES)
@pytest.mark.parametrize("groups", (1, 2, 4))
@pytest.mark.parametrize("C", (2, 3))
def test_interleaved_runs_and_beats_gpipe_memory(P, groups, C):
    M = groups * P
    schedules = interleaved_one_f_one_b(P, M, C)
    result = simulate(schedules, num_chunks=C)
    computations_once(schedules, M, C)
    backwards_in_microbatch_order(schedules)
    # Holds with P == 2 too, where one pair carries both directions: no
    # receive had to be posted early for FIFO matching.
    receives_precede_their_consumer(schedules)
    if M >= 4 * P:
        assert all(live < M for live in result.max_live_activations)
    # Fewer warm-up forwards on later ranks, as in Megatron.
    assert result.max_live_activations == sorted(result.max_live_activations, reverse=True)


def test_interleaved_has_a_smaller_bubble_than_1f1b():
    # Same work per rank (8 layer-units): 1F1B with whole stages vs 2 chunks of half size.
    # Steps count actions, so compare makespan in units of one chunk's compute time.
    P, M = 4, 8
    plain = simulate(one_f_one_b(P, M)).steps
    interleaved = simulate(interleaved_one_f_one_b(P, M, 2), num_chunks=2).steps
    assert interleaved / 2 < plain


def test_single_stage_alternates_forward_and_backward():
    assert [str(a) for a in one_f_one_b(1, 3)[0]] == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert build_schedule("1f1b", 1, 3) == one_f_one_b(1, 3)


def test_single_stage_interleaved_hands_off_chunks_locally():
    (actions,) = interleaved_one_f_one_b(1, 2, 2)
    assert all(a.kind in ("fwd", "bwd") for a in actions)
    simulate([actions], num_chunks=2)


def test_sends_and_receives_name_peer_and_local_chunk():
    rank0, rank1 = interleaved_one_f_one_b(2, 2, 2)
    # Rank 1's chunk 0 (virtual stage 1) feeds rank 0's chunk 1 (virtual stage 2).
    assert Action("send_fwd", 0, chunk=0, peer=0) in rank1
    assert Action("recv_fwd", 0, chunk=1, peer=1) in rank0
    assert str(Action("send_fwd", 3, 1, 1)) == "sendF3c1->1"
    assert str(Action("recv_bwd", 2, 0, 0)) == "recvB2<-0"
    assert str(Action("fwd", 3, 1)) == "F3c1"


def test_deadlock_is_reported_with_each_stuck_action():
    schedules = [
        [Action("recv_bwd", 0, peer=1), Action("fwd", 0), Action("send_fwd", 0, peer=1), Action("bwd", 0)],
        [Action("recv_fwd", 0, peer=0), Action("fwd", 0), Action("bwd", 0), Action("send_bwd", 0, peer=0)],
    ]
    with pytest.raises(ScheduleError, match="deadlock") as err:
        simulate(schedules)
    assert "rank 0 waits at recvB0<-1" in str(err.value)
    assert "rank 1 waits at recvF0<-0" in str(err.value)


def test_receives_in_the_wrong_order_are_named():
    schedules = one_f_one_b(2, 3)
    rank1 = schedules[1]
    first = rank1.index(Action("recv_fwd", 0, peer=0))
    second = rank1.index(Action("recv_fwd", 1, peer=0))
    rank1[first], rank1[second] = rank1[second], rank1[first]
    with pytest.raises(ScheduleError) as err:
        simulate(schedules)
    message = str(err.value)
    assert "rank 1" in message and "rank 0" in message
    assert "F1 from virtual stage 0" in message and "F0 from virtual stage 0" in message


def test_missing_send_is_caught():
    schedules = one_f_one_b(3, 4)
    schedules[1].remove(Action("send_fwd", 3, peer=2))
    with pytest.raises(ScheduleError, match="deadlock.*rank 2 waits at recvF3<-1"):
        simulate(schedules)
    # An earlier one goes missing: the next message arrives in its place.
    schedules = one_f_one_b(3, 4)
    schedules[1].remove(Action("send_fwd", 2, peer=2))
    with pytest.raises(ScheduleError, match="receive for F2 .* is F3"):
        simulate(schedules)


def test_missing_receive_is_caught():
    schedules = gpipe(2, 2)
    schedules[1].remove(Action("recv_fwd", 1, peer=0))
    with pytest.raises(ScheduleError, match="without having received F1 from virtual stage 0"):
        simulate(schedules)


def test_backward_out_of_microbatch_order_is_caught():
    schedules = gpipe(1, 2)
    schedules[0][2:] = [Action("bwd", 1), Action("bwd", 0)]
    with pytest.raises(ScheduleError, match="increasing microbatch order"):
        simulate(schedules)


def test_backward_before_forward_is_caught():
    with pytest.raises(ScheduleError, match="before its forward"):
        simulate([[Action("bwd", 0), Action("fwd", 0)]])


def test_unfinished_microbatch_is_caught():
    schedules = one_f_one_b(1, 2)[0][:-1]
    with pytest.raises(ScheduleError, match="microbatch 1 has no backward"):
        simulate([schedules])


@pytest.mark.parametrize("name", ("gpipe", "1f1b", "interleaved_1f1b"))
def test_build_schedule_dispatches(name):
    chunks = 2 if name == "interleaved_1f1b" else 1
    direct = {"gpipe": gpipe, "1f1b": one_f_one_b}.get(name)
    expected = direct(3, 6) if direct else interleaved_one_f_one_b(3, 6, 2)
    assert build_schedule(name, 3, 6, chunks) == expected


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("zigzag", 2, 4), "zigzag"),
        (("interleaved_1f1b", 4, 6, 2), "num_microbatches \\(6\\)"),
        (("interleaved_1f1b", 2, 4, 1), "num_chunks >= 2"),
        (("1f1b", 2, 4, 2), "num_chunks=2"),
        (("gpipe", 0, 4), "num_stages"),
        (("1f1b", 2, 0), "num_microbatches"),
    ],
)
def test_build_schedule_rejects_bad_parameters(args, needle):
    with pytest.raises(ConfigError, match=needle):
        build_schedule(*args)


@pytest.mark.parametrize("P", range(1, 5))
@pytest.mark.parametrize("M", (1, 2, 3, 4, 8))
@pytest.mark.parametrize("C", (1, 2))
def test_forward_only_runs_every_forward_once_and_keeps_nothing(P, M, C):
    if C > 1 and M % P:
        with pytest.raises(ConfigError, match=f"num_microbatches \\({M}\\)"):
            forward_only(P, M, C)
        return
    schedules = forward_only(P, M, C)
    result = simulate(schedules, num_chunks=C, forward_only=True)
    assert all(a.kind in ("recv_fwd", "fwd", "send_fwd") for actions in schedules for a in actions)
    counts = Counter((a.microbatch, a.chunk * P + rank) for rank, actions in enumerate(schedules)
                     for a in actions if a.kind == "fwd")
    assert set(counts) == {(mb, v) for mb in range(M) for v in range(P * C)} and set(counts.values()) == {1}
    receives_precede_their_consumer(schedules)
    # No graph waits for a backward: one unit's activations at a time.
    assert result.max_live_activations == [1] * P
    # The forwards keep the training schedule's order, so messages match FIFO.
    training = build_schedule("interleaved_1f1b" if C > 1 else "1f1b", P, M, C)
    for fwd_only, train in zip(schedules, training):
        assert [a for a in fwd_only if a.kind == "fwd"] == [a for a in train if a.kind == "fwd"]


def test_forward_only_rejects_backwards_and_missing_forwards():
    with pytest.raises(ScheduleError, match="B0 in a forward-only schedule"):
        simulate(one_f_one_b(1, 1), forward_only=True)
    schedules = forward_only(2, 2)
    schedules[1] = schedules[1][:-2]  # rank 1 never receives nor forwards microbatch 1
    with pytest.raises(ScheduleError, match="rank 0 sent F1 from virtual stage 0 to rank 1, which never"):
        simulate(schedules, forward_only=True)



@pytest.mark.parametrize("P", STAGES)
@pytest.mark.parametrize("M", MICROBATCHES)
def test_zb_h1_keeps_1f1b_memory_with_a_third_of_its_bubble(P, M):
    schedules = zero_bubble_h1(P, M)
    result = simulate(schedules)
    receives_precede_their_consumer(schedules)
    for rank, actions in enumerate(schedules):
        inputs = [a.microbatch for a in actions if a.kind == "bwd_input"]
        weights = [a.microbatch for a in actions if a.kind == "bwd_weight"]
        assert inputs == weights == list(range(M)), rank  # each unit split once; Ws in microbatch order
        assert not any(a.kind == "bwd" for a in actions)
    # Units between F and W never exceed 1F1B's peak (rank 0's min(P, M));
    # rank s keeps up to s + 1 units waiting for their W.
    plain = simulate(one_f_one_b(P, M))
    assert max(result.max_in_flight) == max(plain.max_live_activations)
    assert result.max_held_for_weights == [min(s + 1, M) for s in range(P)]
    # Unit costs F = B = W: 1F1B's bubble is 3(P - 1), ZB-H1's P - 1.
    assert plain.makespan - 3 * M == 3 * (P - 1)
    if M >= P:
        assert result.makespan - 3 * M == P - 1


def test_zb_h1_dispatches_and_refuses_chunks():
    assert build_schedule("zb_h1", 3, 6) == zero_bubble_h1(3, 6)
    assert [str(a) for a in zero_bubble_h1(1, 2)[0]] == ["F0", "Bi0", "W0", "F1", "Bi1", "W1"]
    with pytest.raises(ConfigError, match="num_chunks=2"):
        build_schedule("zb_h1", 2, 4, 2)


def test_weight_backward_before_its_input_backward_is_caught():
    with pytest.raises(ScheduleError, match="W0 runs before its input backward Bi0"):
        simulate([[Action("fwd", 0), Action("bwd_weight", 0), Action("bwd_input", 0)]])
    with pytest.raises(ScheduleError, match="no weight backward \\(W\\) on virtual stage 0"):
        simulate([[Action("fwd", 0), Action("bwd_input", 0)]])
    with pytest.raises(ScheduleError, match="W0 runs twice"):
        simulate([[Action("fwd", 0), Action("bwd_input", 0), Action("bwd_weight", 0), Action("bwd_weight", 0)]])


def test_weights_out_of_microbatch_order_are_caught():
    schedules = zero_bubble_h1(1, 2)
    schedules[0] = [Action("fwd", 0), Action("bwd_input", 0), Action("fwd", 1), Action("bwd_input", 1),
                    Action("bwd_weight", 1), Action("bwd_weight", 0)]
    with pytest.raises(ScheduleError, match="increasing microbatch order"):
        simulate(schedules)


def zb_v_placement(P: int) -> Placement:
    return Placement("zb_v", P, 2)


@pytest.mark.parametrize("P", STAGES)
@pytest.mark.parametrize("M", (1, 2, 3, 5, 8, 13))
def test_zb_v_has_the_least_bubble_and_1f1b_peak_memory(P, M):
    schedules = zb_v(P, M)
    placement = zb_v_placement(P)
    result = simulate(schedules, num_chunks=2, placement=placement)
    stages = Counter((a.kind, a.microbatch, placement.stage(rank, a.chunk))
                     for rank, actions in enumerate(schedules) for a in actions if a.kind in ("fwd", "bwd_input"))
    assert set(stages) == {(kind, mb, v) for kind in ("fwd", "bwd_input") for mb in range(M) for v in range(2 * P)}
    assert set(stages.values()) == {1}
    for rank, actions in enumerate(schedules):
        assert not any(a.kind == "bwd" for a in actions)
        for chunk in (0, 1):  # every unit split once; Ws in microbatch order on each chunk
            assert [a.microbatch for a in actions if a.kind == "bwd_weight" and a.chunk == chunk] == list(range(M))
        # Each receive comes before the computation that consumes it.
        for i, recv in enumerate(actions):
            if recv.kind.startswith("recv_"):
                consumers = ("fwd",) if recv.kind == "recv_fwd" else ("bwd_input",)
                assert any(a.kind in consumers and (a.microbatch, a.chunk) == (recv.microbatch, recv.chunk)
                           for a in actions[i + 1:])
    # The V's turn is local: rank P-1 never messages itself, and one rank messages no one.
    assert not any(a.peer == rank for rank, actions in enumerate(schedules) for a in actions)
    if P == 1:
        assert all(a.peer is None for a in schedules[0])
    # Memory: at most 2 min(P, M) chunk units between F and W, i.e. min(P, M)
    # whole stages - 1F1B's peak, which 1F1B reaches on its first rank only
    # and ZB-V, once it is full (M >= 2P - 1), on every rank.
    one_f = simulate(one_f_one_b(P, M))
    assert max(result.max_in_flight) == 2 * max(one_f.max_live_activations) == 2 * min(P, M)
    zb_h1 = simulate(zero_bubble_h1(P, M))
    if M >= 2 * P - 1:
        assert result.max_in_flight == result.max_live_activations == [2 * P] * P
        # The cool-down runs rank s's last s chunk-1 Bs back to back with
        # chunk 0's: up to 2s + 1 units wait for their W, inside that peak.
        assert result.max_held_for_weights == [2 * s + 1 for s in range(P)]
        # Unit costs per chunk (a rank's work 6M): the bubble is P - 1 chunk
        # forwards, which rank P-1 waits for microbatch 0 anyway, so no
        # schedule has less. In whole-stage units (halve it) against ZB-H1 and 1F1B:
        assert result.makespan == 6 * M + P - 1
        assert (result.makespan - 6 * M) / 2 == (P - 1) / 2
        assert zb_h1.makespan - 3 * M == P - 1 and one_f.makespan - 3 * M == 3 * (P - 1)
        # The FIFO order moves one receive on each rank but rank 0 (see below).
        moved = [sum(1 for recv, nxt in zip(actions, actions[1:]) if recv.kind.startswith("recv_")
                     and (nxt.microbatch, nxt.chunk) != (recv.microbatch, recv.chunk)) for actions in schedules]
        assert moved == [0] + [1] * (P - 1)
    else:  # a partly filled V: more bubble, never more than ZB-H1's
        assert result.makespan / 2 - 3 * M <= zb_h1.makespan - 3 * M


def test_zb_v_order_for_two_ranks():
    rank0, rank1 = zb_v(2, 4)
    assert " ".join(map(str, rank0)) == (
        "F0 sendF0->1 F1 sendF1->1 F2 sendF2->1 "
        "recvF0c1<-1 F0c1 Bi0c1 sendB0c1->1 W0c1 recvF1c1<-1 F1c1 Bi1c1 sendB1c1->1 W1c1 "
        "F3 sendF3->1 recvB0<-1 Bi0 W0 recvF2c1<-1 F2c1 Bi2c1 sendB2c1->1 W2c1 "
        "recvB1<-1 Bi1 W1 recvF3c1<-1 F3c1 Bi3c1 sendB3c1->1 W3c1 "
        "recvB2<-1 Bi2 W2 recvB3<-1 Bi3 W3")
    # Rank 1 turns the V: chunk 0's output feeds its chunk 1 with no message.
    # Its receive of F2 moved before B0c1's: rank 0 sent F2 first.
    assert " ".join(map(str, rank1)) == (
        "recvF0<-0 F0 F0c1 sendF0c1->0 recvF1<-0 F1 F1c1 sendF1c1->0 "
        "recvF2<-0 recvB0c1<-0 Bi0c1 W0c1 F2 Bi0 sendB0->0 W0 F2c1 sendF2c1->0 "
        "recvB1c1<-0 Bi1c1 W1c1 recvF3<-0 F3 Bi1 sendB1->0 W1 F3c1 sendF3c1->0 "
        "recvB2c1<-0 Bi2c1 W2c1 Bi2 sendB2->0 recvB3c1<-0 Bi3c1 Bi3 sendB3->0 W2 W3c1 W3")


def test_zb_v_needs_receives_in_send_order():
    # Put the moved receive back before its own forward: rank 0 sent F2 before
    # B0c1, so rank 1 would find F2 where it expects B0c1.
    rank0, rank1 = zb_v(2, 4)
    recv = rank1.index(Action("recv_fwd", 2, 0, 0))
    moved = rank1.pop(recv)
    rank1.insert(rank1.index(Action("fwd", 2, 0)), moved)
    with pytest.raises(ScheduleError, match="receive for B0 from virtual stage 3 .* is F2 from virtual stage 0"):
        simulate([rank0, rank1], num_chunks=2, placement=zb_v_placement(2))
    # The V's lists are wrong under the interleaved placement: the simulator uses the one it is given.
    with pytest.raises(ScheduleError, match="rank 2: F0c1 runs without having received F0 from virtual stage 4"):
        simulate(zb_v(3, 6), num_chunks=2)


def test_zb_v_dispatches_and_needs_two_chunks():
    assert build_schedule("zb_v", 3, 7, 2) == zb_v(3, 7)
    for chunks in (1, 3):
        with pytest.raises(ConfigError, match=f"exactly two chunks per rank \\(a V\\), got num_chunks={chunks}"):
            build_schedule("zb_v", 3, 6, chunks)
        with pytest.raises(ConfigError, match="exactly two chunks"):
            forward_only(3, 6, chunks, "zb_v")


@pytest.mark.parametrize("P", range(1, 5))
@pytest.mark.parametrize("M", (1, 2, 3, 5, 8))
def test_forward_only_in_a_v_keeps_zb_v_forward_order(P, M):
    schedules = forward_only(P, M, 2, "zb_v")
    result = simulate(schedules, num_chunks=2, forward_only=True, placement=zb_v_placement(P))
    receives_precede_their_consumer(schedules)
    assert result.max_live_activations == [1] * P
    for fwd_only, train in zip(schedules, zb_v(P, M)):
        assert [a for a in fwd_only if a.kind == "fwd"] == [a for a in train if a.kind == "fwd"]


def test_placements_say_which_ranks_exchange_messages():
    assert [virtual_stage("zb_v", r, c, 3) for c in (0, 1) for r in range(3)] == [0, 1, 2, 5, 4, 3]
    assert [virtual_stage("interleaved_1f1b", r, c, 3) for c in (0, 1) for r in range(3)] == [0, 1, 2, 3, 4, 5]
    v = zb_v_placement(3)
    assert v.location(5) == (0, 1) and v.rank_of(3) == 2
    # The V's turn on rank 2 is local: no pair (2, 0) as interleaving's wrap-around has.
    assert v.rank_pairs() == [(0, 1), (1, 0), (1, 2), (2, 1)]
    assert Placement("interleaved_1f1b", 3, 2).rank_pairs() == [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]
    assert Placement("1f1b", 3).neighbours(0) == [1] and v.neighbours(1) == [0, 2]
    assert zb_v_placement(1).rank_pairs() == []
