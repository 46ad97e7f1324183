"""The striped TCP channel's links: which connection carries which piece, and naming the one that stalled.

:mod:`hetpipe.comm.tcp` moves bytes; this module is its bookkeeping of the
connections as *links* and what it says when one stops. Piece ``p`` of message
``seq`` travels on link ``(seq + p) % n`` (:func:`link_of`), so a transfer
that lacks a piece knows which link owed it. Each :class:`Link` records when a
piece last crossed it; :func:`stall_report` turns that into the error a lost
link gives (interface, both addresses, how long it carried nothing while
another link of the same peer was moving data), and :class:`LinkStalled` is
that error, which :mod:`hetpipe.launch.job_watch` reports as the job's cause. A
transfer with no evidence against any one link (nothing moved anywhere) gets no
report: the peer stopped, not a link.
"""
from __future__ import annotations

import queue
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from hetpipe.comm.channel import ChannelError, ChannelTimeout, CompletionHandle, FrameHeader
from hetpipe.comm.message_mac import FrameMac
from hetpipe.comm.nics import list_interfaces

# Below this, striping costs more syscalls than it saves.
MIN_PIECE_BYTES = 256 * 1024


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


def link_of(seq: int, piece: int, nlinks: int) -> int:
    """The connection that carries piece ``piece`` of message ``seq``."""
    return (seq + piece) % nlinks


class LinkStalled(ChannelTimeout):
    """A transfer with global rank ``peer`` timed out while a piece it owes was due on a named link."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


@dataclass(eq=False)
class Link:
    """One TCP connection to a peer; piece j of every striped message uses link j."""

    sock: socket.socket
    index: int
    mac: FrameMac | None = None  # set with message_mac: every frame carries tags (comm/message_mac.py)
    # (send op, offset, length) pieces for this link's sender thread; None stops it.
    queue: "queue.SimpleQueue[tuple[Any, int, int] | None]" = field(default_factory=queue.SimpleQueue)
    # When a piece last finished crossing this connection (either way), for stall reports.
    last_activity: float = field(default_factory=time.monotonic)
    local: str = field(init=False)
    remote: str = field(init=False)

    def __post_init__(self) -> None:
        self.local, self.remote = self.sock.getsockname()[0], self.sock.getpeername()[0]

    def describe(self, interfaces: dict[str, str], incoming: bool) -> str:
        """``eth2 10.202.0.2 <- 10.202.0.1`` (the arrow follows the data)."""
        name = interfaces.get(self.local)
        return f"{name + ' ' if name else ''}{self.local} {'<-' if incoming else '->'} {self.remote}"


# A receive that has some of its pieces but lacks the rest for half the
# deadline, at most this long, has a stalled link (TcpChannel._watch_links).
# Equal pieces queued at once on links of equal speed arrive within
# milliseconds of each other; a minute is a link that stopped.
_STALL_CAP_S = 60.0


def stall_after(deadline: float) -> float:
    """Seconds after which a link that carried nothing, while its peer's other
    links moved or closed, has stalled: half the deadline, at most a minute."""
    return min(deadline / 2, _STALL_CAP_S)


class StallNamingHandle(CompletionHandle):
    """A transfer's handle whose timeout names the link(s) a missing piece was due on.

    ``stalled`` turns the wait's own :class:`ChannelTimeout` into the error to
    raise (a :class:`LinkStalled` where a link is to blame, else the same one).
    """

    def __init__(self, *, stalled: Callable[[ChannelTimeout], ChannelTimeout], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._stalled: Callable[[ChannelTimeout], ChannelTimeout] | None = stalled

    # An ended transfer stalls nowhere, so the callback goes: it holds the
    # transfer, which holds this handle, and that cycle kept every message's
    # tensor until Python's cycle collector ran (1.9-2.9 GiB more than NCCL
    # at a step's start, LLaMA-3-8B seq 8192 on 2xH100, docs/benchmarks.md).
    def set_done(self) -> None:
        self._stalled = None
        super().set_done()

    def set_failed(self, error: ChannelError) -> None:
        self._stalled = None
        super().set_failed(error)

    def wait(self, timeout: float | None = None) -> None:
        try:
            super().wait(timeout)
        except ChannelTimeout as exc:
            stalled = self._stalled
            if self.done() or stalled is None:  # the transfer ended (a timeout of its own, or just now)
                raise
            raise stalled(exc) from None


def stall_report(links: list[Link], header: FrameHeader, done: set[int], *, incoming: bool) -> str | None:
    """Which of a peer's ``links`` owe message ``header`` a piece and for how long they
    carried nothing - when another link carried its piece (``done``: the indices
    of links whose piece of it was written or arrived) or moved data since, so the
    sender was sending and one link did not carry its share; else None.
    ``incoming``: the message is being received (the arrow in the names)."""
    n = len(links)
    due = {link_of(header.seq, p, n) for p in range(len(split_pieces(header.nbytes, n)))}
    owing = [links[j] for j in sorted(due - done)]
    if not owing:
        return None
    now = time.monotonic()
    quiet = min(now - link.last_activity for link in owing)
    moving = [link for link in links if link not in owing and now - link.last_activity < quiet]
    if not moving and not done:
        return None  # nothing moved on any link: the peer stopped, not a link
    names = {a: i.name for i in list_interfaces() for a in i.addresses}
    stalled = ", ".join(link.describe(names, incoming) for link in owing)
    alive = "; ".join([f"{links[j].describe(names, incoming)} carried its piece" for j in sorted(done)]
                      + [f"{link.describe(names, incoming)} moved data {now - link.last_activity:.1f} s ago"
                         for link in moving if link.index not in done])
    return (f"link {stalled} carried nothing for {quiet:.1f} s while its piece of message #{header.seq} "
            f"was due ({alive})")


def half_closed_report(links: list[Link], closed: set[int]) -> str:
    """The error of a peer that closed links ``closed`` (their indices) half the deadline ago
    while the others carried nothing since, not even their close: its process ended, and
    the way over those is gone too. With no piece in flight nothing else gives it away
    before the deadline, and then only as a wait on another rank that names no link
    (a NIC taken down on a switched node: tests/test_nic_faults.py)."""
    names = {a: i.name for i in list_interfaces() for a in i.addresses}
    shut = ", ".join(links[j].describe(names, True) for j in sorted(closed))
    silent = [link for link in links if link.index not in closed]
    quiet = min(time.monotonic() - link.last_activity for link in silent)
    return (f"the peer closed link {shut}, but link {', '.join(link.describe(names, True) for link in silent)} "
            f"has carried nothing for {quiet:.1f} s, not even the close")
