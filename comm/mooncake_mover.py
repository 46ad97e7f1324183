"""The device-direct channel's mover between nodes: Mooncake's transfer engine.

Across hosts the bytes of a boundary tensor should go NIC to GPU memory
(GPUDirect RDMA on NVIDIA, peer memory / dma-buf on AMD), striped over the
NICs near the GPU. Writing that on raw verbs means memory registration, queue
pairs, connection exchange and multi-NIC slicing for two vendors; Mooncake's
transfer engine (kvcache-ai/Mooncake, Apache-2.0) is a maintained library that
already does all of it, with wheels for CUDA 12, CUDA 13, ROCm and no GPU.
Three of its properties decide the choice (the issue note compares NIXL and
ucxx):

* one API over RDMA and TCP: the code path CI runs over its TCP transport on
  loopback is the one an RDMA cluster runs, with ``protocol='rdma'``;
* a point-to-point handshake (``P2PHANDSHAKE``): engines find each other by
  ``host:rpc_port`` with no metadata server, so the endpoint simply travels
  in the region handle of the channel's READY, over the control connection
  the job token already authenticated;
* its RDMA transport splits a write into slices spread over the NICs its
  topology ranks nearest the memory, and re-reads a peer's registrations when
  a write names a buffer it has not seen.

How a boundary message moves (the control plane in
:mod:`hetpipe.comm.direct` owns ordering, header checks and deadlines):

* the receiver allocates a buffer per message size, registers it with its
  engine once (the channel's registration cache reuses it every microbatch)
  and sends ``{endpoint, address}`` as the region handle in READY;
* the sender's worker thread copies the tensor into a registered staging
  buffer of the same size (one per size, reused: registering each caller
  tensor would pin a new slice of the caching allocator every microbatch),
  submits the write and polls it to completion against the channel's deadline,
  then the channel sends DONE: the bytes are in the receiver's buffer before
  DONE leaves, so DONE needs no signal;
* the receiver, on DONE, copies the buffer into the caller's tensor on the
  caller's stream: GPU work is enqueued, the host does not wait for it.

Status: the TCP transport between processes is what CI runs (two ranks on
loopback, bit-exact, fault cases). The RDMA transport, GPU memory over RDMA
(GPUDirect / dma-buf) and every ROCm build have NOT been verified here; the
mover says so in the log when it starts on RDMA. Its data ports, like any
RDMA endpoint, accept peers without the job token: run it on the cluster's
private fabric.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hetpipe.comm.channel import ChannelError, as_bytes
from hetpipe.comm.mover import Completion, Landing, Mover, RegionHandle, RemoteRegion

log = logging.getLogger(__name__)

PROTOCOLS = ("tcp", "rdma")
# What a CPU-only machine installs; GPU nodes take the wheel of their runtime.
WHEELS = ("mooncake-transfer-engine-non-cuda (CPU, CI), mooncake-transfer-engine (CUDA 12), "
          "mooncake-transfer-engine-cuda13 (CUDA 13), mooncake-transfer-engine-rocm (ROCm)")
_ENDPOINT = re.compile(r"^[A-Za-z0-9_.-]{1,253}:[0-9]{1,5}$")
# Polling a submitted write: sleep this long at first (small messages finish
# in tens of microseconds), doubling up to the cap (large ones take ms).
_FIRST_POLL_S = 20e-6
_MAX_POLL_S = 1e-3
# close() waits this long for writes still polling to notice it.
_CLOSE_WAIT_S = 5.0


def unavailable_reason() -> str | None:
    """Why this process cannot load Mooncake's transfer engine, in one line naming the missing piece; None if it can."""
    # Mooncake logs every segment it opens at INFO on stderr; a user who wants that sets MC_LOG_LEVEL.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        import mooncake.engine  # noqa: F401 - the import is the check
    except ImportError as exc:
        if "libibverbs" in str(exc):
            return ("Mooncake's transfer engine needs rdma-core's libibverbs.so.1 even for its TCP transport: "
                    "install the system package (Debian/Ubuntu: apt-get install libibverbs1; "
                    f"RHEL: dnf install libibverbs) [{exc}]")
        if getattr(exc, "name", None) in ("mooncake", "mooncake.engine"):
            return f"Mooncake's transfer engine is not installed: pip install 'hetpipe[mooncake]', or one of {WHEELS}"
        return f"Mooncake's transfer engine failed to load: {exc}"
    return None


def rdma_devices() -> list[str]:
    """The RDMA devices the kernel lists (what Mooncake's RDMA transport would use)."""
    return sorted(p.name for p in Path("/sys/class/infiniband").glob("*"))


def gpu_build_reason(device: torch.device | None) -> str | None:
    """Why the installed Mooncake wheel cannot register ``device``'s memory; None if it can (or ``device`` is no GPU).

    Call only where :func:`unavailable_reason` is None.
    """
    if device is None or torch.device(device).type != "cuda":
        return None
    from mooncake import engine as mc

    runtime, built = ("HIP", mc.SUPPORT_HIP) if torch.version.hip else ("CUDA", mc.SUPPORT_CUDA)
    if built:
        return None
    return (f"the installed Mooncake wheel was built without {runtime}, so it cannot register GPU memory: "
            f"install the wheel of this node's runtime ({WHEELS})")


def rdma_unavailable_reason(device: torch.device | None) -> str | None:
    """Why Mooncake's RDMA transport cannot carry this rank's tensors on ``device``; None if, as far as the
    library and sysfs tell, it can (whether the NIC takes GPU memory shows at the first registration)."""
    reason = unavailable_reason() or gpu_build_reason(device)
    if reason is None and not rdma_devices():
        reason = "/sys/class/infiniband lists no RDMA device"
    return reason


class TransferFailed(RuntimeError):
    """A write the engine refused, reported failed, or did not finish by the deadline.

    Not a ChannelError on purpose: the device-direct channel wraps any other
    mover error into one that names both stages and the message.
    """


@dataclass(frozen=True)
class _Target:
    endpoint: str  # the receiver engine's host:rpc_port (its P2P handshake address)
    addr: int  # the receive buffer's address in the receiver's process


class _Written(Completion):
    """A write that had completed when :meth:`MooncakeMover.write` returned."""

    def poll(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class MooncakeMover(Mover):
    """Writes between processes, on one host or several, through Mooncake's transfer engine.

    ``address`` is the local address the engine's handshake and data ports are
    reached at (the channel's NIC; never a wildcard), ``protocol`` the engine's
    transport ('tcp' or 'rdma'), ``nics`` a comma-separated list of RDMA
    devices to use (empty: every device Mooncake's topology finds, striped by
    nearness to the memory), ``deadline`` the longest one write may take.
    ``device`` is this rank's boundary device; a GPU needs a wheel built for
    its runtime.
    """

    def __init__(self, *, address: str = "127.0.0.1", protocol: str = "tcp", nics: str = "",
                 deadline: float = 300.0, device: torch.device | None = None) -> None:
        super().__init__()
        if protocol not in PROTOCOLS:
            raise ChannelError(f"the mooncake mover's protocol is {protocol!r}; expected one of {PROTOCOLS}")
        if not _ENDPOINT.match(f"{address}:0") or address in ("0.0.0.0", ""):
            raise ChannelError(f"the mooncake mover needs a concrete IPv4 address or host name to publish "
                               "(IPv6 and wildcards are refused), "
                               f"not {address!r}")
        reason = unavailable_reason()
        if reason is not None:
            raise ChannelError(reason)
        from mooncake import engine as mc

        self.device = torch.device(device) if device is not None else None
        reason = gpu_build_reason(self.device)
        if reason is not None:
            raise ChannelError(reason)
        if protocol == "rdma" and not rdma_devices():
            raise ChannelError("the mooncake mover was asked for RDMA but /sys/class/infiniband lists no device "
                               "on this node (python -m hetpipe.doctor shows what the node has)")
        # One engine per channel; its protocol is part of the name so a tcp
        # sender refuses an rdma receiver's region with the mover's own error.
        self.name = f"mooncake-{protocol}"
        self.protocol = protocol
        self.deadline = deadline
        self._engine = mc.TransferEngine()
        if self._engine.initialize(address, "P2PHANDSHAKE", protocol, nics) != 0:
            raise ChannelError(f"Mooncake's transfer engine failed to start on {address} over {protocol}"
                               + (f" with NICs {nics!r}" if nics else ""))
        self.endpoint = f"{address}:{self._engine.get_rpc_port()}"
        self._owned: dict[int, torch.Tensor] = {}  # data_ptr -> registered buffer (receive and staging)
        self._staging: dict[tuple[str, int], list[torch.Tensor]] = {}  # free staging buffers by (device, size)
        self._targets: dict[str, _Target] = {}
        self._side: dict[int, torch.cuda.Stream] = {}  # per GPU: where staging copies run
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._writing = 0
        self._closing = threading.Event()
        if protocol == "rdma":
            log.warning("device-direct over Mooncake RDMA (%s): RDMA, GPU memory registration (GPUDirect RDMA / "
                        "dma-buf) and ROCm have not been verified by hetpipe's tests; CI covers the TCP "
                        "transport only", nics or ",".join(rdma_devices()))

    # ----------------------------------------------------------- registration

    def _register(self, tensor: torch.Tensor) -> None:
        if self._engine.register_memory(tensor.data_ptr(), tensor.numel(), "*") != 0:
            raise ChannelError(f"Mooncake could not register {tensor.numel()} bytes of {tensor.device} memory "
                               f"for {self.protocol} (for GPU memory over RDMA: is nvidia-peermem / dma-buf or "
                               "the AMD peer-memory client available? python -m hetpipe.doctor checks)")
        self.registrations += 1

    def _new_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        with self._lock:
            if self._closing.is_set():
                raise ChannelError("the mooncake mover is closed")
            self._owned[tensor.data_ptr()] = tensor
        return tensor

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return self._new_buffer(nbytes, device)

    def register(self, tensor: torch.Tensor) -> RegionHandle:
        with self._lock:
            owned = self._owned.get(tensor.data_ptr()) is tensor
        if not owned:
            raise ChannelError("the mooncake mover registers only buffers it allocated")
        self._register(tensor)
        data = json.dumps({"endpoint": self.endpoint, "addr": tensor.data_ptr()}).encode()
        return RegionHandle(self.name, f"{self.endpoint}/{tensor.data_ptr():x}", tensor.numel(), data)

    def _open(self, handle: RegionHandle) -> torch.Tensor:
        try:
            info = json.loads(handle.data.decode())
            target = _Target(str(info["endpoint"]), int(info["addr"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise ChannelError(f"malformed mooncake region description: {handle.data[:200]!r}") from exc
        port = int(target.endpoint.rpartition(":")[2]) if _ENDPOINT.match(target.endpoint) else 0
        if not 0 < port < 65536 or target.addr <= 0:
            raise ChannelError(f"mooncake region description out of bounds: {handle.data[:200]!r}")
        with self._lock:
            self._targets[handle.key] = target
        # Nothing to map: the engine addresses the peer's memory by (endpoint, address).
        return torch.empty(0, dtype=torch.uint8)

    # ----------------------------------------------------------------- sender

    def capture(self, tensor: torch.Tensor) -> torch.cuda.Event | None:
        if not tensor.is_cuda:
            return None  # the staging copy in write() reads the tensor as it is then
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))
        tensor.record_stream(self._side_stream(tensor.device))
        return ready

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            stream = self._side.get(device.index)
            if stream is None:
                stream = self._side[device.index] = torch.cuda.Stream(device=device)
            return stream

    def _take_staging(self, nbytes: int, device: torch.device) -> torch.Tensor:
        with self._lock:
            free = self._staging.get((str(device), nbytes))
            if free:
                return free.pop()
        staging = self._new_buffer(nbytes, device)
        self._register(staging)
        return staging

    def _return_staging(self, staging: torch.Tensor) -> None:
        with self._lock:
            self._staging.setdefault((str(staging.device), staging.numel()), []).append(staging)

    def write(self, local: torch.Tensor, remote: RemoteRegion, offset: int, ready: Any = None) -> Completion:
        with self._lock:
            target = self._targets[remote.handle.key]
            if self._closing.is_set():
                raise TransferFailed("the mooncake mover is closing")
            self._writing += 1
        try:
            src = as_bytes(local)
            staging = self._take_staging(src.numel(), src.device)
            self._stage(src, staging, ready)
            self._post(staging, target, offset)
            return _Written()
        finally:
            with self._lock:
                self._writing -= 1
                self._idle.notify_all()

    def _stage(self, src: torch.Tensor, staging: torch.Tensor, ready: Any) -> None:
        if not src.is_cuda:
            staging.copy_(src)
            return
        side = self._side_stream(src.device)
        with torch.cuda.device(src.device), torch.cuda.stream(side):
            if ready is not None:
                side.wait_event(ready)
            staging.copy_(src, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        copied.synchronize()  # this is the channel's worker thread, not the training step

    def _post(self, staging: torch.Tensor, target: _Target, offset: int) -> None:
        """Write ``staging`` to ``target`` + ``offset`` and wait for it; the staging buffer goes back to the
        pool unless the engine may still read it (a write abandoned in flight)."""
        nbytes = staging.numel()
        what = f"mooncake {self.protocol} write of {nbytes} bytes to {target.endpoint}"
        engine = self._engine  # held here: close() may drop the mover's reference while this write polls
        batch = engine.transfer_submit_write(target.endpoint, staging.data_ptr(), target.addr + offset, nbytes)
        if batch <= 0:
            self._return_staging(staging)
            raise TransferFailed(f"{what} was refused (the peer's engine is unreachable or the address is not "
                                 "registered there)")
        until = time.monotonic() + self.deadline
        pause = _FIRST_POLL_S
        while True:
            # Once it returns non-zero the engine has freed the batch: never ask again.
            status = engine.transfer_check_status(batch)
            if status == 1:
                self._return_staging(staging)
                return
            if status < 0:
                # Every slice has finished, failed or not: nothing reads the staging buffer any more.
                self._return_staging(staging)
                raise TransferFailed(f"{what} failed" if status == -1 else f"{what} timed out in the engine "
                                     "(MC_TRANSFER_TIMEOUT)")
            if self._closing.is_set():
                # Slices may still be in flight and read the staging buffer: it is not reused.
                raise TransferFailed(f"{what} abandoned: the channel is closing")
            if time.monotonic() >= until:
                raise TransferFailed(f"{what} did not finish within {self.deadline:g} s")
            time.sleep(pause)
            pause = min(pause * 2, _MAX_POLL_S)

    # --------------------------------------------------------------- receiver

    def land(self, buffer: torch.Tensor, dest: torch.Tensor, signal: bytes) -> Landing:
        nbytes = dest.numel() * dest.element_size()
        if not dest.is_cuda:  # the channel allocates the buffer on the destination's device
            as_bytes(dest).copy_(buffer[:nbytes])
            return Landing(finish=None, reusable=lambda: True)
        copied: list[torch.cuda.Event] = []

        def finish() -> None:
            # On the caller's stream: enqueued after DONE arrived, so after the write; the host does not wait.
            stream = torch.cuda.current_stream(dest.device)
            with torch.cuda.stream(stream):
                as_bytes(dest).copy_(buffer[:nbytes], non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            copied.append(done)

        return Landing(finish=finish, reusable=lambda: bool(copied) and copied[0].query())

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        with self._lock:
            if self._closing.is_set():
                return
            self._closing.set()
            self._idle.wait_for(lambda: self._writing == 0, timeout=_CLOSE_WAIT_S)
        for stream in self._side.values():
            stream.synchronize()
        # The engine goes first: its threads stop touching registered memory
        # before the tensors behind it are freed.
        del self._engine
        with self._lock:
            self._owned.clear()
            self._staging.clear()
            self._targets.clear()
        super().close()
