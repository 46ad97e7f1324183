"""The data-plane interface of the device-direct channel: who writes the bytes, not when.

The device-direct channel (:mod:`hetpipe.comm.direct`) splits a boundary
transfer in two. Its CPU control plane decides *when* a message may move
(ordering, header checks, completions, deadlines); a mover decides *how* the
bytes get from the sender's tensor into the receiver's memory without passing
through the control connection. The interface is the shape of one-sided RDMA,
so a verbs mover can be added without touching the control plane:

================================  ==========================================
mover call                        verbs equivalent (NOT implemented)
================================  ==========================================
``register(tensor)``              ``ibv_reg_mr`` on the receive buffer; the
                                  handle carries (addr, rkey, length)
``open_remote(handle)``           nothing to map: remember (addr, rkey)
``write(local, remote, offset)``  post ``IBV_WR_RDMA_WRITE_WITH_IMM`` (imm =
                                  sequence number) from a registered local MR
``Completion.poll()/wait()``      ``ibv_poll_cq`` on the send CQ
``Completion.signal()``           empty: the receiver sees the immediate in
                                  its own CQ (the control plane's DONE would
                                  then be redundant, kept for uniformity)
================================  ==========================================

The movers (:data:`~hetpipe.pipeline.transports.MOVERS` names them, ``hetpipe.comm.direct``
builds each from its entry in one table):
:class:`~hetpipe.comm.shm_mover.ShmMover` (host shared memory of one host, what
CI runs), :class:`~hetpipe.comm.ipc_mover.GpuIpcMover` (GPU memory of one host
through torch's CUDA/HIP IPC) and :class:`~hetpipe.comm.mooncake_mover.MooncakeMover`
(Mooncake's transfer engine between any two hosts, over TCP or RDMA: CI runs it
over TCP between emulated nodes; RDMA is not verified on hardware).

Region handles are JSON, never pickle: a peer's bytes are parsed, not executed.
"""
from __future__ import annotations

import base64
import json
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hetpipe.comm.channel import ChannelError

_MAX_REGION_BYTES = 1 << 40


@dataclass(frozen=True)
class RegionHandle:
    """What a receiver tells a sender about one registered buffer.

    ``mover`` names the mover that made it (a sender refuses a handle from
    another kind), ``key`` identifies the region for the sender's cache,
    ``size`` bounds every write, and ``data`` is the mover-specific part
    (an shm segment name, a GPU IPC description, later an rkey).
    """

    mover: str
    key: str
    size: int
    data: bytes = b""

    def to_bytes(self) -> bytes:
        return json.dumps({"mover": self.mover, "key": self.key, "size": self.size,
                           "data": base64.b64encode(self.data).decode()}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, *, sender: str = "the peer") -> "RegionHandle":
        try:
            info = json.loads(raw.decode())
            handle = cls(str(info["mover"]), str(info["key"]), int(info["size"]),
                         base64.b64decode(info["data"], validate=True))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise ChannelError(f"malformed region handle from {sender}: {raw[:200]!r}") from exc
        if not 0 < handle.size <= _MAX_REGION_BYTES:
            raise ChannelError(f"region handle from {sender} has an invalid size {handle.size}")
        return handle


@dataclass(eq=False)
class RemoteRegion:
    """A peer's registered buffer as this process can write to it."""

    handle: RegionHandle
    target: torch.Tensor  # a flat uint8 tensor over the peer's buffer (host mapping or GPU IPC)


class Completion(ABC):
    """One posted write: poll it, wait for it, and tell the receiver how to order after it."""

    @abstractmethod
    def poll(self) -> bool:
        """True once the source tensor may be reused."""

    @abstractmethod
    def wait(self) -> None:
        """Block this (control-plane) thread until :meth:`poll` would be True."""

    def signal(self) -> bytes:
        """Bytes the receiver needs to order after the write (an IPC event handle); empty if none."""
        return b""


@dataclass
class Landing:
    """How a receive completes once the sender's DONE arrived.

    ``finish`` runs on the waiting thread (GPU movers make the caller's stream
    wait there); ``reusable`` says when the receive buffer may be handed out
    for another READY.
    """

    finish: Callable[[], None] | None
    reusable: Callable[[], bool]


class Mover(ABC):
    """How bytes get from a sender's tensor into a receiver's registered buffer."""

    name: str = ""

    def __init__(self) -> None:
        # Counted so tests (and logs) can see the registration cache working.
        self.registrations = 0
        self._remote: dict[str, RemoteRegion] = {}
        self._remote_lock = threading.Lock()

    @abstractmethod
    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A flat uint8 receive buffer of ``nbytes`` (> 0) that :meth:`register` accepts."""

    @abstractmethod
    def register(self, tensor: torch.Tensor) -> RegionHandle:
        """Make ``tensor`` (from :meth:`allocate`) writable by peers; the handle is sent to them."""

    @abstractmethod
    def _open(self, handle: RegionHandle) -> torch.Tensor:
        """Map a peer's region (called once per region; :meth:`open_remote` caches)."""

    @abstractmethod
    def capture(self, tensor: torch.Tensor) -> Any:
        """Called when an isend is posted: whatever makes a later :meth:`write` see the tensor's current value."""

    @abstractmethod
    def write(self, local: torch.Tensor, remote: RemoteRegion, offset: int, ready: Any = None) -> Completion:
        """Post a write of ``local``'s bytes at ``offset`` in ``remote``; ``ready`` is :meth:`capture`'s result."""

    @abstractmethod
    def land(self, buffer: torch.Tensor, dest: torch.Tensor, signal: bytes) -> Landing:
        """Receiver side, after DONE: get ``buffer``'s bytes into ``dest`` (or arrange it)."""

    def open_remote(self, handle: RegionHandle, *, sender: str = "the peer") -> RemoteRegion:
        """The mapped region for ``handle``, opened on first use and cached by its key."""
        if handle.mover != self.name:
            if handle.mover.startswith("ipc") and self.name.startswith("ipc"):
                raise ChannelError(f"{sender} registered a {handle.mover!r} region but this rank is "
                                   f"{self.name!r}: CUDA IPC and HIP IPC cannot map each other's memory, so a "
                                   "real NVIDIA-AMD boundary needs cluster.transport.kind=tcp")
            raise ChannelError(f"{sender} registered a {handle.mover!r} region but this rank moves data "
                               f"with {self.name!r}: configure the same mover on both sides")
        with self._remote_lock:
            region = self._remote.get(handle.key)
            if region is None or region.handle != handle:
                region = self._remote[handle.key] = RemoteRegion(handle, self._open(handle))
            return region

    def close(self) -> None:
        """Unmap peers' regions and free this process's buffers. Idempotent."""
        with self._remote_lock:
            self._remote.clear()
