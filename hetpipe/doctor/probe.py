"""The doctor's NIC probes: can node A's NIC j reach node B's NIC j, and how fast?

Split from the fact sheet because it is the one part of the doctor that talks
to the network: each node listens on its selected addresses
(:class:`ProbeServer`), and dials every peer's listener from its own NIC of
the same stripe index, bound to it as the channel dials, then streams bytes
for ``doctor.bandwidth_s``. The listener answers only a dialler that knows
its node's nonce, so a stale or foreign listener cannot pass for reachable.
"""
from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import asdict
from typing import Any

from hetpipe.comm.nics import Nic, tx_bytes
from hetpipe.doctor.config import DoctorSettings

_PROBE_MAGIC = b"HPDOCTOR"
# What the dialler sends per sendall(): large enough that the timing is of the link, not of Python.
_CHUNK = memoryview(bytes(256 << 10))
# The listener's read buffer: it only counts the bytes.
_RECV_BYTES = 1 << 20


class ProbeServer:
    """Listeners on this node's selected addresses that peers' doctors dial.

    A peer proves it meant this node by sending the nonce from this node's
    fact sheet (a stale or foreign listener on a reused port would otherwise
    pass for reachable), then streams bytes until it shuts its side; the reply
    is the byte count, so the peer times the whole transfer end to end.
    """

    def __init__(self, addresses: list[str], nonce: str, io_timeout_s: float) -> None:
        self.nonce = bytes.fromhex(nonce)
        self.io_timeout_s = io_timeout_s
        self.listeners: list[socket.socket] = []
        try:
            for address in addresses:
                family = socket.AF_INET6 if ":" in address else socket.AF_INET
                self.listeners.append(socket.create_server((address, 0), family=family))
        except OSError:
            self.close()
            raise
        for listener in self.listeners:
            # accept() with a timeout: close() from another thread does not wake a blocked accept().
            listener.settimeout(0.2)
            threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    @property
    def endpoints(self) -> list[list]:
        return [list(s.getsockname()[:2]) for s in self.listeners]

    def close(self) -> None:
        for listener in self.listeners:
            listener.close()

    def _accept(self, listener: socket.socket) -> None:
        while listener.fileno() != -1:
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(self.io_timeout_s)
                if _recv_exact(conn, len(_PROBE_MAGIC) + len(self.nonce)) != _PROBE_MAGIC + self.nonce:
                    return
                conn.sendall(b"OK")
                total, buf = 0, bytearray(_RECV_BYTES)
                while n := conn.recv_into(buf):
                    total += n
                conn.sendall(struct.pack("!Q", total))
            except OSError:
                pass  # the dialling side reports what went wrong


def probe(local: Nic, remote: tuple[str, int], nonce: str, connect_timeout_s: float, seconds: float,
          io_timeout_s: float) -> dict[str, Any]:
    """Dial ``remote`` from ``local`` (bound to it, as the channel dials) and send
    for ``seconds``: {"ok", "mb_per_s", "error", "tx_short"}. ``tx_short`` is
    True when the local interface's byte counter grew by less than what was
    sent, i.e. the kernel routed the traffic through another interface."""
    family = socket.AF_INET6 if ":" in remote[0] else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(connect_timeout_s)
            sock.bind((local.address, 0))
            sock.connect(tuple(remote))
            sock.settimeout(io_timeout_s)
            sock.sendall(_PROBE_MAGIC + bytes.fromhex(nonce))
            try:
                reply = _recv_exact(sock, 2)
            except ConnectionError:  # a doctor hangs up on a wrong nonce
                reply = b""
            if reply != b"OK":
                return {"ok": False, "error": "the listener there is not that node's doctor"}
            before = tx_bytes(local.name) if local.name else None
            sent, start = 0, time.monotonic()
            while time.monotonic() - start < seconds:
                sock.sendall(_CHUNK)
                sent += len(_CHUNK)
            sock.shutdown(socket.SHUT_WR)
            received = struct.unpack("!Q", _recv_exact(sock, 8))[0]
            elapsed = time.monotonic() - start
            after = tx_bytes(local.name) if local.name else None
    except OSError as exc:
        return {"ok": False, "error": describe_os_error(exc)}
    if received != sent:
        return {"ok": False, "error": f"the peer received {received} of {sent} bytes"}
    return {"ok": True, "mb_per_s": round(received / elapsed / 1e6, 1),
            "tx_short": before is not None and after is not None and after - before < sent}


def probe_peers(me: dict, nics: list[Nic], sheets: dict[int, dict], settings: DoctorSettings) -> list[dict]:
    """Probe every peer's NIC j from this node's NIC j (the channel pairs
    stripes by index); peers with another NIC count are left to the blockers."""
    results = []
    for node, sheet in sorted(sheets.items()):
        if node == me["node"] or len(sheet["endpoints"]) != len(nics):
            continue
        for nic, endpoint, peer_nic in zip(nics, sheet["endpoints"], sheet["nics"]):
            result = probe(nic, tuple(endpoint), sheet["nonce"], settings.connect_timeout_s, settings.bandwidth_s,
                           settings.timeout_s)
            results.append({"src": me["node"], "dst": node, "src_nic": asdict(nic),
                            "dst_nic": peer_nic, "endpoint": endpoint, **result})
    return results


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes (recv may return fewer); ConnectionError when the peer hangs up first."""
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed early")
        buf += chunk
    return buf


def describe_os_error(exc: OSError) -> str:
    """A socket error as the report names it: "timed out", else the OS's own words."""
    if isinstance(exc, socket.timeout):
        return "timed out"
    return exc.strerror or str(exc) or type(exc).__name__
