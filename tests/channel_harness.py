"""Shared harness for the channel tests: deterministic tensors, bit-exact
comparison, and real peer processes around a TCPStore hosted by pytest."""
from __future__ import annotations

import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from hetpipe.comm.channel import ChannelError, ChannelTimeout
from multiproc import CTX

# Dtypes and shapes every mover must carry bit-exact, empty and 0-d included.
CASES = [
    (torch.float32, (2, 64, 128)),
    (torch.bfloat16, (3, 5, 7)),
    (torch.int64, (1000,)),
    (torch.float32, (0, 4)),
    (torch.float64, ()),
    (torch.float32, (4 * 1024 * 1024,)),  # 16 MiB
]
NAMES = {0: "stage 0 (group nvidia, rank 0)", 1: "stage 1 (group amd, rank 1)", 2: "stage 2 (group amd, rank 2)"}


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    return torch.randint(0, 250, shape, generator=g).to(dtype)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _child(target, rank: int, port: int, results, args: tuple) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
        store.set(f"harness/started/{rank}", "1")
        results.put((rank, "ok", target(rank, store, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


class Ranks:
    """A TCPStore hosted here plus one spawned process per rank running ``target(rank, store, *args)``."""

    def __init__(self, target, ranks: list[int], *args, timeout: float = 20.0) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout))
        self.timeout = timeout
        self.queue = CTX.Queue()
        self.procs = {r: CTX.Process(target=_child, args=(target, r, self.store.port, self.queue, args), daemon=True)
                      for r in ranks}

    def __enter__(self) -> "Ranks":
        """Start the ranks and wait until each has imported torch and reached the store:
        a test's deadlines then time the channel, not a process start on a busy machine
        (a peer's start took longer than a 1.5 s deadline beside other jobs)."""
        for proc in self.procs.values():
            proc.start()
        try:
            self.store.wait([f"harness/started/{r}" for r in self.procs], timedelta(seconds=self.timeout))
        except RuntimeError:
            states = self._states()
            self.__exit__()
            raise AssertionError(f"a rank did not reach the store within {self.timeout} s: {states}") from None
        return self

    def _states(self) -> str:
        """Each rank's process state and whatever the ranks reported, for a rank that never started."""
        states = [f"rank {r}: pid {p.pid}, exit code {p.exitcode}" for r, p in self.procs.items()]
        while not self.queue.empty():
            rank, status, value = self.queue.get_nowait()
            states.append(f"rank {rank} {status}: {value}")
        return "; ".join(states)

    def results(self) -> dict[int, object]:
        out: dict[int, object] = {}
        until = time.monotonic() + self.timeout
        while len(out) < len(self.procs):
            rank, status, value = self.queue.get(timeout=max(until - time.monotonic(), 0.1))
            assert status == "ok", f"rank {rank} failed:\n{value}"
            out[rank] = value
        return out

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs.values():
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)


# Three messages a receiver expecting float32[2, 3, 4] for bwd microbatches
# 0, 1, 2 must refuse (wrong shape, wrong dtype, wrong microbatch), then the
# right one for microbatch 3: the stream must recover after the refusals.
WRONG_THEN_RIGHT = ((torch.ones(2, 3, 5), 0), (torch.ones(2, 3, 4, dtype=torch.bfloat16), 1),
                    (torch.ones(2, 3, 4), 7), (torch.full((2, 3, 4), 9.0), 3))
_EXPECTED = ("stage 0 (group nvidia, rank 0) expected bwd microbatch {} float32[2, 3, 4] "
             "from stage 1 (group amd, rank 1), received ")
MISMATCH_ERRORS = [_EXPECTED.format(0) + "bwd microbatch 0 float32[2, 3, 5]",
                   _EXPECTED.format(1) + "bwd microbatch 1 bfloat16[2, 3, 4]",
                   _EXPECTED.format(2) + "bwd microbatch 7 float32[2, 3, 4]"]


def send_wrong_then_right(ch) -> list[str]:
    """Stage 1's side: send :data:`WRONG_THEN_RIGHT` to rank 0; what each send handle said."""
    out = []
    for tensor, mb in WRONG_THEN_RIGHT:
        try:
            ch.isend(tensor, 0, microbatch=mb, kind="bwd").wait()
            out.append("sent")
        except ChannelError as exc:
            out.append(str(exc))
    return out


def receive_wrong_then_right(ch) -> list[str]:
    """Stage 0's side: each refused receive's error (never a timeout), then
    check that the right message still arrives."""
    errors = []
    for mb in (0, 1, 2):
        try:
            ch.irecv(torch.empty(2, 3, 4), 1, microbatch=mb, kind="bwd").wait(10.0)
            errors.append("received")
        except ChannelError as exc:
            assert not isinstance(exc, ChannelTimeout), exc
            errors.append(str(exc))
    last = torch.empty(2, 3, 4)
    ch.irecv(last, 1, microbatch=3, kind="bwd").wait(10.0)
    assert torch.equal(last, torch.full((2, 3, 4), 9.0)), "the stream did not recover"
    return errors
