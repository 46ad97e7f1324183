"""Device-direct boundary channel: a CPU control plane over TCP, a mover for the bytes.

The bytes of a boundary tensor never cross the control connection: a mover
(:mod:`hetpipe.comm.mover`) writes them straight into the receiver's
registered buffer (shared memory in CI, CUDA/HIP IPC between GPUs of one host,
Mooncake's transfer engine between hosts: RDMA, or its TCP transport in CI).
What remains is the hard part, and it lives here on the CPU:

* one authenticated TCP control connection per peer pair, set up with the
  same rendezvous and mutual-authentication handshake as
  :class:`~hetpipe.comm.tcp.TcpChannel` (:mod:`hetpipe.comm.rendezvous`). Its
  control messages carry no per-message MAC: with the shm and IPC movers both
  ends are on one host, where an attacker who can alter loopback traffic or
  shared memory owns the host (and the bytes never cross the control
  connection anyway); the Mooncake mover's data ports take writes without
  the token, like any RDMA endpoint, so across hosts the job's fabric must be
  trusted either way;
* a receive protocol in three small messages. Posting ``irecv`` takes a
  receive buffer from the registration cache (registering a new one only for
  a size not seen before) and sends ``READY seq, region, offset, expected
  header``. Once the matching ``isend`` is posted and its READY arrived, the
  sender checks the expected header against its own (a mismatch fails both
  handles with one message naming both stages), has the mover write, and
  sends ``DONE seq, signal`` (an IPC event handle for GPU movers). ``ERROR
  seq, text`` carries a rejected message's reason to the receiver;
* FIFO per ordered pair: both sides number messages in posting order and
  match by sequence number, exactly as torch P2P matches posts;
* completions and deadlines on :class:`CompletionHandle`; a lost peer fails
  every pending handle with it; ``close`` is prompt and idempotent
  (:mod:`hetpipe.comm.threaded`).

Each peer has two threads: a reader (control messages in) and a worker (the
only writer of the socket; it also runs the mover's writes, so a slow copy
never holds up reading and ``isend`` never blocks the compute thread).
"""
from __future__ import annotations

import queue
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.distributed as dist

from hetpipe.comm.channel import (
    HEADER_SIZE,
    MAGIC,
    ChannelError,
    CompletionHandle,
    FrameHeader,
    Handle,
    check_header,
    decode_header,
    encode_header,
    header_for,
)
from hetpipe.comm.handshake import check_token
from hetpipe.comm.ipc_mover import GpuIpcMover
from hetpipe.comm.mooncake_mover import MooncakeMover
from hetpipe.comm.mover import Landing, Mover, RegionHandle
from hetpipe.comm.rendezvous import connect_peers
from hetpipe.comm.shm_mover import ShmMover
from hetpipe.comm.sockets import recv_exact
from hetpipe.comm.threaded import PeerLost, PeerState, ThreadedChannel
from hetpipe.pipeline.transports import MOVERS

if TYPE_CHECKING:
    from hetpipe.devices.cluster import ClusterConfig

# Control message: magic, type, sequence number, payload length; then the payload.
_MSG = struct.Struct("<4sBQI")
_READY, _DONE, _ERROR = 1, 2, 3
# READY payload: offset into the region, then the encoded expected header, then the region handle.
_OFFSET = struct.Struct("<Q")
# A READY carries a header and a small JSON handle; anything larger is not a hetpipe peer.
_MAX_PAYLOAD = 1 << 16
# Free receive buffers kept per size; a pipeline repeats the same few activation sizes.
_CACHE_PER_SIZE = 4
# Keys live under their own prefix so a job can run TCP and direct channels side by side.
_STORE_PREFIX = "hetpipe/direct"


@dataclass
class _Buffer:
    tensor: torch.Tensor
    region: bytes
    landing: Landing | None = None


class _BufferCache:
    """Registered receive buffers by (device, size): registration is costly (ibv_reg_mr, IPC handles)."""

    def __init__(self, mover: Mover) -> None:
        self.mover = mover
        self._lock = threading.Lock()
        self._free: dict[tuple[str, int], list[_Buffer]] = {}

    def acquire(self, nbytes: int, device: torch.device) -> _Buffer:
        key = (str(device), nbytes)
        with self._lock:
            entries = self._free.get(key, [])
            for i, buf in enumerate(entries):
                if buf.landing is None or buf.landing.reusable():
                    del entries[i]
                    buf.landing = None
                    return buf
        tensor = self.mover.allocate(nbytes, device)
        return _Buffer(tensor, self.mover.register(tensor).to_bytes())

    def release(self, buf: _Buffer) -> None:
        with self._lock:
            entries = self._free.setdefault((str(buf.tensor.device), buf.tensor.numel()), [])
            if len(entries) < _CACHE_PER_SIZE:
                entries.append(buf)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


@dataclass(eq=False)
class _Send:
    handle: CompletionHandle
    header: FrameHeader
    tensor: torch.Tensor
    ready: Any


@dataclass(eq=False)
class _Recv:
    handle: CompletionHandle
    expected: FrameHeader
    dest: torch.Tensor
    buffer: _Buffer | None  # None for zero-size messages: nothing to register
    finish: Callable[[], None] | None = None  # set on DONE by GPU movers

    def run_finish(self) -> None:
        if self.finish is not None:
            self.finish()


@dataclass(frozen=True)
class _Ready:
    offset: int
    expected: FrameHeader
    region: bytes


@dataclass(eq=False, kw_only=True)
class _DirectPeer(PeerState):
    sock: socket.socket
    out: "queue.SimpleQueue[tuple[str, Any] | None]" = field(default_factory=queue.SimpleQueue)
    sends: dict[int, _Send] = field(default_factory=dict)
    readies: dict[int, _Ready] = field(default_factory=dict)
    recvs: dict[int, _Recv] = field(default_factory=dict)


def _message(kind: int, seq: int, payload: bytes = b"") -> bytes:
    return _MSG.pack(MAGIC, kind, seq, len(payload)) + payload


def _auto_mover(device: torch.device | None, address: str, deadline: float) -> Mover:
    """'auto' within one host: GPU IPC for a CUDA/ROCm device, shared memory for anything else."""
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        return GpuIpcMover(device)
    return ShmMover()


# Every name of hetpipe.pipeline.transports.MOVERS and how it is built; a new mover is one entry here (and its
# name in MOVERS). 'mooncake-*' is Mooncake's transfer engine over that protocol, reached at
# ``address`` (any two hosts).
_MOVER_MAKERS: dict[str, Callable[[torch.device | None, str, float], Mover]] = {
    "auto": _auto_mover,
    "shm": lambda device, address, deadline: ShmMover(),
    "ipc": lambda device, address, deadline: GpuIpcMover(device),
    "mooncake-tcp": lambda device, address, deadline: MooncakeMover(address=address, protocol="tcp",
                                                                    deadline=deadline, device=device),
    "mooncake-rdma": lambda device, address, deadline: MooncakeMover(address=address, protocol="rdma",
                                                                     deadline=deadline, device=device),
}


def make_mover(kind: str, device: torch.device | None, *, address: str = "127.0.0.1",
               deadline: float = 300.0) -> Mover:
    """The mover named ``kind``, one of :data:`~hetpipe.pipeline.transports.MOVERS` (see ``_MOVER_MAKERS``)."""
    maker = _MOVER_MAKERS.get(kind)
    if maker is None:
        raise ChannelError(f"unknown mover {kind!r}; expected one of {MOVERS}")
    return maker(device, address, deadline)


class DirectChannel(ThreadedChannel[_DirectPeer]):
    """Boundary channel whose bytes move through ``mover`` (:data:`~hetpipe.pipeline.transports.MOVERS`), controlled over TCP.

    ``store`` and ``token`` play the same roles as for TcpChannel (every rank
    of the job uses the same token). ``deadline`` bounds the rendezvous and is
    every ``wait``'s default. ``device`` is the device this rank's boundary
    tensors live on; with ``mover='auto'`` a GPU selects the GPU IPC mover,
    anything else shared memory. Both peers of a pair must be on one host for
    the shm and IPC movers. ``address`` is the local address of the control
    connections (and of the Mooncake engine).
    """

    def __init__(self, rank: int, peers: list[int], names: dict[int, str], store: dist.Store, token: str,
                 mover: str | Mover = "auto", deadline: float = 300.0, device: torch.device | None = None,
                 address: str = "127.0.0.1") -> None:
        super().__init__(rank, peers, names, deadline, transport="direct")
        secret = check_token(token, "DirectChannel")
        self.device = torch.device(device) if device is not None else None
        self.mover = mover if isinstance(mover, Mover) else make_mover(mover, self.device, address=address,
                                                                       deadline=self.deadline)
        self._cache = _BufferCache(self.mover)
        try:
            # One control connection per peer pair (stream 0); the prefix keeps
            # these endpoints apart from a TcpChannel's in the same store.
            sockets = connect_peers(dist.PrefixStore(_STORE_PREFIX, store), rank=rank, peers=self.peers,
                                    name_of=self.name_of, addresses=[address], streams_per_address=1,
                                    token=secret, deadline=self.deadline)
        except BaseException:
            self.mover.close()
            raise
        self._peers = {p: _DirectPeer(rank=p, name=self.name_of(p), sock=sockets[(p, 0)].sock) for p in self.peers}
        for state in self._peers.values():
            state.sock.settimeout(None)
            self._start_thread(state, "read", self._reader_loop)
            self._start_thread(state, "work", self._worker_loop)

    # -------------------------------------------------------------- posting

    def isend(self, tensor: torch.Tensor, peer: int, *, microbatch: int, kind: str) -> Handle:
        state = self._posting_peer(peer)
        src = tensor.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        header = header_for(src, seq=0, microbatch=microbatch, kind=kind)
        ready = self.mover.capture(src) if header.nbytes else None
        with state.cond:
            header, handle, posted = self._number(state, header, peer, send=True, make_handle=lambda header, action:
                                                  CompletionHandle(owner=self.name, action=action,
                                                                   deadline=self.deadline))
            if not posted:
                return handle
            op = _Send(handle, header, src, ready)
            answer = state.readies.pop(header.seq, None)
            if answer is None:
                state.sends[header.seq] = op
            else:
                state.out.put(("write", (op, answer)))
        return handle

    def irecv(self, tensor: torch.Tensor, peer: int, *, microbatch: int, kind: str) -> Handle:
        state = self._posting_peer(peer)
        header = header_for(self._receivable(tensor), seq=0, microbatch=microbatch, kind=kind)
        buffer = self._cache.acquire(header.nbytes, tensor.device) if header.nbytes else None
        with state.cond:
            # The mover's finish runs on the waiting thread (GPU stream ordering); it is known only at DONE.
            header, handle, posted = self._number(state, header, peer, send=False, make_handle=lambda header, action:
                                                  CompletionHandle(owner=self.name, action=action,
                                                                   deadline=self.deadline,
                                                                   finish=lambda: op.run_finish()))
            op = _Recv(handle, header, tensor, buffer)
            if not posted:
                if buffer is not None:
                    self._cache.release(buffer)
                return handle
            state.recvs[header.seq] = op
            region = buffer.region if buffer is not None else b""
            state.out.put(("send", _message(_READY, header.seq,
                                            _OFFSET.pack(0) + encode_header(header) + region)))
        return op.handle

    # ------------------------------------------------------------- threads

    def _worker_loop(self, peer: _DirectPeer) -> None:
        """The socket's only writer; also runs the mover for sends whose READY arrived."""
        while True:
            item = peer.out.get()
            if item is None:
                return
            what, payload = item
            try:
                if what == "send":
                    peer.sock.sendall(payload)
                else:
                    self._write(peer, *payload)
            except OSError as exc:
                self._fail_peer(peer, PeerLost(f"connection to {peer.name} lost: {exc}", peer.rank))
                if what == "write":
                    payload[0].handle.set_failed(peer.error or PeerLost(f"connection to {peer.name} lost", peer.rank))

    def _write(self, peer: _DirectPeer, op: _Send, answer: _Ready) -> None:
        try:
            check_header(op.header, answer.expected, receiver=peer.name, sender=self.name)
            if op.header.nbytes:
                region = self.mover.open_remote(RegionHandle.from_bytes(answer.region, sender=peer.name),
                                                sender=peer.name)
                if answer.offset + op.header.nbytes > region.handle.size:
                    raise ChannelError(f"{peer.name} offered {region.handle.size - answer.offset} bytes for "
                                       f"{op.header.describe()} ({op.header.nbytes} bytes)")
                completion = self.mover.write(op.tensor, region, answer.offset, op.ready)
                signal = completion.signal()
            else:
                completion, signal = None, b""
        except ChannelError as exc:
            # The receiver's handle fails with the same words; the stream goes on.
            op.handle.set_failed(exc)
            peer.sock.sendall(_message(_ERROR, op.header.seq, str(exc).encode()[:_MAX_PAYLOAD]))
            return
        except Exception as exc:  # a mover failure (CUDA error, mapping failed): same treatment
            error = ChannelError(f"{self.name} failed to write {op.header.describe()} to {peer.name}: {exc}")
            op.handle.set_failed(error)
            peer.sock.sendall(_message(_ERROR, op.header.seq, str(error).encode()[:_MAX_PAYLOAD]))
            return
        peer.sock.sendall(_message(_DONE, op.header.seq, signal))
        if completion is not None:
            completion.wait()  # the source may be reused only after the copy finished
        op.handle.set_done()

    def _reader_loop(self, peer: _DirectPeer) -> None:
        head = bytearray(_MSG.size)
        try:
            while True:
                got = recv_exact(peer.sock, memoryview(head))
                if got == 0:
                    raise PeerLost(f"connection to {peer.name} lost: the peer closed the connection", peer.rank)
                if got < _MSG.size:
                    raise ChannelError(f"connection to {peer.name} closed mid-message")
                magic, kind, seq, length = _MSG.unpack(head)
                if magic != MAGIC or kind not in (_READY, _DONE, _ERROR) or length > _MAX_PAYLOAD:
                    raise ChannelError(f"{peer.name} sent a malformed control message (type {kind}, "
                                       f"{length} bytes): the stream is out of step")
                payload = bytearray(length)
                if recv_exact(peer.sock, memoryview(payload)) < length:
                    raise ChannelError(f"connection to {peer.name} closed mid-message")
                if kind == _READY:
                    self._on_ready(peer, seq, bytes(payload))
                elif kind == _DONE:
                    self._on_done(peer, seq, bytes(payload))
                else:
                    self._on_error(peer, seq, bytes(payload))
        except ChannelError as exc:
            self._fail_peer(peer, exc)
        except OSError as exc:
            self._fail_peer(peer, PeerLost(f"connection to {peer.name} lost: {exc}", peer.rank))

    def _on_ready(self, peer: _DirectPeer, seq: int, payload: bytes) -> None:
        if len(payload) < _OFFSET.size + HEADER_SIZE:
            raise ChannelError(f"{peer.name} sent a truncated READY for message #{seq}")
        (offset,) = _OFFSET.unpack_from(payload)
        expected = decode_header(payload[_OFFSET.size:_OFFSET.size + HEADER_SIZE], sender=peer.name)
        answer = _Ready(offset, expected, payload[_OFFSET.size + HEADER_SIZE:])
        with peer.cond:
            if seq in peer.readies or seq < peer.send_seq and seq not in peer.sends:
                raise ChannelError(f"{peer.name} sent READY for message #{seq} twice: the stream is out of step")
            op = peer.sends.pop(seq, None)
            if op is None:
                peer.readies[seq] = answer
            else:
                peer.out.put(("write", (op, answer)))

    def _take_recv(self, peer: _DirectPeer, seq: int, what: str) -> _Recv:
        with peer.cond:
            op = peer.recvs.pop(seq, None)
        if op is None:
            raise ChannelError(f"{peer.name} sent {what} for message #{seq}, which this rank is not "
                               "receiving: the stream is out of step")
        return op

    def _on_done(self, peer: _DirectPeer, seq: int, signal: bytes) -> None:
        op = self._take_recv(peer, seq, "DONE")
        if op.buffer is None:
            op.handle.set_done()
            return
        try:
            landing = self.mover.land(op.buffer.tensor, op.dest, signal)
        except Exception as exc:
            op.handle.set_failed(ChannelError(f"{self.name} failed to land {op.expected.describe()} "
                                              f"from {peer.name}: {exc}"))
            return
        op.buffer.landing = landing
        self._cache.release(op.buffer)
        op.finish = landing.finish
        op.handle.set_done()

    def _on_error(self, peer: _DirectPeer, seq: int, payload: bytes) -> None:
        op = self._take_recv(peer, seq, "ERROR")
        if op.buffer is not None:
            self._cache.release(op.buffer)  # nothing was written into it
        op.handle.set_failed(ChannelError(payload.decode(errors="replace")))

    # ------------------------------------------------------- failure, close

    def _abandon(self, peer: _DirectPeer) -> list[CompletionHandle]:
        pending = [op.handle for op in peer.recvs.values()] + [op.handle for op in peer.sends.values()]
        peer.recvs.clear()
        peer.sends.clear()
        peer.readies.clear()
        # A write the worker runs right now fails or completes on its own; queued ones fail here.
        while True:
            try:
                item = peer.out.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[0] == "write":
                pending.append(item[1][0].handle)
        return pending

    def _disconnect(self, peer: _DirectPeer) -> None:
        peer.out.put(None)
        try:
            peer.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _release(self) -> None:
        for peer in self._peers.values():
            peer.sock.close()
        self._cache.clear()
        self.mover.close()


def build_channel(rank: int, group: list[int], *, names: Mapping[int, str], store: dist.Store,
                  cluster: ClusterConfig, token: str, device: torch.device, addresses: list[str],
                  route: str) -> DirectChannel:
    """The transport registry's builder (hetpipe/pipeline/transports.py): this kind's channel
    to ``group`` from the cluster config, as comm/factory.py builds every cross-vendor one."""
    # Each mover's channel meets its peers under its own prefix: a rank may hold several.
    return DirectChannel(rank, group, dict(names), dist.PrefixStore(f"hetpipe/mover/{route}", store),
                         token=token, mover=route, deadline=cluster.transport.deadline_s, device=device,
                         address=addresses[0])
