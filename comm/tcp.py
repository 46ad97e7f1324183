"""CPU-forwarding boundary channel over plain TCP, striped across NICs.

This is the transport a mixed AMD + NVIDIA cluster can always use: no vendor
library spans both, but every host has sockets. GPU tensors are staged through
pinned host memory (device -> pinned host -> network -> pinned host -> device).
The joint AMD+NVIDIA training study this project follows measured gloo
CPU-forwarding at 160.8 TFLOP/s/GPU and 236.5 once each GPU had its own NIC, so
this channel opens ``len(addresses) * streams_per_address`` connections per
peer, each bound to its own local address, and cuts every large message into
one contiguous piece per connection.

Threads, not the compute thread, touch the network: each connection has a
sender thread (FIFO queue of pieces) and a receiver thread (reads a header,
waits until the matching ``irecv`` is posted, then ``recv_into`` straight into
the destination memory). A message that arrives before its ``irecv`` is left
in the socket, so TCP flow control, not an unbounded buffer, holds the sender
back. Every handle has a deadline, a lost peer fails every pending handle for
it, and ``close`` stops all threads promptly.

Connections are authenticated: the connecting side (the lower rank of each
pair) presents the job token, which the accepting side checks with
:func:`hmac.compare_digest` before it trusts anything else the peer says.

The GPU staging path (pinned buffers, side CUDA streams, events) is written
for CUDA and ROCm builds of torch but is not exercised in CI, which has no GPU.
"""
from __future__ import annotations

import hmac
import json
import logging
import queue
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from hetpipe.comm.channel import (
    HEADER_SIZE,
    MAGIC,
    VERSION,
    Channel,
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

log = logging.getLogger(__name__)

# Handshake sent by the connecting side: magic, version, rank, stream index,
# total streams, token length; then the token bytes.
_HELLO = struct.Struct("<4sHiHHI")
# Handshake answer: magic, verdict.
_REPLY = struct.Struct("<4sB")
REPLY_SIZE = _REPLY.size
_ACCEPT, _REFUSE_TOKEN, _REFUSE_UNEXPECTED = 0, 1, 2
ACCEPTED_REPLY = _REPLY.pack(MAGIC, _ACCEPT)

MAX_TOKEN_BYTES = 4096
# A connection that has not finished its hello by then is dropped, so a
# half-open or silent client cannot hold an acceptor slot forever.
_HANDSHAKE_SECONDS = 10.0
# Below this, striping costs more syscalls than it saves.
MIN_PIECE_BYTES = 256 * 1024
# Pieces up to this size go out in one send together with their header.
_COALESCE_BYTES = 64 * 1024
_DRAIN_CHUNK = 1 << 20
_JOIN_SECONDS = 2.0
# Free pinned buffers kept per size; activations repeat the same few sizes.
_POOL_PER_SIZE = 4


def endpoint_key(rank: int) -> str:
    """The store key under which ``rank`` publishes its listening endpoints."""
    return f"hetpipe/tcp/{rank}"


def encode_hello(rank: int, stream: int, nstreams: int, token: str) -> bytes:
    """The connecting side's handshake (exposed so tests can play a rogue peer)."""
    raw = token.encode()
    return _HELLO.pack(MAGIC, VERSION, rank, stream, nstreams, len(raw)) + raw


def lookup_endpoints(store: dist.Store, rank: int, timeout: float) -> tuple[int, list[tuple[str, int]]]:
    """(streams_per_address, [(host, port), ...]) that ``rank`` published, waiting up to ``timeout``."""
    key = endpoint_key(rank)
    try:
        store.wait([key], timedelta(seconds=max(timeout, 0.001)))
        raw = store.get(key)
    except RuntimeError as exc:  # torch's DistStoreError on timeout
        raise ChannelTimeout(f"no channel endpoints published under {key!r} within {timeout:g} s: {exc}") from exc
    try:
        info = json.loads(raw.decode())
        return int(info["streams_per_address"]), [(str(h), int(p)) for h, p in info["endpoints"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ChannelError(f"malformed channel endpoints under {key!r}: {raw[:200]!r}") from exc


def split_pieces(nbytes: int, nlinks: int) -> list[tuple[int, int]]:
    """Contiguous (offset, length) pieces, one per connection, none under MIN_PIECE_BYTES unless alone."""
    count = max(1, min(nlinks, nbytes // MIN_PIECE_BYTES))
    base, extra = divmod(nbytes, count)
    pieces, offset = [], 0
    for j in range(count):
        length = base + (1 if j < extra else 0)
        pieces.append((offset, length))
        offset += length
    return pieces


def _tune(sock: socket.socket) -> None:
    """Small headers must not wait for Nagle; dead hosts must be noticed by keepalive."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def recv_exact(sock: socket.socket, view: memoryview) -> int:
    """Fill ``view``; return how many bytes arrived before EOF (len(view) when complete)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            break
        got += n
    return got


def _drain(sock: socket.socket, nbytes: int) -> int:
    """Read and discard ``nbytes`` so the stream stays in step after a rejected piece."""
    scratch = memoryview(bytearray(min(nbytes, _DRAIN_CHUNK)))
    got = 0
    while got < nbytes:
        n = sock.recv_into(scratch[:min(len(scratch), nbytes - got)])
        if n == 0:
            break
        got += n
    return got


class _PinnedPool:
    """Reusable pinned host buffers for staging GPU tensors (not exercised in CI).

    A buffer goes back with the CUDA event after which it is free; it is handed
    out again only once that event has completed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            entries = self._free.get(nbytes, [])
            for i, (buf, ready) in enumerate(entries):
                if ready is None or ready.query():
                    del entries[i]
                    return buf
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def release(self, buf: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        with self._lock:
            entries = self._free.setdefault(buf.numel(), [])
            if len(entries) < _POOL_PER_SIZE:
                entries.append((buf, ready))


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
    handle: CompletionHandle = field(init=False)


@dataclass(eq=False)
class _Link:
    """One TCP connection to a peer; piece j of every striped message uses link j."""

    sock: socket.socket
    index: int
    queue: "queue.SimpleQueue[tuple[_SendOp, int, int] | None]" = field(default_factory=queue.SimpleQueue)
    threads: list[threading.Thread] = field(default_factory=list)


@dataclass(eq=False)
class _Peer:
    rank: int
    name: str
    links: list[_Link] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)
    send_seq: int = 0
    recv_seq: int = 0
    closed_links: int = 0
    recvs: dict[int, _RecvOp] = field(default_factory=dict)
    sends: set[_SendOp] = field(default_factory=set)
    error: ChannelError | None = None


class SocketRendezvous:
    """Listening sockets, rendezvous through the job's store and the token
    handshake, shared by the socket-based channels (this one and the
    device-direct channel's control connections). A subclass sets ``rank``,
    ``peers``, ``name``, ``deadline``, ``addresses``, ``streams_per_address``,
    ``nstreams`` and ``_token`` before calling :meth:`_rendezvous`.
    """

    def _rendezvous(self, store: dist.Store) -> dict[tuple[int, int], socket.socket]:
        """Authenticated connections to every peer, keyed (peer, stream index):
        publish this rank's endpoints in ``store``, accept from lower ranks and
        connect to higher ones, all within ``self.deadline``."""
        until = time.monotonic() + self.deadline
        listeners: list[socket.socket] = []
        sockets: dict[tuple[int, int], socket.socket] = {}
        try:
            listeners = self._listen()
            store.set(endpoint_key(self.rank), json.dumps({
                "streams_per_address": self.streams_per_address,
                "endpoints": [list(s.getsockname()[:2]) for s in listeners]}))
            acceptor = _Acceptor(self, listeners, [p for p in self.peers if p < self.rank], until)
            acceptor.start()
            try:
                for peer in (p for p in self.peers if p > self.rank):
                    for j, sock in enumerate(self._connect(store, peer, until)):
                        sockets[(peer, j)] = sock
            except BaseException:
                acceptor.abort()
                raise
            sockets.update(acceptor.finish(until))
        except BaseException:
            for sock in sockets.values():
                sock.close()
            raise
        finally:
            for sock in listeners:
                sock.close()
        return sockets

    def _listen(self) -> list[socket.socket]:
        listeners = []
        try:
            for address in self.addresses:
                family, kind, proto, _, sockaddr = socket.getaddrinfo(
                    address, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
                sock = socket.socket(family, kind, proto)
                listeners.append(sock)
                sock.bind(sockaddr)
                sock.listen(128)
                sock.setblocking(False)
        except OSError as exc:
            for sock in listeners:
                sock.close()
            raise ChannelError(f"{self.name} cannot listen on {address}: {exc}") from exc
        return listeners

    def _connect(self, store: dist.Store, peer: int, until: float) -> list[socket.socket]:
        """Open and authenticate this rank's connections to a higher-ranked peer."""
        peer_name = self.name_of(peer)
        streams, endpoints = lookup_endpoints(store, peer, until - time.monotonic())
        if streams != self.streams_per_address or len(endpoints) != len(self.addresses):
            raise ChannelError(
                f"{self.name} uses {len(self.addresses)} addresses x {self.streams_per_address} streams but "
                f"{peer_name} uses {len(endpoints)} x {streams}: configure the same on every rank")
        sockets: list[socket.socket] = []
        try:
            for j in range(self.nstreams):
                a = j % len(self.addresses)
                sock = self._dial(self.addresses[a], endpoints[a], peer_name, until)
                sockets.append(sock)
                self._handshake(sock, j, peer_name, until)
        except BaseException:
            for sock in sockets:
                sock.close()
            raise
        return sockets

    def _dial(self, local: str, remote: tuple[str, int], peer_name: str, until: float) -> socket.socket:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(remote[0], remote[1], type=socket.SOCK_STREAM)[0]
        delay = 0.02
        while True:
            sock = socket.socket(family, kind, proto)
            try:
                # Binding the source address is what pins the stream to one NIC.
                sock.bind((local, 0) if family == socket.AF_INET else (local, 0, 0, 0))
                sock.settimeout(max(until - time.monotonic(), 0.001))
                sock.connect(sockaddr)
                _tune(sock)
                return sock
            except ConnectionRefusedError as exc:
                sock.close()
                if time.monotonic() + delay >= until:
                    raise ChannelTimeout(f"{self.name} could not connect to {peer_name} at "
                                         f"{remote[0]}:{remote[1]} within {self.deadline:g} s: {exc}") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
            except socket.timeout as exc:
                sock.close()
                raise ChannelTimeout(f"{self.name} timed out connecting to {peer_name} at "
                                     f"{remote[0]}:{remote[1]}") from exc
            except OSError as exc:
                sock.close()
                raise ChannelError(f"{self.name} cannot connect from {local} to {peer_name} at "
                                   f"{remote[0]}:{remote[1]}: {exc}") from exc

    def _handshake(self, sock: socket.socket, stream: int, peer_name: str, until: float) -> None:
        try:
            sock.settimeout(max(until - time.monotonic(), 0.001))
            sock.sendall(encode_hello(self.rank, stream, self.nstreams, self._token.decode()))
            reply = bytearray(REPLY_SIZE)
            got = recv_exact(sock, memoryview(reply))
        except socket.timeout as exc:
            raise ChannelTimeout(f"{self.name} timed out in the handshake with {peer_name}") from exc
        except OSError as exc:
            raise ChannelError(f"{self.name} lost {peer_name} during the handshake: {exc}") from exc
        if got < REPLY_SIZE:
            raise ChannelError(f"peer {peer_name} closed the connection during the handshake")
        magic, verdict = _REPLY.unpack(reply)
        if magic != MAGIC:
            raise ChannelError(f"peer {peer_name} answered the handshake with magic {bytes(magic)!r}: "
                               "not a hetpipe channel")
        if verdict == _REFUSE_TOKEN:
            raise ChannelError(f"peer {peer_name} refused the connection: wrong job token")
        if verdict != _ACCEPT:
            raise ChannelError(
                f"peer {peer_name} refused the connection: it does not expect stream {stream} of "
                f"{self.nstreams} from {self.name} (check that both list each other as peers and use "
                "the same addresses and streams_per_address)")


class TcpChannel(Channel, SocketRendezvous):
    """Boundary channel that forwards through host memory over striped TCP connections.

    ``addresses`` are this rank's local addresses (one per NIC); every rank of
    the job must configure the same number of addresses and the same
    ``streams_per_address``. Connection j of each peer pair goes from local
    address ``j % len(addresses)`` to the peer's address of the same index.
    ``deadline`` bounds the rendezvous and is every ``wait``'s default.
    ``device`` (optional) is the GPU this rank's boundary tensors live on; its
    side streams are created up front rather than on first use.
    """

    def __init__(self, rank: int, peers: list[int], names: dict[int, str], store: dist.Store, token: str,
                 addresses: Sequence[str] = ("127.0.0.1",), streams_per_address: int = 1,
                 deadline: float = 300.0, device: torch.device | None = None) -> None:
        super().__init__(rank, peers, names, deadline)
        if not token:
            raise ChannelError("TcpChannel needs a non-empty job token")
        if len(token.encode()) > MAX_TOKEN_BYTES:
            raise ChannelError(f"job token is longer than {MAX_TOKEN_BYTES} bytes")
        if not addresses:
            raise ChannelError("TcpChannel needs at least one local address")
        if streams_per_address < 1:
            raise ChannelError(f"streams_per_address must be >= 1, got {streams_per_address}")
        self.addresses = list(addresses)
        self.streams_per_address = int(streams_per_address)
        self.nstreams = len(self.addresses) * self.streams_per_address
        self._token = token.encode()
        self._lock = threading.Lock()
        self._closing = False
        self._peers = {p: _Peer(p, self.name_of(p)) for p in self.peers}
        self._pool = _PinnedPool()
        self._streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type == "cuda":
            self._side_stream(self.device, "send")
            self._side_stream(self.device, "recv")

        sockets = self._rendezvous(store)
        for (peer, j), sock in sorted(sockets.items()):
            sock.settimeout(None)
            self._peers[peer].links.append(_Link(sock, j))
        for state in self._peers.values():
            for link in state.links:
                for target, role in ((self._sender_loop, "send"), (self._receiver_loop, "recv")):
                    thread = threading.Thread(target=target, args=(state, link), daemon=True,
                                              name=f"hetpipe-tcp-{role}-{rank}-{state.rank}-{link.index}")
                    link.threads.append(thread)
                    thread.start()

    def _side_stream(self, device: torch.device, role: str) -> torch.cuda.Stream:
        """One side stream per device and direction, so staging copies overlap compute."""
        key = (device, role)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None:
                stream = self._streams[key] = torch.cuda.Stream(device=device)
            return stream

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
            staging, ready = self._stage_out(src)
            data = memoryview(staging.numpy())
        else:
            data = memoryview(b"")  # zero-size GPU tensor: header only
        pieces = split_pieces(header.nbytes, len(state.links))
        with state.cond:
            header = replace(header, seq=state.send_seq)
            handle = CompletionHandle(owner=self.name, action=self.send_action(header, peer), deadline=self.deadline)
            if state.error is not None:
                handle.set_failed(state.error)
                return handle
            state.send_seq += 1
            op = _SendOp(handle, header, data, len(pieces), len(pieces), src, staging, ready)
            state.sends.add(op)
            # Enqueued under the peer lock so the per-link order is the sequence order.
            for link, (offset, length) in zip(state.links, pieces):
                link.queue.put((op, offset, length))
        return handle

    def irecv(self, tensor: torch.Tensor, peer: int, *, microbatch: int, kind: str) -> Handle:
        state = self._posting_peer(peer)
        if not tensor.is_contiguous():
            raise ChannelError(f"{self.name} cannot receive into a non-contiguous tensor "
                               f"(shape {list(tensor.shape)}, strides {tensor.stride()})")
        header = header_for(tensor, seq=0, microbatch=microbatch, kind=kind)
        staging = posted = None
        if not tensor.is_cuda:
            view = memoryview(as_bytes(tensor).numpy())
        elif header.nbytes:
            staging = self._pool.acquire(header.nbytes)
            view = memoryview(staging.numpy())
            # The copy into ``tensor`` must come after whatever the caller's
            # stream still does with it.
            posted = torch.cuda.Event()
            posted.record(torch.cuda.current_stream(tensor.device))
            tensor.record_stream(self._side_stream(tensor.device, "recv"))
        else:
            view = memoryview(bytearray())  # zero-size GPU tensor: nothing lands
        with state.cond:
            header = replace(header, seq=state.recv_seq)
            op = _RecvOp(header, view, tensor, staging, posted)
            op.handle = CompletionHandle(owner=self.name, action=self.recv_action(header, peer),
                                         deadline=self.deadline,
                                         finish=(lambda: self._join_copy(op)) if staging is not None else None)
            if state.error is not None:
                op.handle.set_failed(state.error)
                return op.handle
            state.recv_seq += 1
            state.recvs[header.seq] = op
            state.cond.notify_all()
        return op.handle

    def _stage_out(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Copy a GPU tensor to pinned host memory on a side stream (not exercised in CI)."""
        staging = self._pool.acquire(src.numel() * src.element_size())
        side = self._side_stream(src.device, "send")
        side.wait_stream(torch.cuda.current_stream(src.device))
        # blocking=True: the I/O thread sleeps in synchronize() instead of spinning.
        ready = torch.cuda.Event(blocking=True)
        with torch.cuda.stream(side):
            staging.copy_(as_bytes(src), non_blocking=True)
            ready.record(side)
        src.record_stream(side)
        return staging, ready

    def _land(self, op: _RecvOp) -> None:
        """Start the host-to-device copy of a completed GPU receive (I/O thread; not exercised in CI)."""
        device = op.dest.device
        side = self._side_stream(device, "recv")
        with torch.cuda.device(device), torch.cuda.stream(side):
            side.wait_event(op.posted)
            as_bytes(op.dest).copy_(op.staging, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        op.copied = copied
        self._pool.release(op.staging, copied)

    @staticmethod
    def _join_copy(op: _RecvOp) -> None:
        # The caller's stream, not the host, waits for the host-to-device copy.
        torch.cuda.current_stream(op.dest.device).wait_event(op.copied)

    # ------------------------------------------------------------ I/O threads

    def _sender_loop(self, peer: _Peer, link: _Link) -> None:
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
                if length <= _COALESCE_BYTES:
                    link.sock.sendall(head + op.data[offset:offset + length])
                else:
                    link.sock.sendall(head)
                    link.sock.sendall(op.data[offset:offset + length])
            except Exception as exc:
                if isinstance(exc, OSError):
                    error = ChannelError(f"connection to {peer.name} lost while sending {op.header.describe()}: {exc}")
                else:  # a CUDA failure while staging: the stream is now out of step
                    error = ChannelError(f"{self.name} failed to stage {op.header.describe()} for {peer.name}: {exc}")
                self._fail_peer(peer, error)
                op.handle.set_failed(peer.error or error)
                continue
            with peer.cond:
                op.inflight -= 1
                op.remaining -= 1
                finished = op.remaining == 0
                if finished:
                    peer.sends.discard(op)
            if finished:
                if op.staging is not None:
                    self._pool.release(op.staging)
                op.handle.set_done()

    def _receiver_loop(self, peer: _Peer, link: _Link) -> None:
        head = bytearray(HEADER_SIZE)
        try:
            while True:
                got = recv_exact(link.sock, memoryview(head))
                if got == 0:
                    # A peer closes all its connections at once, but their
                    # EOFs race with data still buffered on sibling
                    # connections: only the last EOF fails what is pending.
                    with peer.cond:
                        peer.closed_links += 1
                        if peer.closed_links < len(peer.links):
                            return
                    raise ChannelError(f"connection to {peer.name} lost: the peer closed the connection")
                if got < HEADER_SIZE:
                    raise ChannelError(f"connection to {peer.name} closed mid-message: received {got} of "
                                       f"{HEADER_SIZE} header bytes")
                header = decode_header(head, sender=peer.name)
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
                    got = recv_exact(link.sock, op.view[header.offset:header.offset + header.length])
                else:
                    got = _drain(link.sock, header.length)
                if got < header.length:
                    raise ChannelError(f"connection to {peer.name} closed mid-message: received {got} of "
                                       f"{header.length} bytes of {header.describe()}")
                self._piece_received(peer, op, header, error)
        except ChannelError as exc:
            self._fail_peer(peer, exc)
        except OSError as exc:
            self._fail_peer(peer, ChannelError(f"connection to {peer.name} lost: {exc}"))

    def _await_recv(self, peer: _Peer, header: FrameHeader) -> _RecvOp | None:
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

    def _piece_received(self, peer: _Peer, op: _RecvOp, header: FrameHeader, error: ChannelError | None) -> None:
        with peer.cond:
            if error is not None and op.error is None:
                op.error = error
            op.seen += 1
            if op.seen < (op.npieces or 1) or peer.recvs.get(header.seq) is not op:
                return
            del peer.recvs[header.seq]
        if op.error is not None:
            op.handle.set_failed(op.error)
            return
        if op.staging is not None:
            try:
                self._land(op)
            except Exception as exc:  # CUDA error: report it on the handle, keep the connection
                op.handle.set_failed(ChannelError(
                    f"{self.name} failed to copy {header.describe()} from {peer.name} to the GPU: {exc}"))
                return
        op.handle.set_done()

    def _fail_peer(self, peer: _Peer, error: ChannelError) -> None:
        """Fail every pending transfer with ``peer`` and tear its connections down (first error wins)."""
        with peer.cond:
            if peer.error is not None:
                return
            if self._closing:
                error = ChannelError(f"{self.name} closed its channel to {peer.name}")
            peer.error = error
            # A piece being written right now is left to its sender thread: if
            # the write completes the bytes were delivered to the kernel before
            # the peer went away (a peer may close right after its last
            # receive), otherwise the shut-down socket makes the write fail.
            pending = [op.handle for op in peer.recvs.values()] + \
                      [op.handle for op in peer.sends if op.inflight == 0]
            peer.recvs.clear()
            peer.sends.clear()
            peer.cond.notify_all()
        if pending and not self._closing:
            log.error("%s", error)
        # Staging buffers of failed transfers are dropped, not pooled: an I/O
        # thread may still be writing into one until its socket is shut down.
        for handle in pending:
            handle.set_failed(error)
        for link in peer.links:
            link.queue.put(None)
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._closing = True
        for peer in self._peers.values():
            self._fail_peer(peer, ChannelError(f"{self.name} closed its channel"))
        until = time.monotonic() + _JOIN_SECONDS
        for peer in self._peers.values():
            for link in peer.links:
                for thread in link.threads:
                    thread.join(max(until - time.monotonic(), 0.0))
                link.sock.close()


class _Acceptor(threading.Thread):
    """Accepts and authenticates the connections lower-ranked peers open to this rank.

    One selector loop over the listeners and every half-finished handshake, so
    garbage, silent or wrong-token clients never delay the legitimate peer.
    """

    def __init__(self, channel: TcpChannel, listeners: list[socket.socket], peers: list[int], until: float):
        super().__init__(daemon=True, name=f"hetpipe-tcp-accept-{channel.rank}")
        self.channel = channel
        self.listeners = listeners
        self.expected = {(p, j) for p in peers for j in range(channel.nstreams)}
        self.until = until
        self.accepted: dict[tuple[int, int], socket.socket] = {}
        self.error: ChannelError | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        pending: dict[socket.socket, tuple[bytearray, float]] = {}
        try:
            for sock in self.listeners:
                sel.register(sock, selectors.EVENT_READ, None)
            while self.expected - self.accepted.keys() and not self._halt.is_set():
                now = time.monotonic()
                if now >= self.until:
                    self.error = self._timeout_error()
                    return
                for key, _ in sel.select(min(0.2, self.until - now)):
                    if key.data is None:
                        self._accept(key.fileobj, sel, pending)
                    else:
                        self._read_hello(key.fileobj, sel, pending)
                for sock, (_, started) in list(pending.items()):
                    if time.monotonic() - started > _HANDSHAKE_SECONDS:
                        self._drop(sock, sel, pending)
        except Exception as exc:  # never leave the constructor waiting on a dead thread
            self.error = ChannelError(f"{self.channel.name} failed while accepting connections: {exc}")
        finally:
            for sock in list(pending):
                self._drop(sock, sel, pending)
            sel.close()

    def finish(self, until: float) -> dict[tuple[int, int], socket.socket]:
        """Wait for the loop, then hand over the authenticated sockets or raise its error."""
        self.join(max(until - time.monotonic(), 0.0) + 1.0)
        self._halt.set()
        self.join(1.0)
        if self.error is None and self.expected - self.accepted.keys():
            self.error = self._timeout_error()
        if self.error is not None:
            self.abort()
            raise self.error
        return dict(self.accepted)

    def abort(self) -> None:
        """Stop accepting and close whatever was accepted (setup failed elsewhere)."""
        self._halt.set()
        self.join(1.0)
        for sock in self.accepted.values():
            sock.close()

    def _timeout_error(self) -> ChannelTimeout:
        missing = sorted({p for p, _ in self.expected - self.accepted.keys()})
        return ChannelTimeout(
            f"{self.channel.name} waited {self.channel.deadline:g} s for "
            f"{', '.join(self.channel.name_of(p) for p in missing)} to connect "
            f"({len(self.accepted)} of {len(self.expected)} connections arrived)")

    def _accept(self, listener: socket.socket, sel: selectors.BaseSelector,
                pending: dict[socket.socket, tuple[bytearray, float]]) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of descriptors: keep serving the rest
                log.warning("%s: accept failed: %s", self.channel.name, exc)
                return
            conn.setblocking(False)
            pending[conn] = (bytearray(), time.monotonic())
            sel.register(conn, selectors.EVENT_READ, "hello")

    def _read_hello(self, conn: socket.socket, sel: selectors.BaseSelector,
                    pending: dict[socket.socket, tuple[bytearray, float]]) -> None:
        buf, _ = pending[conn]
        need = _HELLO.size if len(buf) < _HELLO.size else _HELLO.size + _HELLO.unpack(buf[:_HELLO.size])[5]
        try:
            # Read exactly what the hello still lacks: frames that follow belong to the receiver thread.
            chunk = conn.recv(need - len(buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn, sel, pending)
            return
        if not chunk:
            self._drop(conn, sel, pending)
            return
        buf += chunk
        if len(buf) < _HELLO.size:
            return
        magic, version, rank, stream, nstreams, token_len = _HELLO.unpack(buf[:_HELLO.size])
        if magic != MAGIC or version != VERSION or token_len > MAX_TOKEN_BYTES:
            self._drop(conn, sel, pending)  # not a hetpipe peer (or a garbage one)
            return
        if len(buf) < _HELLO.size + token_len:
            return
        token = bytes(buf[_HELLO.size:])
        if not hmac.compare_digest(token, self.channel._token):
            log.warning("%s refused a connection claiming to be rank %d: wrong job token",
                        self.channel.name, rank)
            self._answer(conn, _REFUSE_TOKEN)
            self._drop(conn, sel, pending)
            return
        slot = (rank, stream)
        if slot not in self.expected or slot in self.accepted or nstreams != self.channel.nstreams:
            self._answer(conn, _REFUSE_UNEXPECTED)
            self._drop(conn, sel, pending)
            return
        sel.unregister(conn)
        del pending[conn]
        if not self._answer(conn, _ACCEPT):
            conn.close()
            return
        conn.setblocking(True)
        _tune(conn)
        self.accepted[slot] = conn

    @staticmethod
    def _answer(conn: socket.socket, verdict: int) -> bool:
        try:
            # Five bytes fit any fresh socket's send buffer, so this never blocks.
            return conn.send(_REPLY.pack(MAGIC, verdict)) == REPLY_SIZE
        except OSError:
            return False

    @staticmethod
    def _drop(conn: socket.socket, sel: selectors.BaseSelector,
              pending: dict[socket.socket, tuple[bytearray, float]]) -> None:
        pending.pop(conn, None)
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
