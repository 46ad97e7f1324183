"""Boundary channel for two stages of the same vendor: plain torch.distributed P2P.

When both sides of a boundary run the same vendor's stack, its own library
(NCCL on NVIDIA, RCCL on AMD, gloo between CPU ranks) moves the tensor with
no staging, so hetpipe adds nothing but the deadline and the stage names in
errors.

NCCL/RCCL send and receive raw device buffers with no room for a header, so
this channel's messages are *not* self-describing: ``microbatch`` and ``kind``
appear only in error messages and a shape or dtype mismatch between the two
sides is not detected here (NCCL fails or hangs until the deadline). Use it
only where the engine's schedule is trusted; cross-vendor boundaries use the
header-checked channels.

Each *direction* of a boundary gets its own process group. NCCL runs the
operations of one communicator in issue order on one stream, so a send and a
receive between the same two ranks must be issued in the same relative order
on both sides. The engine posts receives ahead of use, which interleaves one
rank's sends and receives differently from its peer's and would deadlock a
shared communicator. With one communicator per direction, each carries a
single FIFO stream of messages whose order the schedules guarantee to match.

Waiting on an NCCL/RCCL transfer is stream-ordered: the waiting rank's
current stream waits for it and the host does not, so the host keeps queueing
kernels ahead of the GPU (a Work waited on with a timeout blocks the host
until the bytes arrive, draining the GPU's queue at every boundary receive).
A hung NCCL boundary is therefore ended by NCCL's watchdog at
the direction group's timeout, which the topology sets to
``cluster.transport.deadline_s``; its error names the operation and the group
rather than the stage. gloo waits block the host and raise the channel's own
:class:`ChannelTimeout`.
"""
from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from hetpipe.comm.channel import Channel, ChannelError, ChannelTimeout, Handle, check_kind, describe

_TIMEOUT_TEXT = re.compile(r"timed out|timing out|timeout", re.IGNORECASE)


class WorkHandle(Handle):
    """A transfer carried by torch ``Work`` objects, waited on in order within one deadline.

    Backends report a timeout as a RuntimeError whose text says so; that
    becomes :class:`ChannelTimeout`, anything else :class:`ChannelError`, both
    naming the peer stage. A gloo pair that timed out is closed by gloo, so a
    timeout here is fatal for that peer.
    """

    def __init__(self, works: Iterable[dist.Work], *, owner: str, action: str, deadline: float,
                 finish: Callable[[], None] | None = None, stream_ordered: bool = False) -> None:
        self._works = list(works)
        self.owner = owner
        self.action = action
        self.deadline = deadline
        self._finish = finish
        self.stream_ordered = stream_ordered

    def wait(self, timeout: float | None = None) -> None:
        if self.stream_ordered and timeout is None:
            # NCCL/RCCL: the current stream waits for the transfer and the host
            # goes on queueing work. (A Work.wait given a timeout would block
            # the host until the transfer ends: after every boundary receive
            # the GPU would then idle while Python queued the next kernels.)
            # The deadline is the process group's timeout, enforced by NCCL's
            # watchdog.
            for work in self._works:
                work.wait()
            self._works.clear()
            finish, self._finish = self._finish, None
            if finish is not None:
                finish()
            return
        limit = self.deadline if timeout is None else timeout
        until = time.monotonic() + limit
        while self._works:
            remaining = until - time.monotonic()
            if remaining <= 0:
                raise ChannelTimeout(f"{self.owner} timed out after {limit:g} s waiting to {self.action}")
            try:
                self._works[0].wait(timedelta(seconds=remaining))
            except RuntimeError as exc:
                if _TIMEOUT_TEXT.search(str(exc)):
                    raise ChannelTimeout(f"{self.owner} timed out after {limit:g} s waiting to "
                                         f"{self.action}: {exc}") from exc
                raise ChannelError(f"{self.owner} failed to {self.action}: {exc}") from exc
            self._works.pop(0)
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    def done(self) -> bool:
        # gloo marks send/recv work complete only inside wait(); NCCL answers truthfully.
        return all(work.is_completed() for work in self._works)


class TorchP2PChannel(Channel):
    """isend/irecv on the vendor's own library, for same-vendor boundaries.

    ``groups`` maps each ordered (sender, receiver) pair of global ranks to the
    process group that carries that direction (None: the default group, fine
    for gloo). Tensors go as they are, on the device the backend expects (CUDA
    for NCCL/RCCL, CPU for gloo).
    """

    def __init__(self, rank: int, peers: list[int], names: dict[int, str],
                 groups: dict[tuple[int, int], dist.ProcessGroup | None] | None = None,
                 deadline: float = 300.0) -> None:
        super().__init__(rank, peers, names, deadline)
        if not dist.is_initialized():
            raise ChannelError("TorchP2PChannel needs torch.distributed to be initialized")
        self.groups = groups or {}

    def isend(self, tensor: torch.Tensor, peer: int, *, microbatch: int, kind: str) -> Handle:
        self._check(tensor, peer, kind)
        work = dist.isend(tensor, dst=peer, group=self.groups.get((self.rank, peer)))
        return WorkHandle([work], owner=self.name, deadline=self.deadline, stream_ordered=not tensor.is_cpu,
                          action=f"send {describe(kind, microbatch, tensor.dtype, tensor.shape)} "
                                 f"to {self.name_of(peer)}")

    def irecv(self, tensor: torch.Tensor, peer: int, *, microbatch: int, kind: str) -> Handle:
        self._check(tensor, peer, kind)
        work = dist.irecv(tensor, src=peer, group=self.groups.get((peer, self.rank)))
        return WorkHandle([work], owner=self.name, deadline=self.deadline, stream_ordered=not tensor.is_cpu,
                          action=f"receive {describe(kind, microbatch, tensor.dtype, tensor.shape)} "
                                 f"from {self.name_of(peer)}")

    def _check(self, tensor: torch.Tensor, peer: int, kind: str) -> None:
        self.check_open(peer)
        check_kind(kind)
        if not tensor.is_contiguous():
            raise ChannelError(f"{self.name} can only move contiguous tensors (shape {list(tensor.shape)}, "
                               f"strides {tensor.stride()})")

    def close(self) -> None:
        # The process group belongs to the topology that created it; only stop posting.
        self._closed = True
