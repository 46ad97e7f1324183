"""Authenticated TCP connections between a rank and its channel peers, found through the job's store.

The socket-based channels (CPU-forwarding :mod:`hetpipe.comm.tcp`, and the
device-direct channel's control connections) need the same thing before their
first message: one connection per (peer, stream), each one bound to a local
address (that is what pins a stream to a NIC) and each one past the mutual
challenge-response handshake (:mod:`hetpipe.comm.handshake`), which yields the
connection's session keys; the store only says where to dial, and whoever
answers there must prove the job secret. :func:`connect_peers` does it in one
deadline: every rank listens on one socket per local address and publishes
the endpoints in the job's store, accepts from lower-ranked peers and dials
higher-ranked ones, so each pair connects exactly once and nobody waits on
somebody who waits on them.

The accepting side is one selector loop over the listeners and every
half-finished handshake, so garbage, silent or wrong-secret clients never delay
the legitimate peer: each is dropped and logged once, and the loop keeps
waiting for the real peer until the deadline. A connection that has not
finished its handshake within ``_HANDSHAKE_SECONDS`` is dropped.
"""
from __future__ import annotations

import json
import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Sequence

import torch.distributed as dist

from hetpipe.comm.channel import ChannelError, ChannelTimeout
from hetpipe.comm.handshake import Responder, Session, introduce
from hetpipe.comm.sockets import tune

log = logging.getLogger(__name__)

# A connection that has not finished its handshake by then is dropped, so a
# half-open or silent client cannot hold an acceptor slot forever.
_HANDSHAKE_SECONDS = 10.0


def endpoint_key(rank: int) -> str:
    """The store key under which ``rank`` publishes its listening endpoints."""
    return f"hetpipe/tcp/{rank}"


def lookup_endpoints(store: dist.Store, rank: int, timeout: float) -> tuple[int, list[tuple[str, int]]]:
    """(streams_per_address, [(host, port), ...]) that ``rank`` published, waiting up to ``timeout``."""
    key = endpoint_key(rank)
    try:
        store.wait([key], timedelta(seconds=max(timeout, 0.001)))
        raw = store.get(key)
    except RuntimeError as exc:  # torch's DistStoreError on timeout
        raise ChannelTimeout(f"no channel endpoints published under {key!r} within {timeout:g} s: {exc}") from exc
    try:
        info = json.loads(raw.decode())
        return int(info["streams_per_address"]), [(str(h), int(p)) for h, p in info["endpoints"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ChannelError(f"malformed channel endpoints under {key!r}: {raw[:200]!r}") from exc


@dataclass(frozen=True)
class _Party:
    """This rank as the rendezvous sees it (the explicit parameters of :func:`connect_peers`)."""

    rank: int
    name_of: Callable[[int], str]
    addresses: tuple[str, ...]
    streams_per_address: int
    token: bytes
    deadline: float

    @property
    def name(self) -> str:
        return self.name_of(self.rank)

    @property
    def nstreams(self) -> int:
        return len(self.addresses) * self.streams_per_address


def connect_peers(store: dist.Store, *, rank: int, peers: Sequence[int], name_of: Callable[[int], str],
                  addresses: Sequence[str], streams_per_address: int, token: bytes,
                  deadline: float) -> dict[tuple[int, int], Session]:
    """Authenticated, blocking connections to every peer and their session keys, keyed (peer, stream index).

    Stream ``j`` of each pair goes from local address ``j % len(addresses)``
    to the peer's address of the same index, so every rank of the job must
    configure the same number of addresses and the same
    ``streams_per_address``. ``name_of`` names a rank in errors; ``token``
    is the job secret, which never leaves this process. Everything
    happens within ``deadline`` seconds; on failure no socket is left open.
    """
    me = _Party(rank, name_of, tuple(addresses), streams_per_address, token, deadline)
    until = time.monotonic() + deadline
    listeners: list[socket.socket] = []
    sockets: dict[tuple[int, int], Session] = {}
    try:
        listeners = _listen(me)
        # The address each listener was bound to, not its getsockname(): a
        # listener bound to a wildcard would publish 0.0.0.0, which no peer can
        # dial (comm/nics.py refuses wildcards before this point).
        store.set(endpoint_key(rank), json.dumps({
            "streams_per_address": streams_per_address,
            "endpoints": [[address, s.getsockname()[1]] for address, s in zip(me.addresses, listeners)]}))
        acceptor = _Acceptor(me, listeners, [p for p in peers if p < rank], until)
        acceptor.start()
        try:
            for peer in (p for p in peers if p > rank):
                for j, session in enumerate(_connect(me, store, peer, until)):
                    sockets[(peer, j)] = session
        except BaseException:
            acceptor.abort()
            raise
        sockets.update(acceptor.finish(until))
    except BaseException:
        for session in sockets.values():
            session.sock.close()
        raise
    finally:
        for sock in listeners:
            sock.close()
    return sockets


def _listen(me: _Party) -> list[socket.socket]:
    listeners = []
    try:
        for address in me.addresses:
            family, kind, proto, _, sockaddr = socket.getaddrinfo(
                address, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            sock = socket.socket(family, kind, proto)
            listeners.append(sock)
            sock.bind(sockaddr)
            sock.listen(128)
            sock.setblocking(False)
    except OSError as exc:
        for sock in listeners:
            sock.close()
        raise ChannelError(f"{me.name} cannot listen on {address}: {exc}") from exc
    return listeners


def _connect(me: _Party, store: dist.Store, peer: int, until: float) -> list[Session]:
    """Open and authenticate this rank's connections to a higher-ranked peer."""
    peer_name = me.name_of(peer)
    streams, endpoints = lookup_endpoints(store, peer, until - time.monotonic())
    if streams != me.streams_per_address or len(endpoints) != len(me.addresses):
        raise ChannelError(
            f"{me.name} uses {len(me.addresses)} addresses x {me.streams_per_address} streams but "
            f"{peer_name} uses {len(endpoints)} x {streams}: configure the same on every rank")
    sockets: list[socket.socket] = []
    sessions: list[Session] = []
    try:
        for j in range(me.nstreams):
            a = j % len(me.addresses)
            sock = _dial(me, me.addresses[a], endpoints[a], peer_name, until)
            sockets.append(sock)
            sessions.append(Session(sock, introduce(sock, rank=me.rank, peer=peer, stream=j, nstreams=me.nstreams,
                                                    secret=me.token, until=until, own_name=me.name,
                                                    peer_name=peer_name)))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sessions


def _dial(me: _Party, local: str, remote: tuple[str, int], peer_name: str, until: float) -> socket.socket:
    family, kind, proto, _, sockaddr = socket.getaddrinfo(remote[0], remote[1], type=socket.SOCK_STREAM)[0]
    delay = 0.02
    while True:
        sock = socket.socket(family, kind, proto)
        try:
            # Binding the source address is what pins the stream to one NIC.
            sock.bind((local, 0) if family == socket.AF_INET else (local, 0, 0, 0))
            sock.settimeout(max(until - time.monotonic(), 0.001))
            sock.connect(sockaddr)
            tune(sock)
            return sock
        except ConnectionRefusedError as exc:
            sock.close()
            if time.monotonic() + delay >= until:
                raise ChannelTimeout(f"{me.name} could not connect to {peer_name} at "
                                     f"{remote[0]}:{remote[1]} within {me.deadline:g} s: {exc}") from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        except socket.timeout as exc:
            sock.close()
            raise ChannelTimeout(f"{me.name} timed out connecting to {peer_name} at "
                                 f"{remote[0]}:{remote[1]}") from exc
        except OSError as exc:
            sock.close()
            raise ChannelError(f"{me.name} cannot connect from {local} to {peer_name} at "
                               f"{remote[0]}:{remote[1]}: {exc}") from exc


class _Acceptor(threading.Thread):
    """Accepts and authenticates the connections lower-ranked peers open to this rank."""

    def __init__(self, me: _Party, listeners: list[socket.socket], peers: list[int], until: float) -> None:
        super().__init__(daemon=True, name=f"hetpipe-accept-{me.rank}")
        self.me = me
        self.listeners = listeners
        self.expected = {(p, j) for p in peers for j in range(me.nstreams)}
        self.until = until
        self.accepted: dict[tuple[int, int], Session] = {}
        self.error: ChannelError | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        pending: dict[socket.socket, tuple[Responder, float]] = {}
        try:
            for sock in self.listeners:
                sel.register(sock, selectors.EVENT_READ, None)
            while self.expected - self.accepted.keys() and not self._halt.is_set():
                now = time.monotonic()
                if now >= self.until:
                    self.error = self._timeout_error()
                    return
                for key, _ in sel.select(min(0.2, self.until - now)):
                    if key.data is None:
                        self._accept(key.fileobj, sel, pending)
                    else:
                        self._read_handshake(key.fileobj, sel, pending)
                for sock, (_, started) in list(pending.items()):
                    if time.monotonic() - started > _HANDSHAKE_SECONDS:
                        self._refuse(sock, sel, pending, f"did not finish the handshake within "
                                                         f"{_HANDSHAKE_SECONDS:g} s")
        except Exception as exc:  # never leave the constructor waiting on a dead thread
            self.error = ChannelError(f"{self.me.name} failed while accepting connections: {exc}")
        finally:
            for sock in list(pending):
                self._drop(sock, sel, pending)
            sel.close()

    def finish(self, until: float) -> dict[tuple[int, int], Session]:
        """Wait for the loop, then hand over the authenticated sockets or raise its error."""
        self.join(max(until - time.monotonic(), 0.0) + 1.0)
        self._halt.set()
        self.join(1.0)
        if self.error is None and self.expected - self.accepted.keys():
            self.error = self._timeout_error()
        if self.error is not None:
            self.abort()
            raise self.error
        return dict(self.accepted)

    def abort(self) -> None:
        """Stop accepting and close whatever was accepted (setup failed elsewhere)."""
        self._halt.set()
        self.join(1.0)
        for session in self.accepted.values():
            session.sock.close()

    def _timeout_error(self) -> ChannelTimeout:
        missing = sorted({p for p, _ in self.expected - self.accepted.keys()})
        return ChannelTimeout(
            f"{self.me.name} waited {self.me.deadline:g} s for "
            f"{', '.join(self.me.name_of(p) for p in missing)} to connect "
            f"({len(self.accepted)} of {len(self.expected)} connections arrived)")

    def _accept(self, listener: socket.socket, sel: selectors.BaseSelector,
                pending: dict[socket.socket, tuple[Responder, float]]) -> None:
        while True:
            try:
                conn, remote = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of descriptors: keep serving the rest
                log.warning("%s: accept failed: %s", self.me.name, exc)
                return
            conn.setblocking(False)
            responder = Responder(secret=self.me.token, rank=self.me.rank, nstreams=self.me.nstreams,
                                  local=conn.getsockname(), remote=remote, expects=self._expects)
            pending[conn] = (responder, time.monotonic())
            sel.register(conn, selectors.EVENT_READ, "handshake")

    def _expects(self, rank: int, stream: int) -> bool:
        return (rank, stream) in self.expected and (rank, stream) not in self.accepted

    def _read_handshake(self, conn: socket.socket, sel: selectors.BaseSelector,
                        pending: dict[socket.socket, tuple[Responder, float]]) -> None:
        responder, _ = pending[conn]
        try:
            # Read exactly what the handshake message lacks: frames that follow belong to the channel.
            chunk = conn.recv(responder.missing())
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._refuse(conn, sel, pending, f"failed during the handshake: {exc}")
            return
        if not chunk:
            self._refuse(conn, sel, pending, "closed the connection during the handshake")
            return
        step = responder.feed(chunk)
        if step.reply and not self._answer(conn, step.reply):
            self._refuse(conn, sel, pending, "could not be answered")
            return
        if step.refused is not None:
            self._refuse(conn, sel, pending, step.refused)
            return
        if step.accepted is None or step.keys is None:
            return
        sel.unregister(conn)
        del pending[conn]
        conn.setblocking(True)
        tune(conn)
        self.accepted[step.accepted] = Session(conn, step.keys)

    @staticmethod
    def _answer(conn: socket.socket, reply: bytes) -> bool:
        try:
            # A handshake reply (under 100 bytes) fits any fresh socket's send buffer, so this never blocks.
            return conn.send(reply) == len(reply)
        except OSError:
            return False

    def _refuse(self, conn: socket.socket, sel: selectors.BaseSelector,
                pending: dict[socket.socket, tuple[Responder, float]], reason: str) -> None:
        """Drop a connection that did not authenticate, logging it once; the loop waits on for the real peer."""
        log.warning("%s refused a connection from %s: %s", self.me.name, pending[conn][0].where, reason)
        self._drop(conn, sel, pending)

    @staticmethod
    def _drop(conn: socket.socket, sel: selectors.BaseSelector,
              pending: dict[socket.socket, tuple[Responder, float]]) -> None:
        pending.pop(conn, None)
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
