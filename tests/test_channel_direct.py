"""The device-direct channel's control plane between real processes, moving bytes through shared memory.

The pytest process plays stage 0 and a spawned process stage 1 (or a rogue
client that only knows the handshake). The shm mover is the CI data plane.
The GPU IPC mover runs only where a GPU is visible (``-k gpu``; two processes
on one GPU are enough) and is skipped in CI. Every wait is bounded.
"""
from __future__ import annotations

import glob
import os
import socket
import threading
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from channel_harness import (CASES, MISMATCH_ERRORS, NAMES, Ranks, bits_equal, make, receive_wrong_then_right,
                             send_wrong_then_right)
from hetpipe.comm.channel import ChannelError, ChannelTimeout
from hetpipe.pipeline.transports import MOVERS
from hetpipe.comm import direct
from hetpipe.comm.direct import DirectChannel, make_mover
from hetpipe.comm.handshake import CHALLENGE_SIZE, FINAL_SIZE, NONCE_SIZE, PROOF_SIZE, encode_hello, encode_proof
from hetpipe.comm.ipc_mover import IpcShare
from hetpipe.comm.mover import RegionHandle
from hetpipe.comm.rendezvous import lookup_endpoints
from hetpipe.comm.shm_mover import ShmMover

TOKEN = "job-2718-secret"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU IPC mover needs a GPU")


def my_segments() -> list[str]:
    return glob.glob(f"/dev/shm/hetpipe_{os.getpid()}_*")


def channel(rank: int, store, **kw) -> DirectChannel:
    kw.setdefault("deadline", 15.0)
    kw.setdefault("mover", "shm")
    return DirectChannel(rank, [1 - rank], NAMES, store, kw.pop("token", TOKEN), **kw)


# ------------------------------------------------------------- child targets

def echo_cases(rank: int, store) -> tuple[int, list[str]]:
    """Receive every case as fwd, send it back as bwd; report registrations and leftover segments."""
    with channel(rank, store) as ch:
        for i, (dtype, shape) in enumerate(CASES):
            buf = torch.empty(shape, dtype=dtype)
            ch.irecv(buf, 0, microbatch=i, kind="fwd").wait()
            ch.isend(buf, 0, microbatch=i, kind="bwd").wait()
        registrations = ch.mover.registrations
    return registrations, my_segments()


def interleave(rank: int, store, count: int) -> list[int]:
    with channel(rank, store) as ch:
        return _interleave(ch, rank, count)


def _interleave(ch: DirectChannel, rank: int, count: int) -> list[int]:
    """Post ``count`` receives ahead, then ``count`` sends the other way; check every value."""
    out_kind, in_kind = ("fwd", "bwd") if rank == 0 else ("bwd", "fwd")
    size = lambda i: 100 if i % 2 else 5000 + 7 * i  # noqa: E731 - two shapes, interleaved
    bufs = [torch.empty(size(i)) for i in range(count)]
    recvs = [ch.irecv(b, 1 - rank, microbatch=i, kind=in_kind) for i, b in enumerate(bufs)]
    time.sleep(0.1)  # the peer's READYs arrive before our sends are posted
    sends = [ch.isend(torch.full((size(i),), float(i + 1000 * rank)), 1 - rank, microbatch=i, kind=out_kind)
             for i in range(count)]
    for h in recvs + sends:
        h.wait()
    other = 1000 * (1 - rank)
    return [i for i, b in enumerate(bufs) if not torch.equal(b, torch.full_like(b, float(i + other)))]


def send_wrong(rank: int, store) -> list[str]:
    """Stage 1 sends three wrong messages and one right one; reports what its send handles said."""
    with channel(rank, store) as ch:
        return send_wrong_then_right(ch)


def connect_then_idle(rank: int, store, seconds: float) -> str:
    with channel(rank, store) as ch:
        try:
            ch.irecv(torch.empty(1), 0, microbatch=99, kind="fwd").wait(seconds)
        except ChannelError as exc:
            return str(exc)
    return "idle"


def echo_once(rank: int, store) -> bool:
    with channel(rank, store) as ch:
        buf = torch.empty(4, 4)
        ch.irecv(buf, 0, microbatch=0, kind="fwd").wait()
        ch.isend(buf * 2, 0, microbatch=0, kind="bwd").wait()
        return True


def same_shape_many(rank: int, store, count: int) -> int:
    with channel(rank, store) as ch:
        for mb in range(count):
            ch.isend(torch.full((64, 32), float(mb)), 0, microbatch=mb, kind="bwd").wait()
        return ch.mover.registrations


def gpu_of(rank: int) -> torch.device:
    """Each rank's GPU: its own where there are several, else both share GPU 0."""
    return torch.device("cuda", rank % torch.cuda.device_count())


def echo_cases_on_gpu(rank: int, store, repeats: int) -> tuple[str, int]:
    """Receive every case on the GPU as fwd and send it back as bwd, ``repeats`` times."""
    device = gpu_of(rank)
    torch.cuda.set_device(device)
    with channel(rank, store, mover="auto", device=device) as ch:
        for r in range(repeats):
            for i, (dtype, shape) in enumerate(CASES):
                mb = r * len(CASES) + i
                buf = torch.empty(shape, dtype=dtype, device=device)
                ch.irecv(buf, 0, microbatch=mb, kind="fwd").wait()
                ch.isend(buf, 0, microbatch=mb, kind="bwd").wait()
        torch.cuda.synchronize(device)
        return ch.mover.name, ch.mover.registrations


# ------------------------------------------------------------- unit tests

def test_region_handle_is_json_and_rejects_garbage():
    handle = RegionHandle("shm", "seg", 128, b"seg")
    assert RegionHandle.from_bytes(handle.to_bytes()) == handle
    assert handle.to_bytes().startswith(b"{")
    with pytest.raises(ChannelError, match="malformed region handle from stage 1"):
        RegionHandle.from_bytes(b"\x80\x04cos\nsystem\n", sender=NAMES[1])
    with pytest.raises(ChannelError, match="invalid size"):
        RegionHandle.from_bytes(RegionHandle("shm", "seg", -1, b"x").to_bytes())


def test_shm_mover_writes_into_a_registered_region_and_unlinks_on_close():
    owner, writer = ShmMover(), ShmMover()
    buf = owner.allocate(64, torch.device("cpu"))
    handle = RegionHandle.from_bytes(owner.register(buf).to_bytes())
    assert os.path.exists(f"/dev/shm/{handle.key}")
    remote = writer.open_remote(handle)
    assert writer.open_remote(handle) is remote  # cached
    writer.write(torch.arange(8, dtype=torch.int32), remote, 16).wait()
    assert torch.equal(buf[16:48].view(torch.int32), torch.arange(8, dtype=torch.int32))
    with pytest.raises(ChannelError, match="only buffers it allocated"):
        owner.register(torch.empty(8, dtype=torch.uint8))
    with pytest.raises(ChannelError, match="refusing shm segment name"):
        writer.open_remote(RegionHandle("shm", "x", 8, b"../etc/passwd"))
    del buf
    writer.close()
    owner.close()
    owner.close()
    assert not os.path.exists(f"/dev/shm/{handle.key}")


def test_auto_picks_shm_without_a_cuda_device_and_unknown_movers_are_refused():
    mover = make_mover("auto", torch.device("cpu"))
    assert isinstance(mover, ShmMover)
    mover.close()
    with pytest.raises(ChannelError, match="unknown mover 'rdma'"):
        make_mover("rdma", None)


def test_every_mover_a_config_may_name_can_be_built():
    # cluster.transport.mover is checked against MOVERS; a name there without a maker
    # would pass the config check and fail only when the boundary is built.
    assert set(direct._MOVER_MAKERS) == set(MOVERS)


def test_gpu_ipc_description_is_json_and_rejects_garbage():
    share = IpcShare(device=0, handle=b"h" * 64, size=4096, offset=512, ref_counter=b"/torch_123_456_0",
                     ref_counter_offset=3, event=b"e" * 64, event_sync_required=True)
    raw = share.to_bytes()
    assert raw.startswith(b"{") and IpcShare.from_bytes(raw) == share
    no_event = replace(share, event=None, event_sync_required=False)
    assert IpcShare.from_bytes(no_event.to_bytes()) == no_event
    with pytest.raises(ChannelError, match="malformed GPU IPC description from stage 1"):
        IpcShare.from_bytes(b"\x80\x04cos\nsystem\n", sender=NAMES[1])
    for bad in (replace(share, ref_counter=b"../../etc/passwd"), replace(share, size=0),
                replace(share, handle=b""), replace(share, handle=b"h" * 4096)):
        with pytest.raises(ChannelError, match="out of bounds"):
            IpcShare.from_bytes(bad.to_bytes(), sender=NAMES[1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_ipc_mover_without_a_gpu_is_refused_in_one_line():
    with pytest.raises(ChannelError, match="needs a GPU; use mover='shm'"):
        make_mover("ipc", None)


# -------------------------------------------------------- two-process tests

@needs_gpu
@pytest.mark.timeout(90)
def test_gpu_round_trip_through_ipc_is_bit_exact_and_reuses_regions():
    device = gpu_of(0)
    torch.cuda.set_device(device)
    repeats = 3
    with Ranks(echo_cases_on_gpu, [1], repeats, timeout=60.0) as ranks:
        with channel(0, ranks.store, mover="auto", device=device) as ch:
            assert ch.mover.name == ("ipc-hip" if torch.version.hip else "ipc-cuda")
            for r in range(repeats):
                for i, (dtype, shape) in enumerate(CASES):
                    mb = r * len(CASES) + i
                    sent = make(dtype, shape, seed=mb).to(device)
                    back = torch.full(shape, 7, dtype=dtype, device=device)
                    send = ch.isend(sent, 1, microbatch=mb, kind="fwd")
                    recv = ch.irecv(back, 1, microbatch=mb, kind="bwd")
                    send.wait()
                    recv.wait()
                    assert bits_equal(sent.cpu(), back.cpu()), f"{dtype} {shape} came back different"
            registrations = ch.mover.registrations
        name, peer_registrations = ranks.results()[1]
    sizes = {torch.empty(shape, dtype=dtype).numel() * dtype.itemsize for dtype, shape in CASES}
    sizes.discard(0)
    assert name == ch.mover.name
    # One region per message size, registered once and reused in every repeat.
    assert registrations == peer_registrations == len(sizes)


@pytest.mark.timeout(40)
def test_round_trip_is_bit_exact_and_segments_are_unlinked():
    with Ranks(echo_cases, [1]) as ranks:
        with channel(0, ranks.store) as ch:
            for i, (dtype, shape) in enumerate(CASES):
                sent = make(dtype, shape, seed=i)
                back = torch.full(shape, 7, dtype=dtype) if sent.numel() else torch.empty(shape, dtype=dtype)
                send = ch.isend(sent, 1, microbatch=i, kind="fwd")
                recv = ch.irecv(back, 1, microbatch=i, kind="bwd")
                send.wait()
                recv.wait()
                assert send.done() and recv.done()
                assert bits_equal(sent, back), f"{dtype} {shape} came back different"
            assert my_segments()
        assert my_segments() == []
        registrations, leftover = ranks.results()[1]
    assert registrations == sum(1 for dtype, shape in CASES if torch.empty(shape).numel())
    assert leftover == []


@pytest.mark.timeout(40)
def test_receives_posted_ahead_keep_fifo_matching_both_directions():
    with Ranks(interleave, [1], 24) as ranks:
        with channel(0, ranks.store) as ch:
            assert _interleave(ch, 0, 24) == []
        assert ranks.results()[1] == []


@pytest.mark.timeout(30)
def test_repeated_receives_of_one_shape_reuse_one_registered_region():
    with Ranks(same_shape_many, [1], 10) as ranks:
        with channel(0, ranks.store) as ch:
            for mb in range(10):
                buf = torch.empty(64, 32)
                ch.irecv(buf, 1, microbatch=mb, kind="bwd").wait()
                assert torch.equal(buf, torch.full((64, 32), float(mb)))
            assert ch.mover.registrations == 1
        assert ranks.results()[1] == 0  # the sender registers nothing


@pytest.mark.timeout(30)
def test_header_mismatch_fails_both_sides_naming_both_stages():
    with Ranks(send_wrong, [1]) as ranks:
        with channel(0, ranks.store) as ch:
            errors = receive_wrong_then_right(ch)
        sender = ranks.results()[1]
    expected = MISMATCH_ERRORS
    assert errors == expected  # the receiver's pending handles failed with the sender's words
    assert sender == expected + ["sent"]  # the sender detected it


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
            with pytest.raises(ChannelError, match="stage 1 .* lost"):
                ch.isend(torch.ones(3), 1, microbatch=1, kind="fwd").wait(1.0)


@pytest.mark.timeout(30)
def test_silent_peer_times_out_at_the_deadline_and_close_is_prompt():
    before = {t.ident for t in threading.enumerate()}
    with Ranks(connect_then_idle, [1], 15.0) as ranks:
        with channel(0, ranks.store, deadline=1.5) as ch:
            pending = ch.irecv(torch.empty(2, 8), 1, microbatch=4, kind="bwd")
            start = time.monotonic()
            with pytest.raises(ChannelTimeout) as info:
                pending.wait()
            assert 1.4 <= time.monotonic() - start < 2.5
            assert str(info.value) == ("stage 0 (group nvidia, rank 0) timed out after 1.5 s waiting to receive "
                                       "bwd microbatch 4 float32[2, 8] from stage 1 (group amd, rank 1)")
            start = time.monotonic()
            ch.close()
            ch.close()  # idempotent
            assert time.monotonic() - start < 2.5
            with pytest.raises(ChannelError, match="closed"):
                pending.wait(0.1)
            with pytest.raises(ChannelError, match="closed"):
                ch.isend(torch.ones(1), 1, microbatch=0, kind="fwd")
        assert "connection to stage 0 (group nvidia, rank 0) lost" in ranks.results()[1]
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("hetpipe-")]
    assert left == []
    assert my_segments() == []


@pytest.mark.timeout(40)
def test_wrong_token_is_refused_while_the_real_peer_still_connects():
    with Ranks(echo_once, [1]) as ranks:
        prefixed = dist.PrefixStore("hetpipe/direct", ranks.store)
        _, endpoints = lookup_endpoints(prefixed, 1, 10.0)
        half_open = socket.create_connection(endpoints[0], timeout=5.0)  # says nothing
        rogue = socket.create_connection(endpoints[0], timeout=5.0)
        rogue.sendall(encode_hello(0, 1, 0, 1, bytes(NONCE_SIZE)))
        try:
            assert len(rogue.recv(CHALLENGE_SIZE, socket.MSG_WAITALL)) == CHALLENGE_SIZE
            rogue.sendall(encode_proof(bytes(PROOF_SIZE)))  # a guess: it does not hold the secret
            reply = rogue.recv(FINAL_SIZE, socket.MSG_WAITALL)
            assert reply[:4] == b"HPCH" and reply[4] != 0, "a wrong proof was accepted"
            with pytest.raises(ChannelError, match="did not prove the job secret"):
                channel(0, ranks.store, token="also-wrong", deadline=5.0)
            with channel(0, ranks.store) as ch:
                back = torch.empty(4, 4)
                ch.isend(torch.arange(16.0).reshape(4, 4), 1, microbatch=0, kind="fwd").wait()
                ch.irecv(back, 1, microbatch=0, kind="bwd").wait()
                assert torch.equal(back, 2 * torch.arange(16.0).reshape(4, 4))
            assert ranks.results()[1] is True
        finally:
            half_open.close()
            rogue.close()


def test_a_region_from_another_mover_or_runtime_is_refused_by_name():
    mover = ShmMover()
    try:
        with pytest.raises(ChannelError, match="registered a 'ipc-hip' region .* configure the same mover"):
            mover.open_remote(RegionHandle("ipc-hip", "k", 16, b"x" * 64), sender="stage 1")
        # Two IPC movers of different runtimes (an NVIDIA and an AMD rank on one
        # host) cannot map each other's memory: the error says what to use.
        mover.name = "ipc-cuda"
        with pytest.raises(ChannelError, match="CUDA IPC and HIP IPC cannot map .*cluster.transport.kind=tcp"):
            mover.open_remote(RegionHandle("ipc-hip", "k", 16, b"x" * 64), sender="stage 1")
    finally:
        mover.close()
