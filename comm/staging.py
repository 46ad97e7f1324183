"""Pinned-host staging for channels that forward GPU tensors through the CPU.

A CPU-forwarding channel moves a GPU tensor device -> pinned host -> network
-> pinned host -> device. The two copies must overlap compute and must order
correctly against the caller's CUDA stream without blocking the compute
thread:

* sending, the device-to-host copy runs on a side stream that first waits for
  the caller's stream (which produced the tensor); the channel's I/O thread,
  not the caller, waits on the copy's event before the bytes go out;
* receiving, the host-to-device copy runs on another side stream after the
  caller's stream reached the point where it posted the receive, and the
  caller's stream (not the host) waits for the copy when the handle is waited
  on.

Pinned buffers are pooled by size: activations repeat the same few sizes, and
pinning memory is slow. Written for CUDA and ROCm builds of torch (ROCm drives
AMD GPUs through the same ``torch.cuda`` API). Not exercised in CI, which has
no GPU; ``tests/test_channel_tcp.py`` has a GPU round trip for machines with one.
"""
from __future__ import annotations

import threading

import torch

from hetpipe.comm.channel import as_bytes

# Free pinned buffers kept per size; activations repeat the same few sizes.
_POOL_PER_SIZE = 4


class PinnedPool:
    """Reusable pinned host buffers.

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


class HostStaging:
    """The pinned buffers and side streams one channel stages its GPU tensors through.

    ``device`` (optional) is the GPU the channel's tensors live on: its side
    streams are created up front rather than on first use.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self._pool = PinnedPool()
        self._lock = threading.Lock()
        self._streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
        if device is not None and device.type == "cuda":
            self._side_stream(device, "send")
            self._side_stream(device, "recv")

    def _side_stream(self, device: torch.device, role: str) -> torch.cuda.Stream:
        """One side stream per device and direction, so staging copies overlap compute."""
        key = (device, role)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None:
                stream = self._streams[key] = torch.cuda.Stream(device=device)
            return stream

    def stage_out(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Start copying GPU tensor ``src`` to a pinned buffer; the event completes with the copy.

        Hand the buffer back with :meth:`sent` once its bytes went out.
        """
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

    def sent(self, staging: torch.Tensor) -> None:
        """A buffer from :meth:`stage_out` whose bytes went out may be reused.

        Buffers of failed transfers are not handed back: an I/O thread may
        still touch one until its socket is shut down.
        """
        self._pool.release(staging)

    def receive_buffer(self, dest: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A pinned buffer for a receive into GPU tensor ``dest``, and the event that
        marks where the caller's stream posted it (the landing copy goes after)."""
        staging = self._pool.acquire(dest.numel() * dest.element_size())
        posted = torch.cuda.Event()
        posted.record(torch.cuda.current_stream(dest.device))
        dest.record_stream(self._side_stream(dest.device, "recv"))
        return staging, posted

    def land(self, staging: torch.Tensor, dest: torch.Tensor, posted: torch.cuda.Event) -> torch.cuda.Event:
        """Start the host-to-device copy of a completed receive (called on an I/O thread).

        Returns the copy's event, for :meth:`join`; the buffer goes back to
        the pool, reusable once that event completed.
        """
        side = self._side_stream(dest.device, "recv")
        with torch.cuda.device(dest.device), torch.cuda.stream(side):
            side.wait_event(posted)
            as_bytes(dest).copy_(staging, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        self._pool.release(staging, copied)
        return copied

    @staticmethod
    def join(dest: torch.Tensor, copied: torch.cuda.Event) -> None:
        """On the waiting thread: the caller's stream, not the host, waits for the landing copy."""
        torch.cuda.current_stream(dest.device).wait_event(copied)
