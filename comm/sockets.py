"""Blocking-socket helpers shared by the socket-based channels and their handshake.

TCP delivers a byte stream in whatever slices the kernel chooses, while every
hetpipe message on a socket (a handshake reply, a frame header, a control
message, a tensor piece) has a known length: readers need "fill this buffer,
or say how much arrived before the peer closed", and every connection wants
the same options, set in one place.
"""
from __future__ import annotations

import socket


def tune(sock: socket.socket) -> None:
    """Small headers must not wait for Nagle; dead hosts must be noticed by keepalive."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def recv_exact(sock: socket.socket, view: memoryview) -> int:
    """Fill ``view``; return how many bytes arrived before EOF (len(view) when complete)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            break
        got += n
    return got
