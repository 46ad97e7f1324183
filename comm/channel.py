"""The contract every pipeline-boundary transport keeps, and its wire header.

A pipeline boundary moves one activation (``fwd``) or one activation gradient
(``bwd``) per microbatch between two stages that may sit on different vendors'
GPUs, so no vendor library can carry it. Whatever carries it (CPU-forwarding
TCP, gloo, device-direct movers, or torch P2P inside one vendor group) looks
the same to the pipeline engine: ``isend``/``irecv`` return a :class:`Handle`
whose ``wait`` has a deadline.

Every message is self-describing: a fixed binary header (magic, version,
sequence number, microbatch, kind, dtype, shape, byte count, and the piece
offset/length used for striping) precedes the bytes. The receiver compares it
with what its ``irecv`` expects, so a schedule bug on either side is an error
that names both stages instead of a silently truncated tensor or a hang. The
header is packed with :mod:`struct`; nothing on the wire is ever unpickled.
"""
from __future__ import annotations

import math
import struct
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import torch

from hetpipe.errors import HetpipeError

MAGIC = b"HPCH"
VERSION = 1
MAX_DIMS = 8
KINDS = ("fwd", "bwd")

# Wire codes are part of the protocol: append new dtypes, never renumber.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.bfloat16: 2,
    torch.float16: 3,
    torch.float64: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.int16: 7,
    torch.int8: 8,
    torch.uint8: 9,
    torch.bool: 10,
    torch.float8_e4m3fn: 11,
    torch.float8_e5m2: 12,
}
_DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}

# magic, version, kind, dtype, ndim, reserved, npieces, seq, microbatch,
# shape[8], nbytes, piece offset, piece length. Little-endian, no padding, so
# every rank agrees on the layout whatever its platform.
_HEADER = struct.Struct(f"<4sHBBBBHQq{MAX_DIMS}qQQQ")
HEADER_SIZE = _HEADER.size


class ChannelError(HetpipeError):
    """A boundary transfer failed: mismatched message, lost peer, refused handshake."""


class ChannelTimeout(ChannelError):
    """A boundary transfer did not complete within its deadline."""


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the spelling users read in error messages."""
    return str(dtype).removeprefix("torch.")


def describe(kind: str, microbatch: int, dtype: torch.dtype, shape: Iterable[int]) -> str:
    """One message as a user reads it: 'fwd microbatch 3 float32[2, 64, 128]'."""
    return f"{kind} microbatch {microbatch} {dtype_name(dtype)}[{', '.join(str(d) for d in shape)}]"


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ChannelError(f"message kind must be one of {KINDS}, got {kind!r}")


@dataclass(frozen=True)
class FrameHeader:
    """What one piece of one message says about itself.

    ``offset``/``length`` locate this piece inside the message's ``nbytes``;
    ``npieces`` says how many pieces (one per striped connection at most) make
    up the whole message, so the receiver knows when it is complete.
    """

    seq: int
    microbatch: int
    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0
    length: int = 0
    npieces: int = 1

    def describe(self) -> str:
        return describe(self.kind, self.microbatch, self.dtype, self.shape)

    def piece(self, offset: int, length: int, npieces: int) -> "FrameHeader":
        return replace(self, offset=offset, length=length, npieces=npieces)


def header_for(tensor: torch.Tensor, *, seq: int, microbatch: int, kind: str) -> FrameHeader:
    """The whole-message header for ``tensor`` (one piece covering every byte)."""
    check_kind(kind)
    if tensor.dtype not in DTYPE_CODES:
        raise ChannelError(f"a boundary channel cannot carry dtype {dtype_name(tensor.dtype)}; "
                           f"supported: {', '.join(dtype_name(d) for d in DTYPE_CODES)}")
    if tensor.dim() > MAX_DIMS:
        raise ChannelError(f"a boundary channel carries at most {MAX_DIMS} dimensions, "
                           f"got shape {list(tensor.shape)}")
    nbytes = tensor.numel() * tensor.element_size()
    return FrameHeader(seq=seq, microbatch=microbatch, kind=kind, dtype=tensor.dtype,
                       shape=tuple(tensor.shape), nbytes=nbytes, offset=0, length=nbytes, npieces=1)


def encode_header(header: FrameHeader) -> bytes:
    """The fixed-size wire form of ``header``."""
    shape = list(header.shape) + [0] * (MAX_DIMS - len(header.shape))
    return _HEADER.pack(MAGIC, VERSION, KINDS.index(header.kind), DTYPE_CODES[header.dtype],
                        len(header.shape), 0, header.npieces, header.seq, header.microbatch,
                        *shape, header.nbytes, header.offset, header.length)


def decode_header(data: bytes | bytearray | memoryview, *, sender: str = "the peer") -> FrameHeader:
    """Parse a wire header; anything malformed is a :class:`ChannelError` naming ``sender``."""
    if len(data) != HEADER_SIZE:
        raise ChannelError(f"frame header from {sender} is {len(data)} bytes, expected {HEADER_SIZE}")
    fields = _HEADER.unpack(data)
    magic, version, kind_code, dtype_code, ndim, _reserved, npieces, seq, microbatch = fields[:9]
    dims = fields[9:9 + MAX_DIMS]
    nbytes, offset, length = fields[9 + MAX_DIMS:]
    if magic != MAGIC:
        raise ChannelError(f"received a frame from {sender} with magic {bytes(magic)!r}, expected {MAGIC!r}: "
                           "the peer is not a hetpipe channel or the stream is out of step")
    if version != VERSION:
        raise ChannelError(f"{sender} speaks channel protocol version {version}, this rank speaks {VERSION}: "
                           "run the same hetpipe version on every rank")
    if kind_code >= len(KINDS):
        raise ChannelError(f"frame from {sender} has unknown kind code {kind_code}")
    if dtype_code not in _DTYPES_BY_CODE:
        raise ChannelError(f"frame from {sender} has unknown dtype code {dtype_code}")
    if ndim > MAX_DIMS or any(d < 0 for d in dims[:ndim]):
        raise ChannelError(f"frame from {sender} has an invalid shape (ndim {ndim}, dims {list(dims[:ndim])})")
    dtype = _DTYPES_BY_CODE[dtype_code]
    shape = tuple(dims[:ndim])
    expected_bytes = math.prod(shape) * dtype.itemsize
    if nbytes != expected_bytes or npieces < 1 or offset + length > nbytes:
        raise ChannelError(f"frame from {sender} is inconsistent: {describe(KINDS[kind_code], microbatch, dtype, shape)} "
                           f"with {nbytes} bytes, piece {offset}+{length} of {npieces}")
    return FrameHeader(seq=seq, microbatch=microbatch, kind=KINDS[kind_code], dtype=dtype, shape=shape,
                       nbytes=nbytes, offset=offset, length=length, npieces=npieces)


def check_header(received: FrameHeader, expected: FrameHeader, *, receiver: str, sender: str) -> None:
    """Raise a :class:`ChannelError` naming both stages unless ``received`` is the awaited message.

    Only the message identity is compared (kind, microbatch, dtype, shape,
    byte count, sequence number); piece geometry is the transport's business.
    """
    same = (received.kind == expected.kind and received.microbatch == expected.microbatch
            and received.dtype == expected.dtype and received.shape == expected.shape
            and received.nbytes == expected.nbytes)
    if same and received.seq == expected.seq:
        return
    message = (f"{receiver} expected {expected.describe()} from {sender}, "
               f"received {received.describe()}")
    if same:
        # Identical description but another position in the stream: a message
        # was skipped or posted twice on one side.
        message += f" out of order (message #{received.seq}, expected #{expected.seq})"
    raise ChannelError(message)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory (any dtype, zero-size and 0-dim too)."""
    if not tensor.is_contiguous():
        raise ChannelError(f"boundary channels move contiguous tensors; got strides {tensor.stride()} "
                           f"for shape {list(tensor.shape)}")
    return tensor.detach().reshape(-1).view(torch.uint8)


class Handle(ABC):
    """An outstanding isend/irecv."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until the transfer completed.

        ``timeout`` in seconds; None means the channel's deadline. Raises
        :class:`ChannelTimeout` naming the peer stage and the awaited message,
        or the :class:`ChannelError` that failed the transfer.
        """

    @abstractmethod
    def done(self) -> bool:
        """True once ``wait`` would return or raise without blocking on the network."""


class CompletionHandle(Handle):
    """A handle that a transport's background thread completes or fails.

    ``finish`` runs once, on the waiting thread, after success: that is where
    a GPU receive makes the caller's current CUDA stream wait for the
    host-to-device copy, so stream ordering follows the caller, not the I/O
    thread.
    """

    def __init__(self, *, owner: str, action: str, deadline: float,
                 finish: Callable[[], None] | None = None) -> None:
        self.owner = owner
        self.action = action
        self.deadline = deadline
        self._finish = finish
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._error: ChannelError | None = None

    def set_done(self) -> None:
        self._event.set()

    def set_failed(self, error: ChannelError) -> None:
        # First outcome wins: a transfer that completed stays completed even if
        # the connection is lost afterwards.
        with self._lock:
            if self._event.is_set():
                return
            self._error = error
            self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        limit = self.deadline if timeout is None else timeout
        if not self._event.wait(max(limit, 0.0)):
            raise ChannelTimeout(f"{self.owner} timed out after {limit:g} s waiting to {self.action}")
        if self._error is not None:
            raise self._error
        with self._lock:
            finish, self._finish = self._finish, None
        if finish is not None:
            finish()


class Channel(ABC):
    """Point-to-point boundary transport between this rank and its pipeline neighbours.

    ``peer`` is always a global rank, in every method of every transport (the
    engine's per-stage view is :class:`~hetpipe.comm.stage_link.StageLink`,
    which takes no peer). ``names`` maps global ranks to the stage
    descriptions used in every error ("stage 1 (group amd, rank 1)").
    Messages to one peer are delivered in the order they were sent, and
    receives from one peer are matched to posted ``irecv`` calls in order.
    """

    def __init__(self, rank: int, peers: Iterable[int], names: dict[int, str], deadline: float) -> None:
        self.rank = rank
        self.peers = sorted(set(peers))
        self.names = dict(names)
        self.deadline = float(deadline)
        # Set by close(); posting on a closed channel is an error, not a hang.
        self._closed = False
        if rank in self.peers:
            raise ChannelError(f"{self.name_of(rank)} lists itself among its channel peers")
        if self.deadline <= 0:
            raise ChannelError(f"channel deadline must be positive, got {deadline}")

    def name_of(self, rank: int) -> str:
        return self.names.get(rank, f"rank {rank}")

    @property
    def name(self) -> str:
        return self.name_of(self.rank)

    def check_peer(self, peer: int) -> None:
        if peer not in self.peers:
            raise ChannelError(f"{self.name} has no channel to {self.name_of(peer)} "
                               f"(peers: {', '.join(self.name_of(p) for p in self.peers) or 'none'})")

    def check_open(self, peer: int) -> None:
        """Refuse posting on a closed channel or to a rank that is not a peer."""
        if self._closed:
            raise ChannelError(f"{self.name}'s channel is closed")
        self.check_peer(peer)

    def send_action(self, header: FrameHeader, peer: int) -> str:
        return f"send {header.describe()} to {self.name_of(peer)}"

    def recv_action(self, header: FrameHeader, peer: int) -> str:
        return f"receive {header.describe()} from {self.name_of(peer)}"

    @abstractmethod
    def isend(self, tensor: torch.Tensor, peer: int, *, microbatch: int, kind: str) -> Handle:
        """Start sending ``tensor`` to ``peer``; the tensor must not change until the handle is done."""

    @abstractmethod
    def irecv(self, tensor: torch.Tensor, peer: int, *, microbatch: int, kind: str) -> Handle:
        """Start receiving into the preallocated ``tensor`` from ``peer`` (filled in place)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and threads; pending transfers fail. Idempotent."""

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
