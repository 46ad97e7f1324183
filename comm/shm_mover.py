"""The device-direct channel's host shared-memory mover: the data plane CI runs.

Receive buffers live in :class:`multiprocessing.shared_memory.SharedMemory`
segments owned (created and unlinked) by the receiver; the sender maps a
segment by name and copies into it. Same-host CPU ranks move data this way,
and it lets the control plane (:mod:`hetpipe.comm.direct`) run for real on a
machine without a GPU.
"""
from __future__ import annotations

import mmap
import os
import re
import threading
import uuid
from multiprocessing import shared_memory
from typing import Any

import torch

from hetpipe.comm.channel import ChannelError, as_bytes
from hetpipe.comm.mover import Completion, Landing, Mover, RegionHandle, RemoteRegion

_SHM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class _Done(Completion):
    """A write that was complete when it returned (host memcpy)."""

    def poll(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class ShmMover(Mover):
    """Host shared memory: receive buffers are shm segments the sender maps by name and copies into.

    CUDA tensors work but go through the host synchronously; this mover is for
    CI and same-host CPU ranks, :class:`~hetpipe.comm.ipc_mover.GpuIpcMover` is
    the GPU path. The sender maps segments through ``/dev/shm`` rather than
    :class:`SharedMemory` so Python's resource tracker never unlinks a segment
    it does not own when the sender exits.
    """

    name = "shm"

    def __init__(self) -> None:
        super().__init__()
        self._owned: dict[int, tuple[shared_memory.SharedMemory, torch.Tensor]] = {}
        self._maps: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._closed = False

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        segment = shared_memory.SharedMemory(create=True, size=nbytes,
                                             name=f"hetpipe_{os.getpid()}_{uuid.uuid4().hex[:12]}")
        tensor = torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes)
        with self._lock:
            if self._closed:
                self._release(segment, tensor)
                raise ChannelError("the shm mover is closed")
            self._owned[tensor.data_ptr()] = (segment, tensor)
        return tensor

    def register(self, tensor: torch.Tensor) -> RegionHandle:
        with self._lock:
            entry = self._owned.get(tensor.data_ptr())
        if entry is None:
            raise ChannelError("the shm mover registers only buffers it allocated")
        segment, _ = entry
        self.registrations += 1
        return RegionHandle(self.name, segment.name, tensor.numel(), segment.name.encode())

    def _open(self, handle: RegionHandle) -> torch.Tensor:
        name = handle.data.decode(errors="replace")
        if not _SHM_NAME.match(name):
            raise ChannelError(f"refusing shm segment name {name!r}")
        try:
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        except OSError as exc:
            raise ChannelError(f"cannot open the peer's shm segment {name!r}: {exc}") from exc
        try:
            if os.fstat(fd).st_size < handle.size:
                raise ChannelError(f"peer's shm segment {name!r} is smaller than the {handle.size} bytes it claims")
            mapping = mmap.mmap(fd, handle.size)
        finally:
            os.close(fd)
        with self._lock:
            self._maps.append(mapping)
        return torch.frombuffer(mapping, dtype=torch.uint8, count=handle.size)

    def capture(self, tensor: torch.Tensor) -> None:
        return None  # the copy in write() reads the tensor synchronously

    def write(self, local: torch.Tensor, remote: RemoteRegion, offset: int, ready: Any = None) -> Completion:
        src = as_bytes(local)
        remote.target[offset:offset + src.numel()].copy_(src)
        return _Done()

    def land(self, buffer: torch.Tensor, dest: torch.Tensor, signal: bytes) -> Landing:
        as_bytes(dest).copy_(buffer[:dest.numel() * dest.element_size()])
        return Landing(finish=None, reusable=lambda: True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            owned, self._owned = list(self._owned.values()), {}
            maps, self._maps = self._maps, []
        super().close()
        for segment, tensor in owned:
            self._release(segment, tensor)
        del owned
        for mapping in maps:
            try:
                mapping.close()
            except BufferError:  # a tensor over it is still alive somewhere; the OS unmaps at exit
                pass

    @staticmethod
    def _release(segment: shared_memory.SharedMemory, tensor: torch.Tensor) -> None:
        del tensor
        try:
            segment.close()
        except BufferError:  # a view still exists; unlinking still frees the name
            pass
        try:
            segment.unlink()
        except FileNotFoundError:
            pass
