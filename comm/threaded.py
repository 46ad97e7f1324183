"""One base for the channels that move bytes on background threads: TCP, device-direct, gloo.

Such a channel keeps per-peer state (sequence numbers, pending transfers, the
first error) and runs a few threads per peer, and it must keep the same
promises whatever its transport: a lost peer fails every pending transfer with
it, with the first error only; posting to a failed peer fails at once instead
of waiting out a deadline; ``close`` fails what is pending with a message
saying so, stops every thread within a bounded join and is idempotent. This
module keeps those promises once. A transport says what is pending
(:meth:`ThreadedChannel._abandon`), how to cut a peer off
(:meth:`ThreadedChannel._disconnect`) and what to free after its threads
stopped (:meth:`ThreadedChannel._release`).

A peer that fails while transfers are pending stops the whole job, not only
the rank that waits on it: :meth:`ThreadedChannel.notify_failures` hands that
first error to the job's watch (:mod:`hetpipe.launch.job_watch`) from the I/O thread
that saw it, so ranks blocked elsewhere (a collective, another boundary) learn
the cause at once instead of through a secondary timeout.
"""
from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from dataclasses import dataclass, field, replace
from typing import Callable, Generic, Iterable, TypeVar

import torch

from hetpipe.comm.channel import Channel, ChannelError, CompletionHandle, FrameHeader

log = logging.getLogger(__name__)


class PeerLost(ChannelError):
    """The connection to global rank ``peer`` closed or broke: its process or its node is gone."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


# How long close() waits for all threads together; they are daemons, so one
# stuck in a blocking call (gloo cannot cancel a receive) never holds up exit.
_JOIN_SECONDS = 2.0


@dataclass(eq=False, kw_only=True)
class PeerState:
    """What a threaded channel keeps per peer; a transport subclasses it for its own fields.

    ``cond`` guards every field and wakes threads waiting for a posted
    transfer; ``error`` is set once, by the first failure.
    """

    rank: int
    name: str
    cond: threading.Condition = field(default_factory=threading.Condition)
    threads: list[threading.Thread] = field(default_factory=list)
    send_seq: int = 0
    recv_seq: int = 0
    error: ChannelError | None = None


PeerT = TypeVar("PeerT", bound=PeerState)
HandleT = TypeVar("HandleT", bound=CompletionHandle)


class ThreadedChannel(Channel, Generic[PeerT]):
    """A :class:`Channel` whose transfers run on per-peer threads.

    ``transport`` names the threads (``hetpipe-<transport>-<role>-<rank>-<peer>``).
    A subclass fills ``self._peers`` with its :class:`PeerState` subclass,
    starts each peer's threads with :meth:`_start_thread`, and implements
    :meth:`_abandon` and :meth:`_disconnect`.
    """

    def __init__(self, rank: int, peers: Iterable[int], names: dict[int, str], deadline: float, *,
                 transport: str) -> None:
        super().__init__(rank, peers, names, deadline)
        self.transport = transport
        self._lock = threading.Lock()
        # True from the start of close(): failures are then the close, not a lost peer.
        self._closing = False
        self._peers: dict[int, PeerT] = {}
        self._on_failure: Callable[[ChannelError], None] | None = None

    def _start_thread(self, peer: PeerT, role: str, target: Callable[..., None], *args: object,
                      suffix: str = "") -> None:
        """Run ``target(peer, *args)`` on a daemon thread that :meth:`close` joins."""
        thread = threading.Thread(target=target, args=(peer, *args), daemon=True,
                                  name=f"hetpipe-{self.transport}-{role}-{self.rank}-{peer.rank}{suffix}")
        peer.threads.append(thread)
        thread.start()

    def notify_failures(self, callback: Callable[[ChannelError], None]) -> None:
        """Call ``callback(error)`` on the I/O thread when a peer fails while
        transfers with it are pending (never for :meth:`close`, nor for a peer
        that closes after the last transfer, as at the normal end of a job)."""
        self._on_failure = callback

    def _posting_peer(self, peer: int) -> PeerT:
        """The per-peer state a new transfer to or from ``peer`` is queued on."""
        self.check_open(peer)
        return self._peers[peer]

    def _receivable(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, which a transfer lands in byte for byte, so it must be contiguous."""
        if not tensor.is_contiguous():
            raise ChannelError(f"{self.name} cannot receive into a non-contiguous tensor "
                               f"(shape {list(tensor.shape)}, strides {tensor.stride()})")
        return tensor

    def _number(self, state: PeerT, header: FrameHeader, peer: int, *, send: bool,
                make_handle: Callable[[FrameHeader, str], HandleT]) -> tuple[FrameHeader, HandleT, bool]:
        """With ``state.cond`` held: ``header`` numbered in its direction's sequence, its handle
        (``make_handle(header, action)``), and whether it was posted. A peer that has already
        failed fails the handle at once (False) and the number stays free."""
        header = replace(header, seq=state.send_seq if send else state.recv_seq)
        handle = make_handle(header, self.send_action(header, peer) if send else self.recv_action(header, peer))
        if state.error is not None:
            handle.set_failed(state.error)
            return header, handle, False
        if send:
            state.send_seq += 1
        else:
            state.recv_seq += 1
        return header, handle, True

    @abstractmethod
    def _abandon(self, peer: PeerT) -> list[CompletionHandle]:
        """Called with ``peer.cond`` held once ``peer`` failed: take every pending
        transfer off ``peer`` and return the handles to fail."""

    @abstractmethod
    def _disconnect(self, peer: PeerT) -> None:
        """After the pending handles failed: make ``peer``'s threads return
        (queue sentinels, socket shutdown)."""

    def _release(self) -> None:
        """After close() joined every thread: free sockets, buffers, movers."""

    def _fail_peer(self, peer: PeerT, error: ChannelError, evident: bool = False) -> None:
        """Fail every pending transfer with ``peer`` and cut it off (first error wins).

        The failure is reported (:meth:`notify_failures`) when a transfer was pending,
        or when ``error`` is ``evident`` by itself: a peer whose connections all close
        while nothing is pending may just have finished the job, but one that closed
        some and left the others silent has not (comm/tcp.py's half-closed rule)."""
        with peer.cond:
            if peer.error is not None:
                return
            if self._closing:
                error = ChannelError(f"{self.name} closed its channel to {peer.name}")
            peer.error = error
            pending = self._abandon(peer)
            peer.cond.notify_all()
        if (pending or evident) and not self._closing:
            if self._on_failure is not None:
                self._on_failure(error)  # the watch reports it; a log line would only repeat it
            else:
                log.error("%s", error)
        for handle in pending:
            handle.set_failed(error)
        self._disconnect(peer)

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
            for thread in peer.threads:
                thread.join(max(until - time.monotonic(), 0.0))
        self._release()
