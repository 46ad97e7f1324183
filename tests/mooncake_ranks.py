"""What the spawned rank of tests/test_mooncake_mover.py runs: the stage-1 side of each
two-process test. A module of its own, importing no more than the channel and its
mover, so that the spawned interpreter starts as fast as the other channel tests'."""
from __future__ import annotations

import torch

from channel_harness import CASES, NAMES, send_wrong_then_right
from hetpipe.comm.channel import ChannelError
from hetpipe.comm.direct import DirectChannel
from hetpipe.comm.mooncake_mover import MooncakeMover
from hetpipe.comm.mover import RegionHandle

TOKEN = "job-2718-secret"

BIG = 64 << 20  # bytes: far more than the loopback socket buffers, so a stopped receiver stalls the write
FORGED_SIZE = 4096


def channel(rank: int, store, *, deadline: float = 15.0, mover: MooncakeMover | None = None) -> DirectChannel:
    return DirectChannel(rank, [1 - rank], NAMES, store, TOKEN, deadline=deadline,
                         mover=mover or MooncakeMover(deadline=deadline))


class ForgingMover(MooncakeMover):
    """Publishes a receive buffer of FORGED_SIZE bytes at an address past its end, as a corrupted READY would."""

    def register(self, tensor: torch.Tensor) -> RegionHandle:
        handle = super().register(tensor)
        if tensor.numel() != FORGED_SIZE:
            return handle
        forged = self.endpoint, tensor.data_ptr() + (1 << 30)
        return RegionHandle(self.name, handle.key, handle.size,
                            f'{{"endpoint": "{forged[0]}", "addr": {forged[1]}}}'.encode())


# ------------------------------------------------------------- child targets

def echo_cases(rank: int, store, repeats: int) -> tuple[str, int]:
    """Receive every case as fwd and send it back as bwd, ``repeats`` times; report the mover and its registrations."""
    with channel(rank, store) as ch:
        for r in range(repeats):
            for i, (dtype, shape) in enumerate(CASES):
                buf = torch.empty(shape, dtype=dtype)
                mb = r * len(CASES) + i
                ch.irecv(buf, 0, microbatch=mb, kind="fwd").wait()
                ch.isend(buf, 0, microbatch=mb, kind="bwd").wait()
        return ch.mover.name, ch.mover.registrations


def receive_forged_then_real(rank: int, store) -> list[str]:
    """Post a receive whose region is forged, then an honest one; report what each said."""
    out = []
    with channel(rank, store, mover=ForgingMover(deadline=15.0)) as ch:
        for mb, size in ((0, FORGED_SIZE), (1, FORGED_SIZE // 2)):
            buf = torch.zeros(size, dtype=torch.uint8)
            try:
                ch.irecv(buf, 0, microbatch=mb, kind="fwd").wait(10.0)
                out.append(f"received {int(buf.sum())}")
            except ChannelError as exc:
                out.append(str(exc))
    return out


def send_wrong(rank: int, store) -> list[str]:
    """Stage 1 sends three wrong messages and one right one; reports what its send handles said."""
    with channel(rank, store) as ch:
        return send_wrong_then_right(ch)


def post_big_receive_then_wait(rank: int, store) -> str:
    """Take one small message (the engines have met), post one BIG receive, tell the test, then wait on it
    (the test stops or kills this process)."""
    with channel(rank, store, deadline=60.0) as ch:
        ch.irecv(torch.empty(16), 0, microbatch=0, kind="fwd").wait()
        pending = ch.irecv(torch.empty(BIG, dtype=torch.uint8), 0, microbatch=1, kind="fwd")
        store.set("posted", "1")
        pending.wait()
    return "received"
