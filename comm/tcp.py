"""CPU-forwarding boundary channel over plain TCP, striped across NICs.

This is the transport a mixed AMD + NVIDIA cluster can always use: no vendor
library spans both, but every host has sockets. GPU tensors are staged through
pinned host memory (:mod:`hetpipe.comm.staging`). The joint AMD+NVIDIA
training study this project follows measured gloo CPU-forwarding at 160.8
TFLOP/s/GPU and 236.5 once each GPU had its own NIC, so this channel opens
``len(addresses) * streams_per_address`` connections per peer, each bound to
its own local address, and cuts every large message into one contiguous piece
per connection.

Threads, not the compute thread, touch the network: each connection has a
sender thread (FIFO queue of pieces) and a receiver thread (reads a header,
waits until the matching ``irecv`` is posted, then ``recv_into`` straight into
the destination memory). A message that arrives before its ``irecv`` is left
in the socket, so TCP flow control, not an unbounded buffer, holds the sender
back. Connections are made and authenticated by :mod:`hetpipe.comm.rendezvous`;
deadlines, lost peers and ``close`` follow :mod:`hetpipe.comm.threaded`.

Piece ``p`` of message ``seq`` always travels on connection ``(seq + p) % n``:
messages too small to stripe take turns on the NICs instead of all riding the
first (so every NIC carries traffic and a dead one is noticed at once, not at
the first large message), and the receiver knows which connection owes it a
missing piece. A transfer that times out therefore names the link it stalled
on (local interface and address, peer address) and the two stages.

A NIC lost mid-run stops the job; it does not fail over to the remaining NICs.
Failing over means resending the pieces that were in the dead connection's
kernel buffers over another one, which the sender no longer has once
``sendall`` returned, so it needs acknowledgements and retransmission on top
of TCP; and the world group's gloo and NCCL/RCCL spread their own traffic over
the same NICs without failing over either, so the job would stall in its next
collective anyway. A job that silently ran on half its links would also keep
a stage split planned for twice the bandwidth. So the link's loss is an error
that names it (interface, both addresses, the two stages): at once when the
NIC goes down on a node (the job's watch, :mod:`hetpipe.launch.job_watch`, sees its
state change), after half the deadline when it fails elsewhere on the path
(a receive holds some pieces of a message and its other link has carried
nothing since: :meth:`TcpChannel._watch_links`, measured at 9.6 s with a 15 s
deadline in tests/test_node_faults.py; or the peer closed its other links and
this one carried nothing since, not even the close), at the deadline when no
piece gives it away (the wait times out naming the link the piece was due on). Which link
owes a piece, and the report that names it, live in
:mod:`hetpipe.comm.tcp_links`. The job resumes from its last checkpoint.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

import torch
import torch.distributed as dist

from hetpipe.comm.channel import (
    HEADER_SIZE,
    ChannelError,
    ChannelTimeout,
    CompletionHandle,
    FrameHeader,
    Handle,
    as_bytes,
    check_header,
    decode_header,
    encode_header,
    header_for,
)
from hetpipe.comm.handshake import check_token
from hetpipe.comm.message_mac import TAG_SIZE, FrameMac
from hetpipe.comm.rendezvous import connect_peers
from hetpipe.comm.sockets import recv_exact
from hetpipe.comm.staging import HostStaging
from hetpipe.comm.tcp_links import (Link, LinkStalled, StallNamingHandle, half_closed_report, link_of,
                                    split_pieces, stall_after, stall_report)
from hetpipe.comm.threaded import PeerLost, PeerState, ThreadedChannel

if TYPE_CHECKING:
    from hetpipe.devices.cluster import ClusterConfig

# Pieces up to this size go out in one send together with their header.
_COALESCE_BYTES = 64 * 1024
_DRAIN_CHUNK = 1 << 20


def _drain(sock: socket.socket, nbytes: int, mac: FrameMac | None) -> int:
    """Read and discard ``nbytes`` so the stream stays in step after a rejected piece (still MACed)."""
    scratch = memoryview(bytearray(min(nbytes, _DRAIN_CHUNK)))
    got = 0
    while got < nbytes:
        n = sock.recv_into(scratch[:min(len(scratch), nbytes - got)])
        if n == 0:
            break
        if mac is not None:
            mac.absorb(scratch[:n])
        got += n
    return got


@dataclass(eq=False)
class _SendOp:
    handle: CompletionHandle
    header: FrameHeader
    data: memoryview
    npieces: int
    remaining: int
    keepalive: torch.Tensor
    staging: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    inflight: int = 0  # pieces a sender thread is writing right now
    sent: set[int] = field(default_factory=set)  # links whose piece is written


@dataclass(eq=False)
class _RecvOp:
    expected: FrameHeader
    view: memoryview
    dest: torch.Tensor
    staging: torch.Tensor | None = None
    posted: torch.cuda.Event | None = None
    copied: torch.cuda.Event | None = None
    npieces: int | None = None
    seen: int = 0
    error: ChannelError | None = None
    arrived: set[int] = field(default_factory=set)  # links whose piece is in
    first_piece: float | None = None  # time.monotonic() when the first piece was in
    handle: CompletionHandle = field(init=False)


@dataclass(eq=False, kw_only=True)
class _TcpPeer(PeerState):
    links: list[Link] = field(default_factory=list)
    closed: set[int] = field(default_factory=set)  # links the peer closed
    first_close: float | None = None  # time.monotonic() when the first of them closed
    recvs: dict[int, _RecvOp] = field(default_factory=dict)
    sends: set[_SendOp] = field(default_factory=set)


class TcpChannel(ThreadedChannel[_TcpPeer]):
    """Boundary channel that forwards through host memory over striped TCP connections.

    ``addresses`` are this rank's local addresses (one per NIC); every rank of
    the job must configure the same number of addresses and the same
    ``streams_per_address``. Connection j of each peer pair goes from local
    address ``j % len(addresses)`` to the peer's address of the same index.
    ``store`` is the job's store (endpoint exchange) and ``token`` the job's
    shared secret, proven by both sides of every connection's handshake
    without crossing the wire. ``message_mac`` adds a MAC to every frame
    (integrity against an attacker on the network path; costs throughput,
    see :mod:`hetpipe.comm.message_mac`). ``deadline``
    bounds the rendezvous and is every ``wait``'s default. ``device``
    (optional) is the GPU this rank's boundary tensors live on; its side
    streams are created up front rather than on first use.
    """

    def __init__(self, rank: int, peers: list[int], names: dict[int, str], store: dist.Store, token: str,
                 addresses: Sequence[str] = ("127.0.0.1",), streams_per_address: int = 1,
                 deadline: float = 300.0, device: torch.device | None = None, message_mac: bool = False) -> None:
        super().__init__(rank, peers, names, deadline, transport="tcp")
        secret = check_token(token, "TcpChannel")
        if not addresses:
            raise ChannelError("TcpChannel needs at least one local address")
        if streams_per_address < 1:
            raise ChannelError(f"streams_per_address must be >= 1, got {streams_per_address}")
        self.addresses = list(addresses)
        self.streams_per_address = int(streams_per_address)
        self.nstreams = len(self.addresses) * self.streams_per_address
        self._stall_s = stall_after(self.deadline)
        self.device = torch.device(device) if device is not None else None
        self._staging = HostStaging(self.device)
        self._peers = {p: _TcpPeer(rank=p, name=self.name_of(p)) for p in self.peers}
        sockets = connect_peers(store, rank=rank, peers=self.peers, name_of=self.name_of,
                                addresses=self.addresses, streams_per_address=self.streams_per_address,
                                token=secret, deadline=self.deadline)
        for (peer, j), session in sorted(sockets.items()):
            session.sock.settimeout(None)
            mac = FrameMac(session.keys, own=self.name, peer=self.name_of(peer), connection=j) if message_mac else None
            self._peers[peer].links.append(Link(session.sock, j, mac))
        for state in self._peers.values():
            for link in state.links:
                self._start_thread(state, "send", self._sender_loop, link, suffix=f"-{link.index}")
                self._start_thread(state, "recv", self._receiver_loop, link, suffix=f"-{link.index}")
        for state in self._peers.values():
            if len(state.links) > 1:
                self._start_thread(state, "watch", self._watch_links)

    # -------------------------------------------------------------- posting

    def isend(self, tensor: torch.Tensor, peer: int, *, microbatch: int, kind: str) -> Handle:
        state = self._posting_peer(peer)
        src = tensor.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        header = header_for(src, seq=0, microbatch=microbatch, kind=kind)
        staging, ready = None, None
        if not src.is_cuda:
            data = memoryview(as_bytes(src).numpy())
        elif header.nbytes:
            staging, ready = self._staging.stage_out(src)
            data = memoryview(staging.numpy())
        else:
            data = memoryview(b"")  # zero-size GPU tensor: header only
        pieces = split_pieces(header.nbytes, len(state.links))
        with state.cond:
            header, handle, posted = self._number(
                state, header, peer, send=True, make_handle=lambda header, action: StallNamingHandle(
                    owner=self.name, action=action, deadline=self.deadline,
                    stalled=lambda exc: self._stalled(state, op, exc)))
            if not posted:
                return handle
            op = _SendOp(handle, header, data, len(pieces), len(pieces), src, staging, ready)
            state.sends.add(op)
            # Enqueued under the peer lock so the per-link order is the sequence order.
            for p, (offset, length) in enumerate(pieces):
                state.links[link_of(header.seq, p, len(state.links))].queue.put((op, offset, length))
        return handle

    def irecv(self, tensor: torch.Tensor, peer: int, *, microbatch: int, kind: str) -> Handle:
        state = self._posting_peer(peer)
        header = header_for(self._receivable(tensor), seq=0, microbatch=microbatch, kind=kind)
        staging = posted = None
        if not tensor.is_cuda:
            view = memoryview(as_bytes(tensor).numpy())
        elif header.nbytes:
            staging, posted = self._staging.receive_buffer(tensor)
            view = memoryview(staging.numpy())
        else:
            view = memoryview(bytearray())  # zero-size GPU tensor: nothing lands
        with state.cond:
            header, handle, ok = self._number(
                state, header, peer, send=False, make_handle=lambda header, action: StallNamingHandle(
                    owner=self.name, action=action, deadline=self.deadline,
                    stalled=lambda exc: self._stalled(state, op, exc),
                    finish=(lambda: HostStaging.join(op.dest, op.copied)) if staging is not None else None))
            op = _RecvOp(header, view, tensor, staging, posted)
            op.handle = handle
            if not ok:
                return handle
            state.recvs[header.seq] = op
            state.cond.notify_all()
        return op.handle

    # ------------------------------------------------------------ I/O threads

    def _sender_loop(self, peer: _TcpPeer, link: Link) -> None:
        while True:
            item = link.queue.get()
            if item is None:
                return
            op, offset, length = item
            with peer.cond:
                failed = peer.error
                if failed is None:
                    op.inflight += 1
            if failed is not None:
                op.handle.set_failed(failed)  # a piece that will never be written
                continue
            try:
                if op.ready is not None:
                    op.ready.synchronize()
                head = encode_header(op.header.piece(offset, length, op.npieces))
                if link.mac is not None:
                    link.mac.send_frame(link.sock, head, op.data[offset:offset + length])
                elif length <= _COALESCE_BYTES:
                    link.sock.sendall(head + op.data[offset:offset + length])
                else:
                    link.sock.sendall(head)
                    link.sock.sendall(op.data[offset:offset + length])
            except Exception as exc:
                if isinstance(exc, OSError):
                    error = PeerLost(f"connection to {peer.name} lost while sending {op.header.describe()}: {exc}",
                                     peer.rank)
                else:  # a CUDA failure while staging: the stream is now out of step
                    error = ChannelError(f"{self.name} failed to stage {op.header.describe()} for {peer.name}: {exc}")
                self._fail_peer(peer, error)
                op.handle.set_failed(peer.error or error)
                continue
            link.last_activity = time.monotonic()
            with peer.cond:
                op.sent.add(link.index)
                op.inflight -= 1
                op.remaining -= 1
                finished = op.remaining == 0
                if finished:
                    peer.sends.discard(op)
            if finished:
                if op.staging is not None:
                    self._staging.sent(op.staging)
                op.handle.set_done()

    def _receiver_loop(self, peer: _TcpPeer, link: Link) -> None:
        # With message MACs the header's tag follows it, checked before the header is believed.
        head = bytearray(HEADER_SIZE + (TAG_SIZE if link.mac is not None else 0))
        try:
            while True:
                got = recv_exact(link.sock, memoryview(head))
                if got == 0:
                    # A peer closes all its connections at once, but their
                    # EOFs race with data still buffered on sibling
                    # connections: only the last EOF fails what is pending.
                    with peer.cond:
                        peer.closed.add(link.index)
                        peer.first_close = peer.first_close or time.monotonic()
                        if len(peer.closed) < len(peer.links):
                            return  # the others close too, or go silent (_watch_links)
                    raise PeerLost(f"connection to {peer.name} lost: the peer closed the connection", peer.rank)
                if got < len(head):
                    raise ChannelError(f"connection to {peer.name} closed mid-message: received {got} of "
                                       f"{len(head)} header bytes")
                if link.mac is not None:
                    link.mac.open_header(memoryview(head))
                header = decode_header(memoryview(head)[:HEADER_SIZE], sender=peer.name)
                op = self._await_recv(peer, header)
                if op is None:
                    return
                error = op.error
                if error is None:
                    try:
                        check_header(header, op.expected, receiver=self.name, sender=peer.name)
                    except ChannelError as exc:
                        error = exc
                if op.npieces is not None and op.npieces != header.npieces:
                    raise ChannelError(f"{peer.name} sent {header.describe()} in {header.npieces} pieces "
                                       f"after announcing {op.npieces}: the stream is out of step")
                op.npieces = header.npieces
                if error is None:
                    view = op.view[header.offset:header.offset + header.length]
                    got = recv_exact(link.sock, view) if link.mac is None else link.mac.recv_payload(link.sock, view)
                else:
                    got = _drain(link.sock, header.length, link.mac)
                if got < header.length:
                    raise ChannelError(f"connection to {peer.name} closed mid-message: received {got} of "
                                       f"{header.length} bytes of {header.describe()}")
                link.last_activity = time.monotonic()
                if link.mac is not None:
                    link.mac.close_payload(link.sock)  # the piece counts only once its bytes are proven
                self._piece_received(peer, op, header, error, link.index)
        except ChannelError as exc:
            self._fail_peer(peer, exc)
        except OSError as exc:
            self._fail_peer(peer, PeerLost(f"connection to {peer.name} lost: {exc}", peer.rank))

    def _await_recv(self, peer: _TcpPeer, header: FrameHeader) -> _RecvOp | None:
        """The posted irecv a piece belongs to; blocks (leaving bytes in the socket) until it is posted."""
        with peer.cond:
            while True:
                if peer.error is not None:
                    return None
                op = peer.recvs.get(header.seq)
                if op is not None:
                    return op
                if header.seq < peer.recv_seq:
                    raise ChannelError(f"{peer.name} sent a piece of message #{header.seq} "
                                       f"({header.describe()}) after it was complete: the stream is out of step")
                peer.cond.wait(1.0)

    def _piece_received(self, peer: _TcpPeer, op: _RecvOp, header: FrameHeader,
                        error: ChannelError | None, link: int) -> None:
        with peer.cond:
            if error is not None and op.error is None:
                op.error = error
            op.arrived.add(link)
            if op.first_piece is None:
                op.first_piece = time.monotonic()
            op.seen += 1
            if op.seen < (op.npieces or 1) or peer.recvs.get(header.seq) is not op:
                return
            del peer.recvs[header.seq]
        if op.error is not None:
            op.handle.set_failed(op.error)
            return
        if op.staging is not None:
            try:
                op.copied = self._staging.land(op.staging, op.dest, op.posted)
            except Exception as exc:  # CUDA error: report it on the handle, keep the connection
                op.handle.set_failed(ChannelError(
                    f"{self.name} failed to copy {header.describe()} from {peer.name} to the GPU: {exc}"))
                return
        op.handle.set_done()

    def _stalled(self, peer: _TcpPeer, op: _SendOp | _RecvOp, exc: ChannelTimeout) -> ChannelTimeout:
        """``exc`` (a wait that timed out on ``op``) as :class:`LinkStalled` naming the
        links that still owe ``op`` a piece, where another link shows the peer was sending."""
        report = self._stall_report(peer, op)
        return LinkStalled(f"{exc}: {report}", peer.rank) if report else exc

    def _stall_report(self, peer: _TcpPeer, op: _SendOp | _RecvOp) -> str | None:
        """:func:`~hetpipe.comm.tcp_links.stall_report` for ``op``: the links that owe it a piece, or None."""
        incoming = isinstance(op, _RecvOp)
        with peer.cond:
            done = set(op.arrived if incoming else op.sent)
        return stall_report(peer.links, op.expected if incoming else op.header, done, incoming=incoming)

    def _watch_links(self, peer: _TcpPeer) -> None:
        """Fail ``peer`` with :class:`LinkStalled` once a receive has had some of its
        pieces for ``_stall_s`` but not the rest: the sender queued them together,
        so the missing ones sit on a link that stopped. Ahead of the deadline, so
        the stalled link is the job's reported cause, not the timeouts it causes
        on other ranks. Likewise a peer lost behind a dead link (:func:`half_closed_report`)."""
        with peer.cond:
            while peer.error is None:
                peer.cond.wait(min(1.0, self._stall_s / 4))
                now = time.monotonic()
                late = [op for op in peer.recvs.values()
                        if op.first_piece is not None and now - op.first_piece > self._stall_s]
                half_closed = peer.first_close is not None and now - peer.first_close > self._stall_s
                if (late or half_closed) and peer.error is None:
                    peer.cond.release()  # the reports and _fail_peer take the lock themselves
                    try:
                        error = (self._late(peer, late[0], now) if late else None) or (PeerLost(
                            f"connection to {peer.name} lost: {half_closed_report(peer.links, peer.closed)}",
                            peer.rank) if half_closed else None)
                        if error is not None:
                            # Evident with nothing pending too: the ranks of both nodes may be in a
                            # collective over the dead link, which names nobody when it times out.
                            self._fail_peer(peer, error, evident=True)
                    finally:
                        peer.cond.acquire()

    def _late(self, peer: _TcpPeer, op: _RecvOp, now: float) -> LinkStalled | None:
        report = self._stall_report(peer, op)
        return None if report is None else LinkStalled(
            f"{self.name} waited {now - op.first_piece:.1f} s for the rest of {op.expected.describe()} from "
            f"{peer.name}: {report}", peer.rank)

    # ------------------------------------------------------- failure, close

    def _abandon(self, peer: _TcpPeer) -> list[CompletionHandle]:
        # A piece being written right now is left to its sender thread: if
        # the write completes the bytes were delivered to the kernel before
        # the peer went away (a peer may close right after its last
        # receive), otherwise the shut-down socket makes the write fail.
        # Staging buffers of failed transfers are dropped, not pooled: an I/O
        # thread may still be writing into one until its socket is shut down.
        pending = [op.handle for op in peer.recvs.values()] + \
                  [op.handle for op in peer.sends if op.inflight == 0]
        peer.recvs.clear()
        peer.sends.clear()
        return pending

    def _disconnect(self, peer: _TcpPeer) -> None:
        for link in peer.links:
            link.queue.put(None)
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _release(self) -> None:
        for peer in self._peers.values():
            for link in peer.links:
                link.sock.close()


def build_channel(rank: int, group: list[int], *, names: Mapping[int, str], store: dist.Store,
                  cluster: ClusterConfig, token: str, device: torch.device, addresses: list[str],
                  **_: object) -> TcpChannel:
    """The transport registry's builder (hetpipe/pipeline/transports.py): this kind's channel
    to ``group`` from the cluster config, as comm/factory.py builds every cross-vendor one."""
    t = cluster.transport
    return TcpChannel(rank, group, dict(names), store, token=token, addresses=addresses,
                      streams_per_address=t.streams_per_address, deadline=t.deadline_s, device=device,
                      message_mac=t.message_mac)
