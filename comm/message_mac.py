"""Optional per-message integrity for the tcp channel: a MAC over every frame's header and payload.

Why: the handshake (:mod:`hetpipe.comm.handshake`) proves who is at the other
end of a connection, which stops a relay that found its way in through the
store. It does not stop an attacker on the network path itself (ARP or route
spoofing, a compromised switch or hypervisor) from altering the bytes of an
authenticated TCP connection afterwards. With ``cluster.transport.message_mac:
true`` every frame of the tcp channel goes out as::

    header | tag(n, header) | payload | tag(n, header, payload)

Each tag is HMAC-SHA256 under the connection's key for that direction (both
keys derived in the handshake from the job secret and both nonces, so every
connection and direction has its own). ``n`` is the frame's number on that
connection and direction; it is never sent, both ends count, so a frame that
is altered, replayed, dropped, reordered or moved from another connection
fails its tag. The header's tag is checked before the header is believed, so a
tampered length or sequence number never steers where bytes land or desyncs
the stream. A piece's bytes are checked before its message counts as
received; a bad tag fails the peer's pending transfers with one error naming
both stages, and the connection is not used again.

Integrity only: the standard library has no cipher, so activations still
cross in clear. Off by default because HMAC-SHA256 hashes every byte once
more on each side, at 1.3 to 2 GB/s per core (OpenSSL 3.0 with SHA-NI). With
``scripts/bench_channel.py --device cpu --transports tcp,tcp+mac --message-mac
--sizes 1MiB,16MiB,64MiB`` on the 16-core Xeon of the H100 host, 64 MiB
messages fell from 3.3 to 0.87 GB/s on one connection and from 11.6 to 3.5
GB/s on four: each connection hashes on its own sender and receiver threads
(hashlib releases the GIL), so more streams buy the throughput back where
cores are free. The full table is in docs/benchmarks.md.
"""
from __future__ import annotations

import hashlib
import hmac
import socket
import struct

from hetpipe.comm.channel import ChannelError
from hetpipe.comm.handshake import SessionKeys
from hetpipe.comm.sockets import recv_exact

TAG_SIZE = hashlib.sha256().digest_size
# Payloads are hashed and sent (or received and hashed) in slices of this size,
# so each slice is hashed while it is still in cache.
_SLICE = 1 << 20
# Frames up to this size go out in one send (as tcp.py coalesces small pieces).
_ONE_SEND_BYTES = 64 * 1024
_COUNTER = struct.Struct("<Q")


class FrameMac:
    """The MAC state of one connection: a key and a frame counter per direction.

    One sender thread and one receiver thread use it; they touch disjoint halves.
    ``own``/``peer`` name the two stages in errors; ``connection`` is the
    stream index of this connection.
    """

    def __init__(self, keys: SessionKeys, *, own: str, peer: str, connection: int) -> None:
        self._keys = keys
        self.own, self.peer, self.connection = own, peer, connection
        self._sent = 0
        self._received = 0
        self._inbound: "hmac.HMAC | None" = None  # running MAC of the frame being received

    def _start(self, key: bytes, number: int) -> "hmac.HMAC":
        return hmac.new(key, _COUNTER.pack(number), hashlib.sha256)

    # ------------------------------------------------------------------ sending

    def send_frame(self, sock: socket.socket, head: bytes, payload: memoryview) -> None:
        """Write ``head`` and ``payload`` with their tags."""
        mac = self._start(self._keys.send, self._sent)
        self._sent += 1
        mac.update(head)
        head_tag = mac.copy().digest()
        if len(payload) <= _ONE_SEND_BYTES:
            mac.update(payload)
            sock.sendall(b"".join((head, head_tag, payload, mac.digest())))
            return
        sock.sendall(head + head_tag)
        for start in range(0, len(payload), _SLICE):
            piece = payload[start:start + _SLICE]
            mac.update(piece)
            sock.sendall(piece)
        sock.sendall(mac.digest())

    # ---------------------------------------------------------------- receiving

    def open_header(self, head_and_tag: memoryview) -> None:
        """Check a received header's tag (before anything reads the header) and start the frame's MAC."""
        mac = self._start(self._keys.recv, self._received)
        self._received += 1
        mac.update(head_and_tag[:-TAG_SIZE])
        if not hmac.compare_digest(mac.copy().digest(), head_and_tag[-TAG_SIZE:]):
            raise self._error("its header")
        self._inbound = mac

    def recv_payload(self, sock: socket.socket, view: memoryview) -> int:
        """Fill ``view`` from ``sock`` (as :func:`recv_exact`), hashing every slice as it lands."""
        got = 0
        for start in range(0, len(view), _SLICE):
            piece = view[start:start + _SLICE]
            n = recv_exact(sock, piece)
            self.absorb(piece[:n])
            got += n
            if n < len(piece):
                break
        return got

    def absorb(self, data: memoryview) -> None:
        """Hash payload bytes that were read but discarded (a rejected piece is still authenticated)."""
        assert self._inbound is not None, "open_header first"
        self._inbound.update(data)

    def close_payload(self, sock: socket.socket) -> None:
        """Read the payload's tag and check it; a mismatch is a :class:`ChannelError` naming both stages."""
        assert self._inbound is not None, "open_header first"
        tag = bytearray(TAG_SIZE)
        got = recv_exact(sock, memoryview(tag))
        if got < TAG_SIZE:
            raise ChannelError(f"connection to {self.peer} closed mid-message: received {got} of "
                               f"{TAG_SIZE} message-MAC bytes")
        mac, self._inbound = self._inbound, None
        if not hmac.compare_digest(mac.digest(), bytes(tag)):
            raise self._error("its payload")

    def _error(self, what: str) -> ChannelError:
        return ChannelError(
            f"{self.own} received a frame from {self.peer} whose message MAC does not match {what} "
            f"(frame #{self._received - 1} on connection {self.connection}): it was altered, replayed or "
            "reordered in flight, so the connection is no longer trusted")
