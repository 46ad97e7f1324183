"""The device-direct channel over Mooncake's transfer engine, between real processes on Mooncake's TCP transport.

The pytest process plays stage 0 and a spawned process stage 1; each runs its
own transfer engine in point-to-point handshake mode (no metadata server) on
127.0.0.1, so the code path is the one two nodes take, with ``protocol='tcp'``
where a cluster gives ``'rdma'``. Every wait is bounded. The end-to-end test
trains the tiny model across the emulated vendor line with
``cluster.transport.mover=mooncake-tcp`` and compares its losses bit for bit
with the tcp channel's. Skipped, with the missing piece named, where the
library (the ``mooncake`` extra) or rdma-core's ``libibverbs1`` is absent:
CI's set-up (scripts/setup_env.sh) installs both.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from channel_harness import CASES, MISMATCH_ERRORS, NAMES, Ranks, bits_equal, make, receive_wrong_then_right
from cluster_nodes import JOB, metrics, start_nodes, wait_all
from conftest import run_pretrain
from emulated_nodes import emulated_nodes, make_emulated_nodes, netns_available  # noqa: F401
from hetpipe.comm.channel import ChannelError
from hetpipe.comm.factory import MoverFacts, choose_mover
from hetpipe.comm.mooncake_mover import MooncakeMover, rdma_devices, unavailable_reason
from hetpipe.comm.mover import RegionHandle
from mooncake_ranks import (BIG, FORGED_SIZE, channel, echo_cases, post_big_receive_then_wait, receive_forged_then_real,
                            send_wrong)

MISSING = unavailable_reason()
needs_mooncake = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


# ------------------------------------------------------------- unit tests

@needs_mooncake
def test_region_descriptions_are_json_and_garbage_is_refused():
    mover = MooncakeMover(deadline=5.0)
    try:
        buf = mover.allocate(64, torch.device("cpu"))
        handle = RegionHandle.from_bytes(mover.register(buf).to_bytes())
        assert handle.mover == "mooncake-tcp" and handle.data.startswith(b"{")
        assert mover.open_remote(handle) is mover.open_remote(handle)  # cached
        for data in (b"\x80\x04cos\nsystem\n", b'{"endpoint": "127.0.0.1:80"}'):
            with pytest.raises(ChannelError, match="malformed mooncake region"):
                mover.open_remote(RegionHandle("mooncake-tcp", f"k{len(data)}", 64, data))
        for data in (b'{"endpoint": "evil host:1", "addr": 4096}', b'{"endpoint": "h:99999", "addr": 4096}',
                     b'{"endpoint": "h:80", "addr": 0}'):
            with pytest.raises(ChannelError, match="out of bounds"):
                mover.open_remote(RegionHandle("mooncake-tcp", f"k{len(data)}", 64, data))
        with pytest.raises(ChannelError, match="registered a 'mooncake-rdma' region .* configure the same mover"):
            mover.open_remote(RegionHandle("mooncake-rdma", "k", 64, handle.data), sender=NAMES[1])
        with pytest.raises(ChannelError, match="only buffers it allocated"):
            mover.register(torch.empty(8, dtype=torch.uint8))
    finally:
        mover.close()
        mover.close()  # idempotent


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ChannelError, match="protocol is 'ib'; expected one of"):
        MooncakeMover(protocol="ib")
    for address in ("0.0.0.0", "::1"):
        with pytest.raises(ChannelError, match="concrete IPv4 address or host name"):
            MooncakeMover(address=address)


@needs_mooncake
@pytest.mark.skipif(bool(rdma_devices()), reason="checks the refusal on a node without RDMA devices")
def test_rdma_without_a_device_is_refused_naming_the_doctor():
    with pytest.raises(ChannelError, match="asked for RDMA but /sys/class/infiniband lists no device.*doctor"):
        MooncakeMover(protocol="rdma")


# -------------------------------------------------------- two-process tests

@needs_mooncake
@pytest.mark.timeout(60)
def test_round_trip_is_bit_exact_and_registers_each_size_once():
    repeats = 2
    with Ranks(echo_cases, [1], repeats, timeout=45.0) as ranks:
        with channel(0, ranks.store) as ch:
            for r in range(repeats):
                for i, (dtype, shape) in enumerate(CASES):
                    mb = r * len(CASES) + i
                    sent = make(dtype, shape, seed=mb)
                    back = torch.full(shape, 7, dtype=dtype) if sent.numel() else torch.empty(shape, dtype=dtype)
                    send = ch.isend(sent, 1, microbatch=mb, kind="fwd")
                    recv = ch.irecv(back, 1, microbatch=mb, kind="bwd")
                    send.wait()
                    recv.wait()
                    assert bits_equal(sent, back), f"{dtype} {shape} came back different"
            registrations = ch.mover.registrations
        name, peer_registrations = ranks.results()[1]
    sizes = {torch.empty(shape, dtype=dtype).numel() * dtype.itemsize for dtype, shape in CASES} - {0}
    assert name == "mooncake-tcp"
    # Per message size: one receive buffer and one send staging buffer, reused in every repeat.
    assert registrations == peer_registrations == 2 * len(sizes)


@needs_mooncake
@pytest.mark.timeout(60)
def test_header_mismatch_fails_both_sides_naming_both_stages():
    with Ranks(send_wrong, [1], timeout=45.0) as ranks:
        with channel(0, ranks.store) as ch:
            errors = receive_wrong_then_right(ch)
        sender = ranks.results()[1]
    expected = MISMATCH_ERRORS
    assert errors == expected
    assert sender == expected + ["sent"]


@needs_mooncake
@pytest.mark.timeout(60)
def test_a_forged_region_is_refused_by_the_receivers_engine_and_the_stream_recovers():
    with Ranks(receive_forged_then_real, [1], timeout=45.0) as ranks:
        with channel(0, ranks.store) as ch:
            forged = ch.isend(torch.ones(FORGED_SIZE, dtype=torch.uint8), 1, microbatch=0, kind="fwd")
            with pytest.raises(ChannelError) as info:
                forged.wait(10.0)
            ch.isend(torch.ones(FORGED_SIZE // 2, dtype=torch.uint8), 1, microbatch=1, kind="fwd").wait(10.0)
        receiver = ranks.results()[1]
    # The engine on stage 1 checks every incoming write against its registered memory.
    message = str(info.value)
    assert message.startswith("stage 0 (group nvidia, rank 0) failed to write fwd microbatch 0 uint8[4096] "
                              "to stage 1 (group amd, rank 1): mooncake tcp write of 4096 bytes to 127.0.0.1:")
    assert message.endswith(" failed")
    assert receiver == [message, f"received {FORGED_SIZE // 2}"]


@needs_mooncake
@pytest.mark.timeout(60)
def test_a_stopped_receiver_fails_the_write_at_the_deadline_and_a_killed_one_at_once():
    with Ranks(post_big_receive_then_wait, [1], timeout=45.0) as ranks:
        pid = ranks.procs[1].pid
        # The mover's own deadline, shorter than the channel's, is what must fire.
        with channel(0, ranks.store, deadline=10.0, mover=MooncakeMover(deadline=1.5)) as ch:
            ch.isend(torch.ones(16), 1, microbatch=0, kind="fwd").wait()
            ranks.store.wait(["posted"])
            time.sleep(0.3)  # its READY is in
            os.kill(pid, signal.SIGSTOP)
            start = time.monotonic()
            stalled = ch.isend(torch.ones(BIG, dtype=torch.uint8), 1, microbatch=1, kind="fwd")
            with pytest.raises(ChannelError) as info:
                stalled.wait(10.0)
            assert 1.4 <= time.monotonic() - start < 4.0, str(info.value)
            assert str(info.value).startswith("stage 0 (group nvidia, rank 0) failed to write fwd microbatch 1 "
                                              "uint8[67108864] to stage 1 (group amd, rank 1): mooncake tcp write")
            assert str(info.value).endswith("did not finish within 1.5 s")
            os.kill(pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(ChannelError, match="connection to stage 1 .* lost"):
                ch.isend(torch.ones(16), 1, microbatch=2, kind="fwd").wait(10.0)
            assert time.monotonic() - start < 3.0


@needs_mooncake
@pytest.mark.timeout(60)
def test_a_receiver_killed_mid_transfer_fails_the_send_naming_it():
    with Ranks(post_big_receive_then_wait, [1], timeout=45.0) as ranks:
        pid = ranks.procs[1].pid
        with channel(0, ranks.store, deadline=30.0) as ch:
            ch.isend(torch.ones(16), 1, microbatch=0, kind="fwd").wait()
            ranks.store.wait(["posted"])
            time.sleep(0.3)
            os.kill(pid, signal.SIGSTOP)  # so the write is surely still in flight when it dies
            sending = ch.isend(torch.ones(BIG, dtype=torch.uint8), 1, microbatch=1, kind="fwd")
            time.sleep(0.3)
            assert not sending.done()
            os.kill(pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(ChannelError, match="stage 1 \\(group amd, rank 1\\)"):
                sending.wait(30.0)
            assert time.monotonic() - start < 5.0


# ------------------------------------------------------- choice and end to end

def test_the_mover_is_chosen_per_boundary_alike_on_both_ends():
    gpu = MoverFacts("host-a", "cuda", None)
    same_host = MoverFacts("host-a", "cuda", "no matter")
    cpu = MoverFacts("host-a", "cpu", None)
    other_host = MoverFacts("host-b", "hip", None)
    no_rdma = MoverFacts("host-b", "hip", "/sys/class/infiniband lists no RDMA device")
    expected = {(gpu, same_host): ("auto", "one host: CUDA IPC"),
                (cpu, MoverFacts("host-a", "cpu", "x")): ("auto", "one host: shared memory"),
                (gpu, cpu): ("tcp", None),
                (gpu, other_host): ("mooncake-rdma", None),
                (gpu, no_rdma): ("tcp", "two hosts, no RDMA on one end: /sys/class/infiniband lists no RDMA device")}
    for (a, b), (mover, why) in expected.items():
        assert choose_mover(a, b)[0] == choose_mover(b, a)[0] == mover
        if why is not None:
            assert choose_mover(a, b)[1] == why
    assert "not verified by hetpipe's tests" in choose_mover(gpu, other_host)[1]


TINY = ["+model=tiny_llama", "cluster=cpu_mixed", "partition.layers=[2,2]", "model.hidden_size=64",
        "model.ffn_hidden_size=160", "train.train_iters=4", "train.seq_length=32", "train.micro_batch_size=2",
        "train.global_batch_size=8", "train.log_interval=1", "optimizer.lr=3e-3", "logging.progress=false"]


@needs_mooncake
@pytest.mark.timeout(240)
def test_training_over_mooncake_gives_the_tcp_channels_losses_bit_for_bit(tmp_path, corpus_prefix, one_thread):
    data = f"data.path={corpus_prefix}"
    _, tcp = run_pretrain(tmp_path / "tcp", [*TINY, data, "cluster.transport.kind=tcp"])
    runs = {mover: run_pretrain(tmp_path / mover, [*TINY, data, "cluster.transport.kind=direct",
                                                   f"cluster.transport.mover={mover}"])
            for mover in ("mooncake-tcp", "auto")}
    losses = [row["loss"] for row in tcp if "loss" in row]
    assert len(losses) == 4
    boundary = "hetpipe: boundary stage 0 (group nvidia, nvidia, rank 0) <-> stage 1 (group amd, amd, rank 1): "
    for mover, why in (("mooncake-tcp", "cluster.transport.mover=mooncake-tcp"), ("auto", "one host: shared memory")):
        proc, rows = runs[mover]
        assert [row["loss"] for row in rows if "loss" in row] == losses  # float equality: bit for bit
        assert f"{boundary}direct channel, mover {mover}: {why}\n" in proc.stderr


@needs_mooncake
@pytest.mark.timeout(240)
def test_mooncake_between_two_emulated_nodes_trains_like_one_process(tmp_path, emulated_nodes, corpus_prefix):
    # Two network namespaces, each started with launch_cluster.sh: the boundary
    # between the nvidia node and the amd node goes through Mooncake's TCP
    # transport on each node's own address, as its RDMA transport would on a
    # real cluster, and the losses are still bitwise one process's.
    args = [*JOB, f"data.path={corpus_prefix}", "train.train_iters=3",
            "cluster.transport.kind=direct", "cluster.transport.mover=mooncake-tcp"]
    runs = start_nodes(emulated_nodes, args, tmp_path)
    codes = wait_all(runs, timeout=180)
    assert codes == [0, 0], "".join(f"\n--- node {r.rank}:\n{r.output()[-3000:]}" for r in runs)
    assert "mooncake-tcp" in runs[0].output() + runs[1].output()
    _, reference = run_pretrain(tmp_path / "single", [*args[:-2], "cluster=single",
                                                      "cluster.groups.0.device_type=CPU"])
    assert [(r["loss"], r["grad_norm"]) for r in metrics(tmp_path / "run0")] == \
        [(r["loss"], r["grad_norm"]) for r in reference]
