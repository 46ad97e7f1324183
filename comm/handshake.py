"""The job-token handshake that opens every connection of a socket-based channel.

A boundary connection is trusted only once the peer proved it belongs to the
job: the connecting side (the lower rank of each pair) introduces itself
(rank, stream index, stream count) and presents the job's token; the accepting
side compares the token with :func:`hmac.compare_digest` and answers with one
verdict before it reads anything else from that connection.

Everything the protocol knows lives here, behind entry points with explicit
parameters: :func:`introduce` for the connecting side; :func:`hello_missing`,
:func:`decode_hello`, :func:`judge` and :func:`encode_reply` for the accepting
side, which feeds them the bytes of many half-finished handshakes from one
selector loop (:mod:`hetpipe.comm.rendezvous`). A stronger scheme (mutual HMAC
challenge-response is planned) replaces this module, not the rendezvous or the
channels.
"""
from __future__ import annotations

import hmac
import socket
import struct
import time
from dataclasses import dataclass
from enum import IntEnum

from hetpipe.comm.channel import MAGIC, VERSION, ChannelError, ChannelTimeout
from hetpipe.comm.sockets import recv_exact

# Sent by the connecting side: magic, version, rank, stream index, total
# streams, token length; then the token bytes.
_HELLO = struct.Struct("<4sHiHHI")
# The accepting side's answer: magic, verdict.
_REPLY = struct.Struct("<4sB")
REPLY_SIZE = _REPLY.size
MAX_TOKEN_BYTES = 4096


class Verdict(IntEnum):
    ACCEPT = 0
    WRONG_TOKEN = 1
    UNEXPECTED = 2  # right job, but this rank does not expect that (rank, stream)


def encode_reply(verdict: Verdict) -> bytes:
    return _REPLY.pack(MAGIC, verdict)


ACCEPTED_REPLY = encode_reply(Verdict.ACCEPT)


@dataclass(frozen=True)
class Hello:
    """What a connecting peer says about itself."""

    rank: int
    stream: int
    nstreams: int
    token: bytes


def check_token(token: str, owner: str) -> bytes:
    """The job token as the handshake carries it; a missing or oversized one is refused up front."""
    if not token:
        raise ChannelError(f"{owner} needs a non-empty job token")
    raw = token.encode()
    if len(raw) > MAX_TOKEN_BYTES:
        raise ChannelError(f"job token is longer than {MAX_TOKEN_BYTES} bytes")
    return raw


def encode_hello(rank: int, stream: int, nstreams: int, token: str | bytes) -> bytes:
    """The connecting side's hello (exposed so tests can play a rogue peer)."""
    raw = token.encode() if isinstance(token, str) else token
    return _HELLO.pack(MAGIC, VERSION, rank, stream, nstreams, len(raw)) + raw


def hello_missing(received: bytes | bytearray) -> int | None:
    """How many more bytes the hello begun in ``received`` needs (0: complete),
    or None once ``received`` cannot be a hetpipe hello (drop the connection)."""
    if len(received) < _HELLO.size:
        return _HELLO.size - len(received)
    magic, version, _rank, _stream, _nstreams, token_len = _HELLO.unpack_from(received)
    if magic != MAGIC or version != VERSION or token_len > MAX_TOKEN_BYTES:
        return None
    return _HELLO.size + token_len - len(received)


def decode_hello(received: bytes | bytearray) -> Hello:
    """The complete hello in ``received`` (for which :func:`hello_missing` returned 0)."""
    _magic, _version, rank, stream, nstreams, _token_len = _HELLO.unpack_from(received)
    return Hello(rank, stream, nstreams, bytes(received[_HELLO.size:]))


def judge(hello: Hello, token: bytes, *, expected: bool) -> Verdict:
    """The answer to ``hello``: the token first, then whether its (rank, stream) is ``expected``."""
    if not hmac.compare_digest(hello.token, token):
        return Verdict.WRONG_TOKEN
    return Verdict.ACCEPT if expected else Verdict.UNEXPECTED


def introduce(sock: socket.socket, *, rank: int, stream: int, nstreams: int, token: bytes, until: float,
              own_name: str, peer_name: str) -> None:
    """Connecting side: present ``token`` on a fresh connection and return once the peer accepted it.

    ``until`` is a :func:`time.monotonic` deadline; a refusal, a foreign peer
    or a lost connection is a :class:`ChannelError` naming both stages.
    """
    try:
        sock.settimeout(max(until - time.monotonic(), 0.001))
        sock.sendall(encode_hello(rank, stream, nstreams, token))
        reply = bytearray(REPLY_SIZE)
        got = recv_exact(sock, memoryview(reply))
    except socket.timeout as exc:
        raise ChannelTimeout(f"{own_name} timed out in the handshake with {peer_name}") from exc
    except OSError as exc:
        raise ChannelError(f"{own_name} lost {peer_name} during the handshake: {exc}") from exc
    if got < REPLY_SIZE:
        raise ChannelError(f"peer {peer_name} closed the connection during the handshake")
    magic, verdict = _REPLY.unpack(reply)
    if magic != MAGIC:
        raise ChannelError(f"peer {peer_name} answered the handshake with magic {bytes(magic)!r}: "
                           "not a hetpipe channel")
    if verdict == Verdict.WRONG_TOKEN:
        raise ChannelError(f"peer {peer_name} refused the connection: wrong job token")
    if verdict != Verdict.ACCEPT:
        raise ChannelError(
            f"peer {peer_name} refused the connection: it does not expect stream {stream} of "
            f"{nstreams} from {own_name} (check that both list each other as peers and use "
            "the same addresses and streams_per_address)")
