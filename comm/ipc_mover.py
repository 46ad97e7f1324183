"""The device-direct channel's GPU mover: device-to-device copies between processes of one host.

Everything goes through torch's own IPC, which CUDA and ROCm builds of torch
both provide, so the mover needs no cupy and no hip-python:

* memory: a receive buffer is an ordinary torch allocation. torch's tensor
  sharing (:func:`torch.multiprocessing.reductions.reduce_tensor` on the
  receiver, :func:`~torch.multiprocessing.reductions.rebuild_cuda_tensor` on
  the sender, the functions its multiprocessing pickler uses) hands the sender
  a tensor over it, and takes care of what a raw ``cudaIpcGetMemHandle`` gets
  wrong: a caching-allocator block inside a larger ``cudaMalloc`` segment (the
  offset), one mapping per segment per process however many buffers share it,
  and keeping the memory alive while a peer still maps it (torch's IPC
  reference counter). Those functions return positional tuples meant for
  pickle; this module puts the fields into JSON (:class:`IpcShare`), so no
  pickle crosses the wire.
* completion: the sender records a ``torch.cuda.Event(interprocess=True)``
  after its copy and sends ``event.ipc_handle()`` in DONE; the receiver opens
  it with ``torch.cuda.Event.from_ipc_handle`` and makes its caller's stream
  wait on it, so no host thread blocks on the GPU.

Status: not exercised in CI (no GPU there). ``tests/test_channel_direct.py``
has a two-process round trip on one GPU (``-k gpu``) for machines with one;
ROCm/HIP has not been run at all.
"""
from __future__ import annotations

import base64
import collections
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from hetpipe.comm.channel import ChannelError, as_bytes
from hetpipe.comm.mover import Completion, Landing, Mover, RegionHandle, RemoteRegion

log = logging.getLogger(__name__)

# cudaIpcEventHandle_t and hipIpcEventHandle_t are both 64 bytes.
_EVENT_HANDLE_BYTES = 64
# Bounds on what a peer may send: IPC memory handles are 64 bytes (a few more
# with expandable segments), the reference counter is a shared-memory file name.
_MAX_HANDLE_BYTES = 256
_COUNTER_NAME = re.compile(rb"^/?[A-Za-z0-9_.-]{1,200}$")
# Interprocess events the sender keeps alive after recording, so a receiver
# that has not yet opened one never sees it destroyed.
_EVENTS_KEPT = 256


@dataclass(frozen=True)
class IpcShare:
    """torch's IPC description of one receive buffer (the fields ``reduce_tensor`` produces for it)."""

    device: int
    handle: bytes
    size: int  # bytes of the buffer's storage
    offset: int  # of the storage inside the shared cudaMalloc segment
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes | None  # where the producer's pending work on the buffer ends
    event_sync_required: bool

    def to_bytes(self) -> bytes:
        def b64(raw: bytes | None) -> str | None:
            return None if raw is None else base64.b64encode(raw).decode()

        return json.dumps({"device": self.device, "handle": b64(self.handle), "size": self.size,
                           "offset": self.offset, "ref_counter": b64(self.ref_counter),
                           "ref_counter_offset": self.ref_counter_offset, "event": b64(self.event),
                           "event_sync_required": self.event_sync_required}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, *, sender: str = "the peer") -> "IpcShare":
        def unb64(value: Any) -> bytes | None:
            return None if value is None else base64.b64decode(value, validate=True)

        try:
            info = json.loads(raw.decode())
            share = cls(int(info["device"]), unb64(info["handle"]) or b"", int(info["size"]),
                        int(info["offset"]), unb64(info["ref_counter"]) or b"", int(info["ref_counter_offset"]),
                        unb64(info["event"]), bool(info["event_sync_required"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise ChannelError(f"malformed GPU IPC description from {sender}: {raw[:200]!r}") from exc
        if (share.device < 0 or share.size <= 0 or share.offset < 0 or share.ref_counter_offset < 0
                or not 0 < len(share.handle) <= _MAX_HANDLE_BYTES
                or (share.event is not None and len(share.event) > _MAX_HANDLE_BYTES)
                or not _COUNTER_NAME.match(share.ref_counter)):
            raise ChannelError(f"GPU IPC description from {sender} is out of bounds: {raw[:200]!r}")
        return share


def share_buffer(buffer: torch.Tensor) -> IpcShare:
    """torch's IPC description of ``buffer`` (a whole flat uint8 GPU allocation)."""
    _rebuild, fields = reduce_tensor(buffer)
    if len(fields) != 15:
        raise ChannelError(f"this torch's reduce_tensor returns {len(fields)} fields for a GPU tensor, "
                           "the IPC mover knows the 15 of torch 2.x")
    (_cls, _size, _stride, tensor_offset, _storage_cls, _dtype, device, handle, size, offset,
     _requires_grad, ref_counter, ref_counter_offset, event, event_sync_required) = fields
    if tensor_offset != 0 or size != buffer.numel():
        raise ChannelError("the IPC mover shares only whole buffers it allocated")
    return IpcShare(int(device), bytes(handle), int(size), int(offset), bytes(ref_counter),
                    int(ref_counter_offset), None if event is None else bytes(event), bool(event_sync_required))


def open_share(share: IpcShare) -> torch.Tensor:
    """A flat uint8 tensor over a peer's buffer, mapped into this process."""
    return rebuild_cuda_tensor(torch.Tensor, torch.Size([share.size]), (1,), 0, torch.UntypedStorage, torch.uint8,
                               share.device, share.handle, share.size, share.offset, False, share.ref_counter,
                               share.ref_counter_offset, share.event, share.event_sync_required)


class _EventCompletion(Completion):
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def poll(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()

    def signal(self) -> bytes:
        return bytes(self.event.ipc_handle())


class GpuIpcMover(Mover):
    """Device-to-device copies between processes on one host through torch's CUDA (or HIP) IPC.

    Receive buffers are torch allocations, registered once and reused (the
    channel's registration cache); the mover holds them until :meth:`close`.
    The sender copies on a side stream after the stream that produced the
    tensor, records an interprocess event and sends its handle in DONE; the
    receiver's ``wait`` makes the caller's current stream wait on that event
    and copies into the caller's tensor on that stream.
    """

    name = "ipc"
    _warned = False

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        if not torch.cuda.is_available():
            raise ChannelError("the GPU IPC mover needs a GPU; use mover='shm' for CPU ranks")
        vendor = "hip" if torch.version.hip else "cuda"
        # The runtime is part of the name: a HIP handle means nothing to CUDA.
        self.name = f"ipc-{vendor}"
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self._buffers: dict[int, torch.Tensor] = {}  # data_ptr -> registered receive buffer
        self._events: collections.deque[torch.cuda.Event] = collections.deque(maxlen=_EVENTS_KEPT)
        self._lock = threading.Lock()
        self._side = torch.cuda.Stream(device=self.device)
        if vendor == "hip" and not GpuIpcMover._warned:
            GpuIpcMover._warned = True
            log.warning("the device-direct IPC mover over HIP (ROCm) has not been verified on AMD hardware")

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        with self._lock:
            self._buffers[tensor.data_ptr()] = tensor
        return tensor

    def register(self, tensor: torch.Tensor) -> RegionHandle:
        with self._lock:
            owned = self._buffers.get(tensor.data_ptr()) is tensor
        if not owned:
            raise ChannelError("the IPC mover registers only buffers it allocated")
        self.registrations += 1
        return RegionHandle(self.name, f"{os.getpid()}:{tensor.data_ptr():x}", tensor.numel(),
                            share_buffer(tensor).to_bytes())

    def _open(self, handle: RegionHandle) -> torch.Tensor:
        share = IpcShare.from_bytes(handle.data)
        if share.size < handle.size:
            raise ChannelError(f"the peer's GPU buffer has {share.size} bytes but its region claims {handle.size}")
        return open_share(share)

    def capture(self, tensor: torch.Tensor) -> torch.cuda.Event:
        if not tensor.is_cuda:
            raise ChannelError("the IPC mover moves GPU tensors; use mover='shm' for CPU tensors")
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))
        tensor.record_stream(self._side)
        return ready

    def write(self, local: torch.Tensor, remote: RemoteRegion, offset: int, ready: Any = None) -> Completion:
        src = as_bytes(local)
        event = torch.cuda.Event(interprocess=True)
        # On the side stream of the sending GPU: torch runs a copy between two
        # GPUs on the source device's current stream.
        with torch.cuda.device(self.device), torch.cuda.stream(self._side):
            if ready is not None:
                self._side.wait_event(ready)
            remote.target[offset:offset + src.numel()].copy_(src, non_blocking=True)
            event.record(self._side)
        with self._lock:
            self._events.append(event)
        return _EventCompletion(event)

    def land(self, buffer: torch.Tensor, dest: torch.Tensor, signal: bytes) -> Landing:
        if len(signal) != _EVENT_HANDLE_BYTES:
            raise ChannelError(f"the sender's completion signal is {len(signal)} bytes, "
                               f"expected a {_EVENT_HANDLE_BYTES}-byte IPC event handle")
        copied: list[torch.cuda.Event] = []

        def finish() -> None:
            stream = torch.cuda.current_stream(dest.device)
            stream.wait_event(torch.cuda.Event.from_ipc_handle(dest.device, signal))
            as_bytes(dest).copy_(buffer[:dest.numel() * dest.element_size()], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
            copied.append(done)

        # The buffer is free once the caller's stream has copied out of it.
        return Landing(finish=finish, reusable=lambda: bool(copied) and copied[0].query())

    def close(self) -> None:
        # Writes into peers' buffers must end before their mappings go.
        self._side.synchronize()
        with self._lock:
            self._buffers.clear()
            self._events.clear()
        super().close()
