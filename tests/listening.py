"""Which TCP addresses a set of processes listens on, read from /proc as ``ss -ltnp`` would.

Each process's own ``/proc/PID/net/tcp`` and ``tcp6`` list the sockets of its
network namespace; a socket is the process's when one of its descriptors
points at its inode. Shared by tests/test_store_bind.py and
tests/test_node_faults.py.
"""
from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Iterable

_LISTEN = "0A"  # the TCP state in /proc/net/tcp


def listening(pids: Iterable[int]) -> set[tuple[int, str, int]]:
    """``(pid, address, port)`` for every listening TCP socket of ``pids`` (those still alive)."""
    found = set()
    for pid in pids:
        sockets = _listening_inodes(pid)
        for inode in _socket_inodes(pid):
            if inode in sockets:
                found.add((pid, *sockets[inode]))
    return found


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _listening_inodes(pid: int) -> dict[str, tuple[str, int]]:
    found = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN:
                found[fields[9]] = _address(fields[1])
    return found


def _socket_inodes(pid: int) -> list[str]:
    inodes = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.append(target[8:-1])
    return inodes


def _address(field: str) -> tuple[str, int]:
    """``0100007F:1F90`` -> ``("127.0.0.1", 8080)``: /proc prints each 32-bit word in host (little-endian) order."""
    raw, port = field.split(":")
    words = [bytes.fromhex(raw[i:i + 8])[::-1] for i in range(0, len(raw), 8)]
    return str(ipaddress.ip_address(b"".join(words))), int(port, 16)
