"""Data-plane movers for the device-direct channel: who writes the bytes, not when.

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

Two movers exist:

* :class:`ShmMover` - host shared memory. Receive buffers live in
  :class:`multiprocessing.shared_memory.SharedMemory` segments owned (and
  unlinked) by the receiver; the sender maps a segment by name and copies into
  it. This is what CI runs, so the control plane is exercised for real on CPU.
* :class:`CudaIpcMover` - CUDA IPC between processes on one host through
  cupy's runtime API (memory handles for the receive buffers, interprocess
  events for completion), so the copy is device-to-device and no host thread
  blocks on it. The HIP equivalent shares the code through a small runtime
  table (:class:`_HipRuntime`). Neither is exercised in CI (no GPU there), and
  ROCm/HIP has never been run at all.

Region handles are JSON, never pickle: a peer's bytes are parsed, not executed.
"""
from __future__ import annotations

import base64
import json
import logging
import mmap
import os
import re
import threading
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, Callable

import torch

from hetpipe.comm.channel import ChannelError, as_bytes

log = logging.getLogger(__name__)

_MAX_REGION_BYTES = 1 << 40
_SHM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


@dataclass(frozen=True)
class RegionHandle:
    """What a receiver tells a sender about one registered buffer.

    ``mover`` names the mover that made it (a sender refuses a handle from
    another kind), ``key`` identifies the region for the sender's cache,
    ``size`` bounds every write, and ``data`` is the mover-specific part
    (an shm segment name, a CUDA IPC memory handle, later an rkey).
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
    target: Any  # ShmMover: a uint8 tensor over the mapping; CudaIpcMover: the opened device pointer


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


class _Done(Completion):
    """A write that was complete when it returned (host memcpy)."""

    def poll(self) -> bool:
        return True

    def wait(self) -> None:
        return None


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
    def _open(self, handle: RegionHandle) -> Any:
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


class ShmMover(Mover):
    """Host shared memory: receive buffers are shm segments the sender maps by name and copies into.

    CUDA tensors work but go through the host synchronously; this mover is for
    CI and same-host CPU ranks, :class:`CudaIpcMover` is the GPU path. The
    receiver owns (creates, unlinks) every segment; the sender maps them
    through ``/dev/shm`` rather than :class:`SharedMemory` so Python's resource
    tracker never unlinks a segment it does not own when the sender exits.
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


# --------------------------------------------------------------- CUDA / HIP IPC

_IPC_HANDLE_BYTES = 64


class _CupyRuntime:
    """The CUDA runtime calls the IPC mover needs, through cupy (imported lazily)."""

    vendor = "cuda"

    def __init__(self) -> None:
        from cupy.cuda import runtime  # ImportError here makes mover='auto' fall back to shm

        self.rt = runtime

    def malloc(self, nbytes: int) -> int:
        return self.rt.malloc(nbytes)

    def free(self, ptr: int) -> None:
        self.rt.free(ptr)

    def mem_handle(self, ptr: int) -> bytes:
        return bytes(self.rt.ipcGetMemHandle(ptr))

    def open_mem(self, handle: bytes) -> int:
        return self.rt.ipcOpenMemHandle(handle)  # flags default: cudaIpcMemLazyEnablePeerAccess

    def close_mem(self, ptr: int) -> None:
        self.rt.ipcCloseMemHandle(ptr)

    def ipc_event(self) -> int:
        # Interprocess events must disable timing.
        return self.rt.eventCreateWithFlags(self.rt.eventInterprocess | self.rt.eventDisableTiming)

    def event_handle(self, event: int) -> bytes:
        return bytes(self.rt.ipcGetEventHandle(event))

    def open_event(self, handle: bytes) -> int:
        return self.rt.ipcOpenEventHandle(handle)

    def record(self, event: int, stream: int) -> None:
        self.rt.eventRecord(event, stream)

    def query(self, event: int) -> bool:
        try:
            self.rt.eventQuery(event)
            return True
        except self.rt.CUDARuntimeError as exc:
            if exc.status == 600:  # cudaErrorNotReady
                return False
            raise

    def synchronize(self, event: int) -> None:
        self.rt.eventSynchronize(event)

    def destroy(self, event: int) -> None:
        self.rt.eventDestroy(event)

    def wait_event(self, stream: int, event: int) -> None:
        self.rt.streamWaitEvent(stream, event, 0)

    def copy_d2d(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.rt.memcpyAsync(dst, src, nbytes, self.rt.memcpyDeviceToDevice, stream)


class _HipRuntime:
    """The same calls through hip-python (``from hip import hip``). NOT verified: never run on ROCm."""

    vendor = "hip"

    def __init__(self) -> None:
        from hip import hip  # type: ignore[import-not-found]

        self.hip = hip

    def _ok(self, result: Any) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self.hip.hipError_t.hipSuccess:
            raise ChannelError(f"HIP call failed: {err}")
        return rest[0] if len(rest) == 1 else rest

    def malloc(self, nbytes: int) -> int:
        return int(self._ok(self.hip.hipMalloc(nbytes)))

    def free(self, ptr: int) -> None:
        self._ok(self.hip.hipFree(ptr))

    def mem_handle(self, ptr: int) -> bytes:
        return bytes(self._ok(self.hip.hipIpcGetMemHandle(ptr)).reserved)

    def open_mem(self, handle: bytes) -> int:
        h = self.hip.hipIpcMemHandle_t(reserved=list(handle))
        return int(self._ok(self.hip.hipIpcOpenMemHandle(h, self.hip.hipIpcMemLazyEnablePeerAccess)))

    def close_mem(self, ptr: int) -> None:
        self._ok(self.hip.hipIpcCloseMemHandle(ptr))

    def ipc_event(self) -> int:
        return self._ok(self.hip.hipEventCreateWithFlags(
            self.hip.hipEventInterprocess | self.hip.hipEventDisableTiming))

    def event_handle(self, event: int) -> bytes:
        return bytes(self._ok(self.hip.hipIpcGetEventHandle(event)).reserved)

    def open_event(self, handle: bytes) -> int:
        return self._ok(self.hip.hipIpcOpenEventHandle(self.hip.hipIpcEventHandle_t(reserved=list(handle))))

    def record(self, event: int, stream: int) -> None:
        self._ok(self.hip.hipEventRecord(event, stream))

    def query(self, event: int) -> bool:
        err = self.hip.hipEventQuery(event)
        err = err[0] if isinstance(err, tuple) else err
        if err == self.hip.hipError_t.hipErrorNotReady:
            return False
        self._ok((err,))
        return True

    def synchronize(self, event: int) -> None:
        self._ok(self.hip.hipEventSynchronize(event))

    def destroy(self, event: int) -> None:
        self._ok(self.hip.hipEventDestroy(event))

    def wait_event(self, stream: int, event: int) -> None:
        self._ok(self.hip.hipStreamWaitEvent(stream, event, 0))

    def copy_d2d(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._ok(self.hip.hipMemcpyAsync(dst, src, nbytes, self.hip.hipMemcpyKind.hipMemcpyDeviceToDevice, stream))


# Which runtime binding serves which torch build: the only vendor-specific table.
_RUNTIMES: dict[str, type] = {"cuda": _CupyRuntime, "hip": _HipRuntime}
# Interprocess events the sender keeps alive after recording, so a receiver
# that has not yet opened one never sees it destroyed.
_EVENTS_KEPT = 256


class _EventCompletion(Completion):
    def __init__(self, runtime: Any, event: int) -> None:
        self.runtime = runtime
        self.event = event

    def poll(self) -> bool:
        return self.runtime.query(self.event)

    def wait(self) -> None:
        self.runtime.synchronize(self.event)

    def signal(self) -> bytes:
        return self.runtime.event_handle(self.event)


class CudaIpcMover(Mover):
    """Device-to-device copies between processes on one host through CUDA (or HIP) IPC.

    The CUDA path ran on 2x and 4x H200 (docs/benchmarks.md, 2026-11-22) but is
    not exercised in CI (no GPU there); ROCm/HIP is NOT verified at all.
    Receive buffers are allocated with the runtime's ``malloc`` (so an IPC
    handle maps exactly the buffer, offset 0), registered once and reused.
    The sender copies on a side stream after the stream that produced the
    tensor, records an interprocess event and sends its handle in DONE; the
    receiver's ``wait`` makes the caller's current stream wait on that event
    and copies into the caller's tensor on that stream, so no host thread
    blocks on the GPU.
    """

    name = "ipc"
    _warned = False

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        vendor = "hip" if torch.version.hip else "cuda"
        # The runtime is part of the name: a HIP handle means nothing to CUDA.
        self.name = f"ipc-{vendor}"
        self.runtime = _RUNTIMES[vendor]()
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self._buffers: dict[int, int] = {}  # data_ptr -> raw allocation
        self._opened: list[int] = []
        self._events: list[int] = []
        self._lock = threading.Lock()
        self._side = torch.cuda.Stream(device=self.device)
        if vendor == "hip" and not CudaIpcMover._warned:
            CudaIpcMover._warned = True
            log.warning("the device-direct IPC mover over HIP (ROCm) has not been verified on AMD hardware")

    def _wrap(self, ptr: int, nbytes: int) -> torch.Tensor:
        """A torch uint8 tensor over raw device memory (no ownership taken)."""
        import cupy

        memory = cupy.cuda.UnownedMemory(ptr, nbytes, self, self.device.index or 0)
        array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
        return torch.from_dlpack(array)

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        with torch.cuda.device(self.device):
            ptr = self.runtime.malloc(nbytes)
        tensor = self._wrap(ptr, nbytes)
        with self._lock:
            self._buffers[tensor.data_ptr()] = ptr
        return tensor

    def register(self, tensor: torch.Tensor) -> RegionHandle:
        with self._lock:
            ptr = self._buffers.get(tensor.data_ptr())
        if ptr is None:
            raise ChannelError("the IPC mover registers only buffers it allocated")
        self.registrations += 1
        return RegionHandle(self.name, f"{os.getpid()}:{ptr:x}", tensor.numel(), self.runtime.mem_handle(ptr))

    def _open(self, handle: RegionHandle) -> int:
        if len(handle.data) != _IPC_HANDLE_BYTES:
            raise ChannelError(f"IPC memory handle is {len(handle.data)} bytes, expected {_IPC_HANDLE_BYTES}")
        with torch.cuda.device(self.device):
            ptr = self.runtime.open_mem(handle.data)
        with self._lock:
            self._opened.append(ptr)
        return ptr

    def capture(self, tensor: torch.Tensor) -> torch.cuda.Event | None:
        if not tensor.is_cuda:
            raise ChannelError("the IPC mover moves CUDA tensors; use mover='shm' for CPU tensors")
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))
        tensor.record_stream(self._side)
        return ready

    def write(self, local: torch.Tensor, remote: RemoteRegion, offset: int, ready: Any = None) -> Completion:
        nbytes = local.numel() * local.element_size()
        event = self.runtime.ipc_event()
        with torch.cuda.device(self.device):
            if ready is not None:
                self._side.wait_event(ready)
            self.runtime.copy_d2d(remote.target + offset, local.data_ptr(), nbytes, self._side.cuda_stream)
            self.runtime.record(event, self._side.cuda_stream)
        with self._lock:
            self._events.append(event)
            stale = self._events[:-_EVENTS_KEPT]
            del self._events[:-_EVENTS_KEPT]
        for old in stale:
            self.runtime.destroy(old)
        return _EventCompletion(self.runtime, event)

    def land(self, buffer: torch.Tensor, dest: torch.Tensor, signal: bytes) -> Landing:
        copied: list[torch.cuda.Event] = []

        def finish() -> None:
            stream = torch.cuda.current_stream(dest.device)
            event = self.runtime.open_event(signal)
            self.runtime.wait_event(stream.cuda_stream, event)
            self.runtime.destroy(event)  # the wait is enqueued; the opened handle is no longer needed
            as_bytes(dest).copy_(buffer[:dest.numel() * dest.element_size()], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
            copied.append(done)

        # The buffer is free once the caller's stream has copied out of it.
        return Landing(finish=finish, reusable=lambda: bool(copied) and copied[0].query())

    def close(self) -> None:
        with self._lock:
            buffers, self._buffers = list(self._buffers.values()), {}
            opened, self._opened = self._opened, []
            events, self._events = self._events, []
        super().close()
        for call, items in ((self.runtime.close_mem, opened), (self.runtime.destroy, events),
                            (self.runtime.free, buffers)):
            for item in items:
                try:
                    call(item)
                except Exception as exc:  # closing must not raise; the driver frees at exit anyway
                    log.debug("IPC mover cleanup failed: %s", exc)


def make_mover(kind: str, device: torch.device | None) -> Mover:
    """'shm', 'ipc', or 'auto' (IPC for a CUDA device on a GPU build when cupy imports, else shm)."""
    if kind == "shm":
        return ShmMover()
    if kind == "ipc":
        try:
            return CudaIpcMover(device)
        except ImportError as exc:
            raise ChannelError(f"mover='ipc' needs cupy (CUDA) or hip-python (ROCm): {exc}") from exc
    if kind != "auto":
        raise ChannelError(f"unknown mover {kind!r}; expected 'auto', 'shm' or 'ipc'")
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        try:
            return CudaIpcMover(device)
        except ImportError:
            log.info("cupy / hip-python not importable: the direct channel falls back to the shm mover")
    return ShmMover()
