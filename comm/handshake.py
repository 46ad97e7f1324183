"""Mutual challenge-response authentication that opens every connection of a socket-based channel.

Why it exists: endpoints are found through torch's TCPStore, which takes no
credentials and lists its keys. With the old one-way handshake (the connecting
side sent the job token in clear) a process that reached the store rewrote a
rank's endpoint, received the connecting rank's token, logged in to the real
peer with it and relayed every activation and gradient of a live run. Here
the job secret never crosses the wire, and a rank keeps a connection only to
a peer that proved, on that very TCP connection, that it holds the secret -
whatever the store says.

The protocol (version 2; the connecting side is the lower rank of each pair)::

    connector -> acceptor   HELLO      magic, version, connector rank, acceptor rank,
                                       stream, nstreams, nonce_c (32 fresh bytes)
    acceptor  -> connector  CHALLENGE  magic, verdict, nonce_a (32 fresh bytes),
                                       proof_a = HMAC(secret, "acceptor"  | T)
    connector -> acceptor   PROOF      magic, proof_c = HMAC(secret, "connector" | T)
    acceptor  -> connector  FINAL      magic, verdict

``T``, the transcript, holds a protocol label and version, both ranks, the
stream index and count, both nonces and the connection's TCP 4-tuple as each
side sees it: the connector's local address:port and the address:port it
dialed (the acceptor reads the same pair from ``getpeername``/``getsockname``).
HMAC-SHA256 throughout, compared with :func:`hmac.compare_digest`.

* Fresh nonces from both sides: a recorded proof is worthless later.
* The role label: a proof cannot be reflected (sent back to the side that
  made it, or replayed in the other role).
* The 4-tuple: a relay must terminate the connector's TCP connection and open
  its own to the real peer, so the real peer's proof covers the relay's
  address, not the one the connector dialed from, and the connector refuses
  it. Behind NAT the two sides see different 4-tuples and never agree; a
  training cluster's boundary links are routed, not NATed, so that is accepted.
* The connector checks the acceptor's proof before it sends its own proof or
  any data, so an impostor learns nothing it could use elsewhere (only a
  HELLO of ranks and a nonce).
* Both sides derive per-connection, per-direction keys from the secret and
  both nonces (HKDF, RFC 5869) for the optional per-message MAC
  (:mod:`hetpipe.comm.message_mac`).

What it does not do: encrypt (activations cross in clear), or protect the
bytes after the handshake from an attacker on the network path unless
``cluster.transport.message_mac`` is on. A peer that has the secret is
trusted. The acceptor answers any HELLO with a proof, so anyone who reaches a
listening port can test guesses of the secret offline: the secret must be
random (hetpipe's own launcher draws 256 bits), not a password.

Everything the protocol knows lives here: :func:`introduce` for the
connecting side; :class:`Responder` for the accepting side, which feeds it the
bytes of many half-finished handshakes from one selector loop
(:mod:`hetpipe.comm.rendezvous`).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import socket
import struct
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Callable, NamedTuple

from hetpipe.comm.channel import MAGIC, ChannelError, ChannelTimeout
from hetpipe.comm.sockets import recv_exact

# Version 1 sent the token in clear; a version-1 peer is refused and logged as such.
AUTH_VERSION = 2
NONCE_SIZE = 32
PROOF_SIZE = hashlib.sha256().digest_size
KEY_SIZE = 32
_LABEL = b"hetpipe channel authentication"
_ACCEPTOR, _CONNECTOR = b"acceptor", b"connector"
_KEYS_LABEL = b"hetpipe channel session keys"

# HELLO: magic, version, connector rank, acceptor rank, stream, nstreams, nonce_c.
_HELLO = struct.Struct(f"<4sHiiHH{NONCE_SIZE}s")
# CHALLENGE: magic, verdict, nonce_a, proof_a (zeros unless the verdict is ACCEPT).
_CHALLENGE = struct.Struct(f"<4sB{NONCE_SIZE}s{PROOF_SIZE}s")
# PROOF: magic, proof_c.
_PROOF = struct.Struct(f"<4s{PROOF_SIZE}s")
# FINAL: magic, verdict.
_FINAL = struct.Struct("<4sB")
HELLO_SIZE, CHALLENGE_SIZE, PROOF_MSG_SIZE, FINAL_SIZE = _HELLO.size, _CHALLENGE.size, _PROOF.size, _FINAL.size

Address = tuple[str, int]


class Verdict(IntEnum):
    ACCEPT = 0  # FINAL: authenticated; CHALLENGE: here is my proof, now prove yours
    WRONG_SECRET = 1  # FINAL: the connector's proof did not verify
    UNEXPECTED = 2  # right protocol, but this rank does not expect that (rank, stream)


@dataclass(frozen=True)
class SessionKeys:
    """One connection's message-MAC keys, one per direction (never printed)."""

    send: bytes = field(repr=False)
    recv: bytes = field(repr=False)


class Session(NamedTuple):
    """An authenticated connection and its keys."""

    sock: socket.socket
    keys: SessionKeys


def check_token(token: str, owner: str) -> bytes:
    """The job secret as the HMAC key (it never crosses the wire, so any length will do); empty is refused."""
    if not token:
        raise ChannelError(f"{owner} needs a non-empty job secret (HETPIPE_JOB_TOKEN)")
    return token.encode()


# ------------------------------------------------------------------ the transcript

def canonical_address(address: tuple) -> Address:
    """(host, port) as both ends spell it: IPv4-mapped IPv6 as IPv4, no scope, no flow info."""
    ip = ipaddress.ip_address(str(address[0]).split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(address[1])


def _field(data: bytes) -> bytes:
    return struct.pack("<H", len(data)) + data


@dataclass(frozen=True)
class Transcript:
    """Everything both proofs and the session keys are bound to."""

    connector: int
    acceptor: int
    stream: int
    nstreams: int
    nonce_c: bytes
    nonce_a: bytes
    connector_address: Address
    acceptor_address: Address

    def encode(self) -> bytes:
        return b"".join((
            _field(_LABEL), struct.pack("<HiiHH", AUTH_VERSION, self.connector, self.acceptor, self.stream,
                                        self.nstreams),
            _field(self.nonce_c), _field(self.nonce_a),
            *(_field(f"{host}|{port}".encode()) for host, port in (self.connector_address, self.acceptor_address))))

    def proof(self, secret: bytes, role: bytes) -> bytes:
        """HMAC-SHA256 under the job secret of ``role`` (who proves) and the transcript."""
        return hmac.new(secret, _field(role) + self.encode(), hashlib.sha256).digest()

    def keys(self, secret: bytes) -> tuple[bytes, bytes]:
        """(connector-to-acceptor, acceptor-to-connector) keys: HKDF-SHA256 (RFC 5869), salted by
        both nonces, so every connection has its own keys even with the same secret."""
        prk = hmac.new(self.nonce_c + self.nonce_a, secret, hashlib.sha256).digest()
        info, okm, block = _field(_KEYS_LABEL) + self.encode(), b"", b""
        for counter in (1, 2):
            block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
            okm += block
        return okm[:KEY_SIZE], okm[KEY_SIZE:2 * KEY_SIZE]


# --------------------------------------------------------------- connecting side

def encode_hello(rank: int, peer: int, stream: int, nstreams: int, nonce: bytes) -> bytes:
    """The connecting side's HELLO (exposed so tests can play a rogue peer)."""
    return _HELLO.pack(MAGIC, AUTH_VERSION, rank, peer, stream, nstreams, nonce)


def encode_proof(proof: bytes) -> bytes:
    """The connecting side's PROOF message (exposed so tests can play a rogue peer)."""
    return _PROOF.pack(MAGIC, proof)


def introduce(sock: socket.socket, *, rank: int, peer: int, stream: int, nstreams: int, secret: bytes,
              until: float, own_name: str, peer_name: str) -> SessionKeys:
    """Connecting side: authenticate a fresh connection to ``peer``; return its session keys.

    The peer must prove the secret before this side proves it or sends
    anything else. ``until`` is a :func:`time.monotonic` deadline; a refusal,
    a failed proof, a foreign peer or a lost connection is a
    :class:`ChannelError` naming both stages and the peer's address.
    """
    local, dialed = canonical_address(sock.getsockname()), canonical_address(sock.getpeername())
    where = f"{dialed[0]}:{dialed[1]}"
    nonce_c = secrets.token_bytes(NONCE_SIZE)
    try:
        sock.settimeout(max(until - time.monotonic(), 0.001))
        sock.sendall(encode_hello(rank, peer, stream, nstreams, nonce_c))
        magic, verdict, nonce_a, proof_a = _CHALLENGE.unpack(
            _read(sock, CHALLENGE_SIZE, until, own_name, peer_name, where))
        if magic != MAGIC:
            raise ChannelError(f"peer at {where} claiming to be {peer_name} answered {own_name}'s handshake with "
                               f"magic {bytes(magic)!r}: not a hetpipe channel")
        if verdict == Verdict.UNEXPECTED:
            raise ChannelError(
                f"peer {peer_name} at {where} refused the connection: it does not expect stream {stream} of "
                f"{nstreams} from {own_name} (check that both list each other as peers and use the same "
                "addresses and streams_per_address)")
        transcript = Transcript(rank, peer, stream, nstreams, nonce_c, nonce_a, local, dialed)
        if verdict != Verdict.ACCEPT or not hmac.compare_digest(proof_a, transcript.proof(secret, _ACCEPTOR)):
            raise ChannelError(
                f"peer at {where} claiming to be {peer_name} did not prove the job secret, so {own_name} "
                "refused it: a different HETPIPE_JOB_TOKEN, or not the peer at all (the endpoint in the store "
                "was rewritten, or the connection is relayed)")
        sock.sendall(encode_proof(transcript.proof(secret, _CONNECTOR)))
        magic, verdict = _FINAL.unpack(_read(sock, FINAL_SIZE, until, own_name, peer_name, where))
    except socket.timeout as exc:
        raise ChannelTimeout(f"{own_name} timed out in the handshake with {peer_name} at {where}") from exc
    except OSError as exc:
        raise ChannelError(f"{own_name} lost {peer_name} at {where} during the handshake: {exc}") from exc
    if magic != MAGIC or verdict != Verdict.ACCEPT:
        raise ChannelError(f"peer {peer_name} at {where} proved the job secret but refused {own_name}'s proof "
                           f"(verdict {verdict}): the two ranks disagree on the connection")
    c2a, a2c = transcript.keys(secret)
    return SessionKeys(send=c2a, recv=a2c)


def _read(sock: socket.socket, size: int, until: float, own_name: str, peer_name: str, where: str) -> bytes:
    sock.settimeout(max(until - time.monotonic(), 0.001))
    buf = bytearray(size)
    if recv_exact(sock, memoryview(buf)) < size:
        raise ChannelError(f"peer at {where} claiming to be {peer_name} closed the connection during "
                           f"{own_name}'s handshake")
    return bytes(buf)


# ---------------------------------------------------------------- accepting side

@dataclass(frozen=True)
class Step:
    """What the accepting loop does after feeding a :class:`Responder`.

    Send ``reply`` (if any) first; then either drop the connection and log
    ``refused`` once, hand the socket over as ``accepted`` (rank, stream)
    with ``keys``, or keep reading.
    """

    reply: bytes = b""
    refused: str | None = None
    accepted: tuple[int, int] | None = None
    keys: SessionKeys | None = None


class Responder:
    """The accepting side of one connection's handshake, fed bytes by a selector loop.

    ``expects(rank, stream)`` says whether that connection is still awaited;
    ``local`` and ``remote`` are the connection's addresses as this side sees them.
    """

    def __init__(self, *, secret: bytes, rank: int, nstreams: int, local: tuple, remote: tuple,
                 expects: Callable[[int, int], bool]) -> None:
        self.secret = secret
        self.rank = rank
        self.nstreams = nstreams
        self.local = canonical_address(local)
        self.remote = canonical_address(remote)
        self.expects = expects
        self._buf = bytearray()
        self._transcript: Transcript | None = None  # set once the CHALLENGE went out

    @property
    def where(self) -> str:
        return f"{self.remote[0]}:{self.remote[1]}"

    def missing(self) -> int:
        """Bytes the message being read still lacks (read no more: what follows belongs to the channel)."""
        return (HELLO_SIZE if self._transcript is None else PROOF_MSG_SIZE) - len(self._buf)

    def feed(self, data: bytes) -> Step:
        self._buf += data
        if self._buf[:len(MAGIC)] != MAGIC[:len(self._buf)]:
            return Step(refused="not a hetpipe handshake")  # garbage is refused at its first bytes
        if self.missing() > 0:
            return Step()
        message, self._buf = bytes(self._buf), bytearray()
        return self._hello(message) if self._transcript is None else self._proof(message)

    def _hello(self, message: bytes) -> Step:
        _magic, version, rank, acceptor, stream, nstreams, nonce_c = _HELLO.unpack(message)
        if version != AUTH_VERSION:
            return Step(refused=f"speaks handshake version {version}, this rank {AUTH_VERSION}: run the same "
                                "hetpipe version on every rank")
        if acceptor != self.rank or nstreams != self.nstreams or not self.expects(rank, stream):
            return Step(reply=_CHALLENGE.pack(MAGIC, Verdict.UNEXPECTED, bytes(NONCE_SIZE), bytes(PROOF_SIZE)),
                        refused=f"claims to be rank {rank} opening stream {stream} of {nstreams} to rank "
                                f"{acceptor}, which this rank does not expect")
        self._transcript = Transcript(rank, self.rank, stream, nstreams, nonce_c, secrets.token_bytes(NONCE_SIZE),
                                      self.remote, self.local)
        return Step(reply=_CHALLENGE.pack(MAGIC, Verdict.ACCEPT, self._transcript.nonce_a,
                                          self._transcript.proof(self.secret, _ACCEPTOR)))

    def _proof(self, message: bytes) -> Step:
        transcript = self._transcript
        assert transcript is not None
        _magic, proof_c = _PROOF.unpack(message)
        if not hmac.compare_digest(proof_c, transcript.proof(self.secret, _CONNECTOR)):
            return Step(reply=_FINAL.pack(MAGIC, Verdict.WRONG_SECRET),
                        refused=f"claims to be rank {transcript.connector} but did not prove the job secret")
        if not self.expects(transcript.connector, transcript.stream):  # a twin won the slot meanwhile
            return Step(reply=_FINAL.pack(MAGIC, Verdict.UNEXPECTED),
                        refused=f"rank {transcript.connector}'s stream {transcript.stream} is already connected")
        c2a, a2c = transcript.keys(self.secret)
        return Step(reply=_FINAL.pack(MAGIC, Verdict.ACCEPT), accepted=(transcript.connector, transcript.stream),
                    keys=SessionKeys(send=a2c, recv=c2a))
