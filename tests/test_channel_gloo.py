"""The gloo reference channel and the torch P2P channel between two real processes on a gloo group."""
from __future__ import annotations

import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from multiproc import CTX, collect

from hetpipe.comm.channel import ChannelError, ChannelTimeout

NAMES = {0: "stage 0 (group nvidia, rank 0)", 1: "stage 1 (group amd, rank 1)"}
CASES = [(torch.float32, (2, 64, 128)), (torch.bfloat16, (3, 5)), (torch.int64, (1000,)),
         (torch.float32, (0, 8)), (torch.float64, ()), (torch.float32, (1 << 20,))]


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    return torch.randint(-(1 << 40), 1 << 40, shape, generator=g).to(dtype)


def _child(target, rank: int, port: int, results) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=20))
        try:
            results.put((rank, "ok", target(rank, store)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_pair(target, timeout: float = 25.0) -> dict[int, object]:
    """Run ``target(rank, store)`` in two processes sharing a gloo default group; return each rank's result."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    results = CTX.Queue()
    procs = [CTX.Process(target=_child, args=(target, r, store.port, results), daemon=True) for r in (0, 1)]
    return collect(procs, results, timeout)


def gloo_exchange(rank: int, store: dist.Store) -> dict[str, object]:
    from hetpipe.comm.gloo import GlooChannel

    result: dict[str, object] = {}
    with GlooChannel(rank, [1 - rank], NAMES, None, deadline=10.0) as ch:
        if rank == 0:
            handles = [ch.isend(make(d, s, i), 1, microbatch=i, kind="fwd") for i, (d, s) in enumerate(CASES)]
            handles.append(ch.isend(torch.ones(4, 9), 1, microbatch=len(CASES), kind="fwd"))
            handles.append(ch.isend(torch.full((4, 8), 5.0), 1, microbatch=len(CASES) + 1, kind="fwd"))
            back = torch.empty(3, dtype=torch.int64)
            handles.append(ch.irecv(back, 1, microbatch=0, kind="bwd"))
            for h in handles:
                h.wait()
            result["bwd"] = back.tolist()
            late = torch.empty(2)
            pending = ch.irecv(late, 1, microbatch=1, kind="bwd")
            start = time.monotonic()
            try:
                pending.wait(0.5)
                result["timeout"] = "no error"
            except ChannelTimeout as exc:
                result["timeout"] = f"{time.monotonic() - start:.2f} {exc}"
            dist.barrier()  # only now does stage 1 send it
            pending.wait()
            result["late"] = late.tolist()
        else:
            bufs = [torch.empty(s, dtype=d) for d, s in CASES]
            for h in [ch.irecv(b, 0, microbatch=i, kind="fwd") for i, b in enumerate(bufs)]:
                h.wait()
            result["exact"] = [torch.equal(b, make(d, s, i)) for i, (b, (d, s)) in enumerate(zip(bufs, CASES))]
            try:
                ch.irecv(torch.empty(4, 8), 0, microbatch=len(CASES), kind="fwd").wait()
                result["mismatch"] = "no error"
            except ChannelError as exc:
                result["mismatch"] = str(exc)
            after = torch.empty(4, 8)
            ch.irecv(after, 0, microbatch=len(CASES) + 1, kind="fwd").wait()
            result["after"] = torch.equal(after, torch.full((4, 8), 5.0))
            ch.isend(torch.tensor([7, 8, 9]), 0, microbatch=0, kind="bwd").wait()
            dist.barrier()
            ch.isend(torch.tensor([1.5, 2.5]), 0, microbatch=1, kind="bwd").wait()
    return result


def p2p_exchange(rank: int, store: dist.Store) -> dict[str, object]:
    from hetpipe.comm.p2p import TorchP2PChannel

    result: dict[str, object] = {}
    with TorchP2PChannel(rank, [1 - rank], NAMES, None, deadline=10.0) as ch:
        x = torch.arange(12.0).reshape(3, 4)
        if rank == 0:
            ch.isend(x, 1, microbatch=0, kind="fwd").wait()
            back = torch.empty(3, 4)
            ch.irecv(back, 1, microbatch=0, kind="bwd").wait()
            result["back"] = torch.equal(back, -x)
            store.wait(["p2p-timeout-seen"])  # stay up: a vanished peer would be a different error
        else:
            got = torch.empty(3, 4)
            ch.irecv(got, 0, microbatch=0, kind="fwd").wait()
            ch.isend(-got, 0, microbatch=0, kind="bwd").wait()
            # Last: a gloo timeout closes the pair, so nothing may follow it.
            start = time.monotonic()
            try:
                ch.irecv(torch.empty(1), 0, microbatch=1, kind="fwd").wait(0.5)
                result["timeout"] = "no error"
            except ChannelTimeout as exc:
                result["timeout"] = f"{time.monotonic() - start:.2f} {exc}"
            store.set("p2p-timeout-seen", "1")
        with pytest.raises(ChannelError, match="has no channel to rank 5"):
            ch.isend(x, 5, microbatch=0, kind="fwd")
    return result


@pytest.mark.timeout(40)
def test_gloo_channel_round_trips_and_rejects_a_mismatched_header():
    results = run_pair(gloo_exchange)
    receiver = results[1]
    assert receiver["exact"] == [True] * len(CASES)
    assert receiver["mismatch"] == ("stage 1 (group amd, rank 1) expected fwd microbatch 6 float32[4, 8] "
                                    "from stage 0 (group nvidia, rank 0), received fwd microbatch 6 float32[4, 9]")
    assert receiver["after"], "the message after a rejected one did not arrive intact"
    assert results[0]["bwd"] == [7, 8, 9]
    elapsed, message = results[0]["timeout"].split(" ", 1)
    assert float(elapsed) < 2.0
    assert message == ("stage 0 (group nvidia, rank 0) timed out after 0.5 s waiting to receive bwd microbatch 1 "
                       "float32[2] from stage 1 (group amd, rank 1)")
    assert results[0]["late"] == [1.5, 2.5], "a receive that timed out once must still complete later"


@pytest.mark.timeout(40)
def test_torch_p2p_channel_round_trips_and_maps_backend_timeouts():
    results = run_pair(p2p_exchange)
    assert results[0]["back"] is True
    elapsed, message = results[1]["timeout"].split(" ", 1)
    assert float(elapsed) < 2.0
    assert message.startswith("stage 1 (group amd, rank 1) timed out after 0.5 s waiting to receive fwd "
                              "microbatch 1 float32[1] from stage 0 (group nvidia, rank 0)")
