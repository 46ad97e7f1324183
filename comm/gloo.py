"""Reference boundary channel over torch.distributed's gloo backend.

This is where the joint AMD+NVIDIA training work started: gloo runs on any
host, so CPU-forwarding through it always works, if slowly (160.8 TFLOP/s/GPU
against 539.6 device-direct in that study). hetpipe keeps it as the simple,
obviously-correct reference the faster channels are measured and tested
against.

Each message is two gloo sends on the boundary's group: the encoded frame
header (the same struct bytes as the TCP channel's header, as a uint8 tensor)
on one tag, then the tensor's bytes on another. A background thread per peer
receives headers in posting order, checks each against its ``irecv`` before
receiving the data, and drains the data of a mismatched message so the stream
stays in step. Data receives are posted as soon as the header arrives, not
when the caller waits, because gloo completes a send only once the receiver
has posted the matching receive: posting lazily could deadlock two stages that
each wait on their own send first.

GPU tensors are copied to host memory before sending and back on ``wait``
(on the caller's current stream); that path is not exercised in CI. Lost
peers, deadlines and ``close`` follow :mod:`hetpipe.comm.threaded`.

Limitation: gloo offers no way to cancel a posted receive, so ``close`` cannot
interrupt a receive thread blocked on a peer that never sends; that daemon
thread ends when gloo's own timeout (the group's) fires or the group is
destroyed.
"""
from __future__ import annotations

import collections
import queue
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import torch
import torch.distributed as dist

from hetpipe.comm.channel import (
    HEADER_SIZE,
    ChannelError,
    CompletionHandle,
    FrameHeader,
    Handle,
    as_bytes,
    check_header,
    decode_header,
    encode_header,
    header_for,
)
from hetpipe.comm.threaded import PeerLost, PeerState, ThreadedChannel

if TYPE_CHECKING:
    from hetpipe.devices.cluster import ClusterConfig

_HEADER_TAG = 0x4850
_DATA_TAG = 0x4851
# A mismatched message is received into scratch memory to keep the stream in
# step; beyond this size the peer is treated as lost instead.
_MAX_DRAIN_BYTES = 1 << 30


@dataclass(eq=False)
class _Recv:
    expected: FrameHeader
    target: torch.Tensor  # flat uint8 host memory the data lands in
    handle: CompletionHandle


@dataclass(eq=False, kw_only=True)
class _GlooPeer(PeerState):
    recvs: collections.deque[_Recv] = field(default_factory=collections.deque)
    sends: "queue.SimpleQueue[tuple[list[dist.Work], CompletionHandle, tuple[torch.Tensor, ...]] | None]" = \
        field(default_factory=queue.SimpleQueue)
    pending_sends: set[CompletionHandle] = field(default_factory=set)


class GlooChannel(ThreadedChannel[_GlooPeer]):
    """Header-checked boundary channel on a gloo process group.

    ``group`` must be a gloo group containing this rank and its peers (None:
    the default group, which must then be gloo); peers are global ranks.
    """

    def __init__(self, rank: int, peers: list[int], names: dict[int, str],
                 group: dist.ProcessGroup | None = None, deadline: float = 300.0) -> None:
        super().__init__(rank, peers, names, deadline, transport="gloo")
        if not dist.is_initialized():
            raise ChannelError("GlooChannel needs torch.distributed to be initialized")
        backend = str(dist.get_backend(group))
        if backend != dist.Backend.GLOO:
            raise ChannelError(f"GlooChannel needs a gloo process group, got backend {backend!r}")
        self.group = group
        self._peers = {p: _GlooPeer(rank=p, name=self.name_of(p)) for p in self.peers}
        for state in self._peers.values():
            self._start_thread(state, "recv", self._receive_loop)
            self._start_thread(state, "send", self._send_loop)

    def isend(self, tensor: torch.Tensor, peer: int, *, microbatch: int, kind: str) -> Handle:
        state = self._posting_peer(peer)
        # .cpu() is ordered after the caller's stream and blocks until the copy is done.
        src = tensor.detach().cpu() if tensor.is_cuda else tensor.detach()
        src = src.contiguous()
        header = header_for(src, seq=0, microbatch=microbatch, kind=kind)
        with state.cond:
            header, handle, posted = self._number(state, header, peer, send=True, make_handle=lambda header, action:
                                                  CompletionHandle(owner=self.name, action=action,
                                                                   deadline=self.deadline))
            if not posted:
                return handle
            wire = torch.frombuffer(bytearray(encode_header(header)), dtype=torch.uint8)
            # Posted under the lock: gloo matches each tag's messages in posting order.
            works = [dist.isend(wire, dst=peer, group=self.group, tag=_HEADER_TAG)]
            if header.nbytes:
                works.append(dist.isend(as_bytes(src), dst=peer, group=self.group, tag=_DATA_TAG))
            state.pending_sends.add(handle)
            state.sends.put((works, handle, (wire, src)))
        return handle

    def irecv(self, tensor: torch.Tensor, peer: int, *, microbatch: int, kind: str) -> Handle:
        state = self._posting_peer(peer)
        header = header_for(self._receivable(tensor), seq=0, microbatch=microbatch, kind=kind)
        finish = None
        if tensor.is_cuda:
            staging = torch.empty(header.nbytes, dtype=torch.uint8)
            finish = lambda: as_bytes(tensor).copy_(staging)  # noqa: E731 - on the caller's stream
            target = staging
        else:
            target = as_bytes(tensor)
        with state.cond:
            header, handle, posted = self._number(state, header, peer, send=False, make_handle=lambda header, action:
                                                  CompletionHandle(owner=self.name, action=action,
                                                                   deadline=self.deadline, finish=finish))
            if not posted:
                return handle
            state.recvs.append(_Recv(header, target, handle))
            state.cond.notify_all()
        return handle

    def _send_loop(self, peer: _GlooPeer) -> None:
        while True:
            item = peer.sends.get()
            if item is None:
                return
            works, handle, _keepalive = item
            try:
                for work in works:
                    work.wait()  # the group's timeout bounds this
            except RuntimeError as exc:
                self._fail_peer(peer, PeerLost(f"connection to {peer.name} lost: {exc}", peer.rank))
                continue
            with peer.cond:
                peer.pending_sends.discard(handle)
            handle.set_done()

    def _receive_loop(self, peer: _GlooPeer) -> None:
        while True:
            with peer.cond:
                while not peer.recvs and peer.error is None:
                    peer.cond.wait(1.0)
                if peer.error is not None:
                    return
                op = peer.recvs[0]
            try:
                wire = torch.empty(HEADER_SIZE, dtype=torch.uint8)
                dist.irecv(wire, src=peer.rank, group=self.group, tag=_HEADER_TAG).wait()
                header = decode_header(wire.numpy().tobytes(), sender=peer.name)
                try:
                    check_header(header, op.expected, receiver=self.name, sender=peer.name)
                    mismatch = None
                except ChannelError as exc:
                    mismatch = exc
                if mismatch is not None and header.nbytes > _MAX_DRAIN_BYTES:
                    raise ChannelError(f"{mismatch}; the {header.nbytes}-byte message is too large to skip")
                if header.nbytes:
                    target = op.target if mismatch is None else torch.empty(header.nbytes, dtype=torch.uint8)
                    dist.irecv(target, src=peer.rank, group=self.group, tag=_DATA_TAG).wait()
            except ChannelError as exc:
                self._fail_peer(peer, exc)
                return
            except RuntimeError as exc:
                self._fail_peer(peer, PeerLost(f"connection to {peer.name} lost: {exc}", peer.rank))
                return
            with peer.cond:
                if peer.recvs and peer.recvs[0] is op:
                    peer.recvs.popleft()
            if mismatch is not None:
                op.handle.set_failed(mismatch)
            else:
                op.handle.set_done()

    def _abandon(self, peer: _GlooPeer) -> list[CompletionHandle]:
        pending = [op.handle for op in peer.recvs] + list(peer.pending_sends)
        peer.recvs.clear()
        peer.pending_sends.clear()
        return pending

    def _disconnect(self, peer: _GlooPeer) -> None:
        # Sends already posted to gloo finish (or time out) before the thread sees this;
        # the receive thread returns on the peer's error by itself.
        peer.sends.put(None)


def build_channel(rank: int, group: list[int], *, names: Mapping[int, str], cluster: ClusterConfig,
                  **_: object) -> GlooChannel:
    """The transport registry's builder (hetpipe/pipeline/transports.py): this kind's channel
    to ``group`` from the cluster config, as comm/factory.py builds every cross-vendor one."""
    return GlooChannel(rank, group, dict(names), None, deadline=cluster.transport.deadline_s)
