"""The TCP boundary channel between real processes on 127.0.0.1, and the frame header it carries.

The pytest process plays stage 0 (a real TcpChannel, or a rogue peer written
with a raw socket and the channel's own header encoder); a spawned process
plays stage 1. Every wait is bounded; the whole file stays under a minute.
GPU tensors (pinned-host staging) run only where a GPU is visible (``-k gpu``).
"""
from __future__ import annotations

import socket
import struct
import time

import pytest
import torch

from channel_harness import NAMES, Ranks, bits_equal, make
from conftest import REPO, run_cli
from hetpipe.comm.channel import (
    HEADER_SIZE,
    ChannelError,
    ChannelTimeout,
    CompletionHandle,
    FrameHeader,
    check_header,
    decode_header,
    encode_header,
    header_for,
)
from hetpipe.comm.handshake import introduce
from hetpipe.comm.rendezvous import lookup_endpoints
from hetpipe.comm.tcp import TcpChannel
from hetpipe.comm.tcp_links import MIN_PIECE_BYTES, split_pieces

TOKEN = "job-3141-secret"
LOOPBACKS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned-host staging needs a GPU")

# (dtype, shape) pairs every round trip carries; the last one is 16 MiB.
CASES = [
    (torch.float32, (2, 64, 128)),
    (torch.bfloat16, (3, 5, 7)),
    (torch.int64, (1000,)),
    (torch.float16, (0,)),
    (torch.float32, (0, 4, 4)),
    (torch.float64, ()),
    (torch.uint8, (17,)),
    (torch.bool, (9, 2)),
    (torch.float32, (4 * 1024 * 1024,)),
]


def channel(rank: int, store, peers: list[int] | None = None, **kw) -> TcpChannel:
    kw.setdefault("deadline", 15.0)
    return TcpChannel(rank, [1 - rank] if peers is None else peers, NAMES, store, kw.pop("token", TOKEN), **kw)


# ------------------------------------------------------------- child targets

def echo_cases(rank: int, store, addresses: list[str], streams: int) -> int:
    """Receive every case as fwd and send it straight back as bwd."""
    with channel(rank, store, addresses=addresses, streams_per_address=streams) as ch:
        for i, (dtype, shape) in enumerate(CASES):
            buf = torch.empty(shape, dtype=dtype)
            ch.irecv(buf, 0, microbatch=i, kind="fwd").wait()
            ch.isend(buf, 0, microbatch=i, kind="bwd").wait()
        return ch.nstreams


def echo_cases_on_gpu(rank: int, store) -> bool:
    """echo_cases with the tensors on the GPU, striped over two connections."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    with channel(rank, store, addresses=LOOPBACKS[:2], device=device) as ch:
        for i, (dtype, shape) in enumerate(CASES):
            buf = torch.empty(shape, dtype=dtype, device=device)
            ch.irecv(buf, 0, microbatch=i, kind="fwd").wait()
            ch.isend(buf, 0, microbatch=i, kind="bwd").wait()
        torch.cuda.synchronize(device)
        return True


def interleave(rank: int, store, count: int) -> list[int]:
    """Send ``count`` bwd messages while receiving ``count`` fwd ones, all posted up front."""
    with channel(rank, store, addresses=LOOPBACKS) as ch:
        return _interleave(ch, rank, count)


def _interleave(ch: TcpChannel, rank: int, count: int) -> list[int]:
    out_kind, in_kind = ("fwd", "bwd") if rank == 0 else ("bwd", "fwd")
    size = lambda i: 100 if i % 2 else 3 * MIN_PIECE_BYTES // 4 + 7 * i  # noqa: E731 - 1 piece or 3
    sends = [ch.isend(torch.full((size(i),), float(i + 1000 * rank)), 1 - rank, microbatch=i, kind=out_kind)
             for i in range(count)]
    # Let the peer's messages arrive before the receives are posted: the
    # receiver must hold them in the socket, then match them in order.
    time.sleep(0.2)
    bufs = [torch.empty(size(i)) for i in range(count)]
    recvs = [ch.irecv(b, 1 - rank, microbatch=i, kind=in_kind) for i, b in enumerate(bufs)]
    for h in recvs + sends:
        h.wait()
    other = 1000 * (1 - rank)
    return [i for i, b in enumerate(bufs) if not torch.equal(b, torch.full_like(b, float(i + other)))]


def expect_mismatches(rank: int, store) -> tuple[list[str], bool]:
    """Four irecvs of float32[2, 64, 128]; the rogue peer answers three of them wrongly."""
    errors = []
    with channel(rank, store) as ch:
        for mb in (3, 4, 5):
            try:
                ch.irecv(torch.empty(2, 64, 128), 0, microbatch=mb, kind="fwd").wait()
                errors.append("no error")
            except ChannelError as exc:
                errors.append(str(exc))
        last = torch.empty(2, 64, 128)
        ch.irecv(last, 0, microbatch=7, kind="fwd").wait()
        return errors, torch.equal(last, make(torch.float32, (2, 64, 128), 7))


def expect_truncation(rank: int, store) -> list[str]:
    with channel(rank, store) as ch:
        first = ch.irecv(torch.empty(1024), 0, microbatch=0, kind="fwd")
        second = ch.irecv(torch.empty(8), 0, microbatch=1, kind="fwd")
        out = []
        for handle in (first, second):
            try:
                handle.wait(10.0)
                out.append("no error")
            except ChannelError as exc:
                out.append(f"{type(exc).__name__}: {exc}")
        return out


def connect_then_idle(rank: int, store, seconds: float) -> str:
    """Connect, never send, and leave once the peer goes away (or after ``seconds``)."""
    with channel(rank, store) as ch:
        try:
            ch.irecv(torch.empty(1), 0, microbatch=99, kind="fwd").wait(seconds)
        except ChannelError as exc:
            return str(exc)
    return "idle"


def close_one_link_then_idle(rank: int, store, seconds: float) -> str:
    """Two links; after one message each way, shut this side of the first link and leave
    the second open and silent for ``seconds`` (a process behind a dead NIC: its other
    link's close never arrives); with ``seconds`` 0, close the channel (every link)."""
    with channel(rank, store, addresses=LOOPBACKS[:2], deadline=2.0) as ch:
        buf = torch.empty(3)
        ch.irecv(buf, 0, microbatch=0, kind="fwd").wait()
        ch.isend(buf, 0, microbatch=0, kind="bwd").wait()
        if seconds:
            ch._peers[0].links[0].sock.shutdown(socket.SHUT_WR)
            time.sleep(seconds)
    return "idle"


def _report_after_exchange(seconds: float) -> tuple[list, float]:
    """Stage 0's side of close_one_link_then_idle: the failures its channel reported
    within 3.5 s of the exchange, and when the first came."""
    reported = []
    with Ranks(close_one_link_then_idle, [1], seconds) as ranks:
        with channel(0, ranks.store, addresses=LOOPBACKS[:2], deadline=2.0) as ch:
            ch.notify_failures(reported.append)
            back = torch.empty(3)
            ch.isend(torch.arange(3.0), 1, microbatch=0, kind="fwd").wait()
            ch.irecv(back, 1, microbatch=0, kind="bwd").wait()
            exchanged = time.monotonic()
            while not reported and time.monotonic() < exchanged + 3.5:
                time.sleep(0.05)
            took = time.monotonic() - exchanged
        assert ranks.results()[1] == "idle"
    return reported, took


def chain_end(rank: int, store, count: int) -> list[float]:
    """Stage 0 sends fwd to stage 1 and collects bwd; stage 2 turns each fwd into a bwd."""
    with channel(rank, store, peers=[1], addresses=LOOPBACKS[:2]) as ch:
        out = []
        for mb in range(count):
            buf = torch.empty(3)
            if rank == 0:
                ch.isend(torch.full((3,), float(mb)), 1, microbatch=mb, kind="fwd").wait()
                ch.irecv(buf, 1, microbatch=mb, kind="bwd").wait()
            else:
                ch.irecv(buf, 1, microbatch=mb, kind="fwd").wait()
                ch.isend(buf * 10, 1, microbatch=mb, kind="bwd").wait()
            out.append(buf[0].item())
        return out


def echo_once(rank: int, store) -> bool:
    with channel(rank, store) as ch:
        buf = torch.empty(4, 4)
        ch.irecv(buf, 0, microbatch=0, kind="fwd").wait()
        ch.isend(buf * 2, 0, microbatch=0, kind="bwd").wait()
        return True


# -------------------------------------------------------------- rogue peer

def rogue_connect(store, token: str = TOKEN) -> socket.socket:
    """Connect to stage 1 as 'stage 0' with a raw socket that knows the secret and writes frames by hand."""
    _, endpoints = lookup_endpoints(store, 1, 10.0)
    sock = socket.create_connection(endpoints[0], timeout=10.0)
    introduce(sock, rank=0, peer=1, stream=0, nstreams=1, secret=token.encode(), until=time.monotonic() + 10.0,
              own_name=NAMES[0], peer_name=NAMES[1])
    return sock


def frame(tensor: torch.Tensor, *, seq: int, microbatch: int, kind: str = "fwd") -> bytes:
    header = header_for(tensor, seq=seq, microbatch=microbatch, kind=kind)
    return encode_header(header) + tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# ------------------------------------------------------------ header tests

def test_header_round_trips_every_field_and_rejects_foreign_frames():
    header = FrameHeader(seq=12, microbatch=3, kind="bwd", dtype=torch.bfloat16, shape=(2, 64, 128),
                         nbytes=2 * 64 * 128 * 2, offset=4096, length=8192, npieces=3)
    wire = encode_header(header)
    assert len(wire) == HEADER_SIZE and wire[:4] == b"HPCH"
    assert decode_header(wire) == header
    zero = header_for(torch.empty(0, 5), seq=0, microbatch=0, kind="fwd")
    assert decode_header(encode_header(zero)) == zero and zero.nbytes == 0
    with pytest.raises(ChannelError, match="magic"):
        decode_header(b"HTTP" + wire[4:], sender=NAMES[0])
    with pytest.raises(ChannelError, match="protocol version 2"):
        decode_header(wire[:4] + struct.pack("<H", 2) + wire[6:], sender=NAMES[0])
    with pytest.raises(ChannelError, match="at most 8 dimensions"):
        header_for(torch.empty([1] * 9), seq=0, microbatch=0, kind="fwd")
    with pytest.raises(ChannelError, match="kind"):
        header_for(torch.empty(1), seq=0, microbatch=0, kind="sideways")


def test_check_header_names_both_stages_and_both_messages():
    expected = header_for(torch.empty(2, 64, 128), seq=5, microbatch=3, kind="fwd")
    received = header_for(torch.empty(2, 64, 129), seq=5, microbatch=3, kind="fwd")
    with pytest.raises(ChannelError) as info:
        check_header(received, expected, receiver=NAMES[1], sender=NAMES[0])
    assert str(info.value) == ("stage 1 (group amd, rank 1) expected fwd microbatch 3 float32[2, 64, 128] "
                               "from stage 0 (group nvidia, rank 0), received fwd microbatch 3 float32[2, 64, 129]")
    with pytest.raises(ChannelError, match="out of order"):
        check_header(header_for(torch.empty(2, 64, 128), seq=6, microbatch=3, kind="fwd"), expected,
                     receiver=NAMES[1], sender=NAMES[0])


def test_pieces_cover_the_message_and_small_messages_use_one():
    assert split_pieces(0, 4) == [(0, 0)]
    assert split_pieces(1000, 4) == [(0, 1000)]
    pieces = split_pieces(16 * 1024 * 1024 + 3, 3)
    assert len(pieces) == 3 and pieces[0][0] == 0
    assert all(a + la == b for (a, la), (b, _) in zip(pieces, pieces[1:]))
    assert sum(length for _, length in pieces) == 16 * 1024 * 1024 + 3


def test_handle_deadline_names_owner_and_message():
    handle = CompletionHandle(owner=NAMES[1], action=f"receive fwd microbatch 0 float32[4] from {NAMES[0]}",
                              deadline=0.2)
    start = time.monotonic()
    with pytest.raises(ChannelTimeout, match=r"stage 1 .* timed out after 0.2 s waiting to receive fwd "
                                             r"microbatch 0 float32\[4\] from stage 0"):
        handle.wait()
    assert time.monotonic() - start < 1.0


# -------------------------------------------------------- two-process tests

@pytest.mark.timeout(40)
@pytest.mark.parametrize("addresses,streams", [(["127.0.0.1"], 1), (LOOPBACKS, 1), (LOOPBACKS[:2], 2)],
                         ids=["1-stream", "3-addresses", "2-addresses-x2"])
def test_round_trip_is_bit_exact(addresses, streams):
    with Ranks(echo_cases, [1], addresses, streams) as ranks:
        with channel(0, ranks.store, addresses=addresses, streams_per_address=streams) as ch:
            for i, (dtype, shape) in enumerate(CASES):
                sent = make(dtype, shape, seed=i)
                back = torch.full(shape, 7, dtype=dtype) if sent.numel() else torch.empty(shape, dtype=dtype)
                send = ch.isend(sent, 1, microbatch=i, kind="fwd")
                recv = ch.irecv(back, 1, microbatch=i, kind="bwd")
                send.wait()
                recv.wait()
                assert send.done() and recv.done()
                assert bits_equal(sent, back), f"{dtype} {shape} came back different"
        assert ranks.results()[1] == len(addresses) * streams


@needs_gpu
@pytest.mark.timeout(60)
def test_gpu_round_trip_through_pinned_staging_is_bit_exact():
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with Ranks(echo_cases_on_gpu, [1], timeout=45.0) as ranks:
        with channel(0, ranks.store, addresses=LOOPBACKS[:2], device=device) as ch:
            for i, (dtype, shape) in enumerate(CASES):
                sent = make(dtype, shape, seed=i).to(device)
                back = torch.full(shape, 7, dtype=dtype, device=device)
                send = ch.isend(sent, 1, microbatch=i, kind="fwd")
                recv = ch.irecv(back, 1, microbatch=i, kind="bwd")
                send.wait()
                recv.wait()
                assert bits_equal(sent.cpu(), back.cpu()), f"{dtype} {shape} came back different"
        assert ranks.results()[1] is True


@pytest.mark.timeout(40)
def test_a_waited_transfer_leaves_no_cycle_that_holds_its_tensor():
    """Once a transfer's handle was waited for and dropped, the channel holds no
    reference cycle to its tensor: otherwise every message's device tensor lived
    until Python's cycle collector ran, and at seq 8192 on 2xH100 a tcp4 run held
    1.9-2.9 GiB more than NCCL's at a step's start (docs/benchmarks.md)."""
    import gc
    from hetpipe.comm.tcp import _RecvOp, _SendOp

    nbytes = 4 * 1024 * 1024 * 4
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        with Ranks(echo_cases, [1], ["127.0.0.1"], 2) as ranks:
            with channel(0, ranks.store, addresses=["127.0.0.1"], streams_per_address=2) as ch:
                for i, (dtype, shape) in enumerate(CASES):
                    sent = make(dtype, shape, seed=i)
                    back = torch.empty(shape, dtype=dtype)
                    send = ch.isend(sent, 1, microbatch=i, kind="fwd")
                    recv = ch.irecv(back, 1, microbatch=i, kind="bwd")
                    send.wait()
                    recv.wait()
                    del send, recv, sent, back
                gc.collect()
                held = [o for o in gc.garbage if isinstance(o, (_SendOp, _RecvOp))
                        or (isinstance(o, torch.Tensor) and o.numel() * o.element_size() == nbytes)]
            ranks.results()
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert held == []


@pytest.mark.timeout(40)
def test_interleaved_fwd_and_bwd_keep_fifo_matching():
    with Ranks(interleave, [1], 24) as ranks:
        with channel(0, ranks.store, addresses=LOOPBACKS) as ch:
            assert _interleave(ch, 0, 24) == []
        assert ranks.results()[1] == []


@pytest.mark.timeout(30)
def test_middle_stage_accepts_from_below_and_connects_above():
    with Ranks(chain_end, [0, 2], 5) as ranks:
        with channel(1, ranks.store, peers=[0, 2], addresses=LOOPBACKS[:2]) as ch:
            for mb in range(5):
                act, grad = torch.empty(3), torch.empty(3)
                ch.irecv(act, 0, microbatch=mb, kind="fwd").wait()
                ch.isend(act + 1, 2, microbatch=mb, kind="fwd").wait()
                ch.irecv(grad, 2, microbatch=mb, kind="bwd").wait()
                ch.isend(grad, 0, microbatch=mb, kind="bwd").wait()
        results = ranks.results()
    assert results[0] == [10.0 * (mb + 1) for mb in range(5)]
    assert results[2] == [mb + 1.0 for mb in range(5)]


@pytest.mark.timeout(30)
def test_a_peer_lost_behind_a_dead_link_is_reported_with_nothing_pending():
    """A peer that closed one link and left the other silent is reported to the job's
    watch half the deadline later although no transfer is pending: the ranks may all
    be in a collective over the dead link, whose timeout names nobody
    (tests/test_nic_faults.py)."""
    reported, took = _report_after_exchange(4.0)
    assert [type(e).__name__ for e in reported] == ["PeerLost"], reported
    assert "the peer closed link" in str(reported[0]) and "has carried nothing for" in str(reported[0])
    assert 0.9 <= took <= 2.5, took  # half the 2 s deadline, and the watch's quarter-stall polls


@pytest.mark.timeout(30)
def test_a_peer_that_closes_every_link_with_nothing_pending_is_not_reported():
    """A peer that finished closes all its links at once: no failure to report."""
    reported, took = _report_after_exchange(0.0)
    assert reported == [] and took >= 3.5


@pytest.mark.timeout(30)
def test_header_mismatch_names_both_stages_and_the_stream_recovers():
    with Ranks(expect_mismatches, [1]) as ranks:
        sock = rogue_connect(ranks.store)
        try:
            good = make(torch.float32, (2, 64, 128), 7)
            sock.sendall(frame(torch.ones(2, 64, 129), seq=0, microbatch=3))
            sock.sendall(frame(torch.ones(2, 64, 128, dtype=torch.bfloat16), seq=1, microbatch=4))
            sock.sendall(frame(torch.ones(2, 64, 128), seq=2, microbatch=6))
            sock.sendall(frame(good, seq=3, microbatch=7))
            errors, last_ok = ranks.results()[1]
        finally:
            sock.close()
    prefix = "stage 1 (group amd, rank 1) expected fwd microbatch {} float32[2, 64, 128] from stage 0 (group nvidia, rank 0), received "
    assert errors == [prefix.format(3) + "fwd microbatch 3 float32[2, 64, 129]",
                      prefix.format(4) + "fwd microbatch 4 bfloat16[2, 64, 128]",
                      prefix.format(5) + "fwd microbatch 6 float32[2, 64, 128]"]
    assert last_ok, "the message after three rejected ones did not arrive intact"


@pytest.mark.timeout(30)
def test_truncated_frame_fails_mid_message_and_later_receives_fail_fast():
    with Ranks(expect_truncation, [1]) as ranks:
        sock = rogue_connect(ranks.store)
        header = header_for(torch.empty(1024), seq=0, microbatch=0, kind="fwd")
        sock.sendall(encode_header(header) + bytes(100))
        time.sleep(0.2)
        sock.close()
        first, second = ranks.results()[1]
    assert first.startswith("ChannelError: connection to stage 0 (group nvidia, rank 0) closed mid-message: "
                            "received 100 of 4096 bytes"), first
    assert second == first, "a receive posted behind the broken one must fail with the same cause"


@pytest.mark.timeout(30)
def test_killed_peer_fails_pending_receive_naming_its_stage():
    with Ranks(connect_then_idle, [1], 60.0) as ranks:
        with channel(0, ranks.store) as ch:
            pending = ch.irecv(torch.empty(64), 1, microbatch=0, kind="bwd")
            ranks.procs[1].kill()
            start = time.monotonic()
            with pytest.raises(ChannelError) as info:
                pending.wait(10.0)
            assert time.monotonic() - start < 5.0
            assert not isinstance(info.value, ChannelTimeout)
            assert "connection to stage 1 (group amd, rank 1) lost" in str(info.value)
            # The peer is gone: new transfers fail at once instead of waiting out a deadline.
            with pytest.raises(ChannelError, match="stage 1 .* lost"):
                ch.isend(torch.ones(3), 1, microbatch=1, kind="fwd").wait(1.0)


@pytest.mark.timeout(30)
def test_silent_peer_times_out_at_the_deadline_naming_its_stage():
    with Ranks(connect_then_idle, [1], 15.0) as ranks:
        with channel(0, ranks.store, deadline=1.5) as ch:
            pending = ch.irecv(torch.empty(2, 64, 128), 1, microbatch=4, kind="bwd")
            start = time.monotonic()
            with pytest.raises(ChannelTimeout) as info:
                pending.wait()  # the channel's deadline
            elapsed = time.monotonic() - start
            assert 1.4 <= elapsed < 2.5
            assert str(info.value) == ("stage 0 (group nvidia, rank 0) timed out after 1.5 s waiting to receive "
                                       "bwd microbatch 4 float32[2, 64, 128] from stage 1 (group amd, rank 1)")
            start = time.monotonic()
            with pytest.raises(ChannelTimeout):
                pending.wait(0.3)
            assert time.monotonic() - start < 1.0
            start = time.monotonic()
            ch.close()
            ch.close()  # idempotent
            assert time.monotonic() - start < 2.5
            with pytest.raises(ChannelError, match="closed"):
                pending.wait(0.1)
        # Stage 1 notices the close as a lost connection rather than idling out its wait.
        assert "connection to stage 0 (group nvidia, rank 0) lost" in ranks.results()[1]


@pytest.mark.timeout(40)
def test_wrong_token_is_refused_while_the_real_peer_still_connects():
    with Ranks(echo_once, [1]) as ranks:
        _, endpoints = lookup_endpoints(ranks.store, 1, 10.0)
        half_open = socket.create_connection(endpoints[0], timeout=5.0)  # says nothing at all
        garbage = socket.create_connection(endpoints[0], timeout=5.0)
        garbage.sendall(b"GET / HTTP/1.1\r\nHost: stage1\r\n\r\n" * 4)
        # A version-1 client, which sent the job token in clear.
        clear_text = socket.create_connection(endpoints[0], timeout=5.0)
        clear_text.sendall(struct.pack("<4sHiHHI", b"HPCH", 1, 0, 0, 1, 64) + b"t" * 64)
        try:
            with pytest.raises(ChannelError) as info:
                channel(0, ranks.store, token="not-the-job-token", deadline=5.0)
            assert str(info.value).startswith(
                f"peer at {endpoints[0][0]}:{endpoints[0][1]} claiming to be stage 1 (group amd, rank 1) did not "
                "prove the job secret, so stage 0 (group nvidia, rank 0) refused it")
            with channel(0, ranks.store) as ch:
                back = torch.empty(4, 4)
                ch.isend(torch.arange(16.0).reshape(4, 4), 1, microbatch=0, kind="fwd").wait()
                ch.irecv(back, 1, microbatch=0, kind="bwd").wait()
                assert torch.equal(back, 2 * torch.arange(16.0).reshape(4, 4))
            assert ranks.results()[1] is True
        finally:
            for sock in (half_open, garbage, clear_text):
                sock.close()


@pytest.mark.timeout(60)
def test_bench_quick_cpu_prints_a_table():
    proc = run_cli([str(REPO / "scripts" / "bench_channel.py"), "--quick", "--device", "cpu"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
    header_at = max(i for i, line in enumerate(lines) if line.split()[:4] == ["transport", "streams", "size", "GB/s"])
    rows = [line.split() for line in lines[header_at + 1:] if not set(line) <= {"-", " "}]
    transports = {row[0] for row in rows}
    assert {"tcp", "gloo"} <= transports, proc.stdout
    assert {row[1] for row in rows if row[0] == "tcp"} >= {"1", "4"}
    assert all(float(row[-1]) > 0 for row in rows)
