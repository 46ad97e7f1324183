"""Emulated nodes (scripts/emulated_nodes.py) behave like network hosts with two NICs.

Traffic is a tiny Python TCP sender and sink started inside the namespaces
with ``ip netns exec``, so what is measured is what a hetpipe rank in a node
would see. Needs root (the fixtures skip otherwise); the file takes a few seconds.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from emulated_nodes import SCRIPT, emu, emulated_nodes, make_emulated_nodes, netns_available  # noqa: F401 (fixtures)

PORT = 5201
MIB = 1024 * 1024
# `sink ADDR PORT`: accept one connection, count bytes to EOF, ack, print bytes and
# seconds from the first byte (so connection setup and the sender's startup are
# not in the rate). `send ADDR PORT NBYTES CONNECT_TIMEOUT`: send, wait for the
# ack, print what happened; a failure is printed as its errno name.
PEER = r"""
import errno, json, socket, sys, time
mode, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "sink":
    srv = socket.create_server((addr, port))
    srv.settimeout(20)
    print("ready", flush=True)
    conn, _ = srv.accept()
    conn.settimeout(20)
    total, first = 0, None
    while chunk := conn.recv(1 << 16):
        first = first or time.monotonic()
        total += len(chunk)
    seconds = time.monotonic() - first
    conn.sendall(b"k")
    print(json.dumps({"bytes": total, "seconds": seconds}), flush=True)
else:
    try:
        conn = socket.create_connection((addr, port), timeout=float(sys.argv[5]))
        conn.settimeout(20)
        conn.sendall(bytes(int(sys.argv[4])))
        conn.shutdown(socket.SHUT_WR)
        print(json.dumps({"ok": conn.recv(1) == b"k"}))
    except OSError as exc:
        print(json.dumps({"error": errno.errorcode.get(exc.errno, type(exc).__name__)}))
"""


@contextmanager
def sink(node: emu.Node, nic: str) -> Iterator[subprocess.Popen]:
    proc = emu.run_in(node, [sys.executable, "-c", PEER, "sink", node.addrs[nic], str(PORT)],
                      stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def send(src: emu.Node, addr: str, nbytes: int, connect_timeout: float = 5.0) -> dict:
    proc = emu.run_in(src, [sys.executable, "-c", PEER, "send", addr, str(PORT), str(nbytes),
                            str(connect_timeout)], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    return json.loads(out)


def transfer(src: emu.Node, dst: emu.Node, nic: str, nbytes: int) -> dict:
    """Send ``nbytes`` from ``src`` to ``dst``'s address on ``nic``; the sink's bytes and seconds."""
    with sink(dst, nic) as proc:
        assert send(src, dst.addrs[nic], nbytes) == {"ok": True}
        out, _ = proc.communicate(timeout=30)
    result = json.loads(out)
    assert result["bytes"] == nbytes
    return result


def mbit_per_s(result: dict) -> float:
    return result["bytes"] * 8 / result["seconds"] / 1e6


def host_links() -> str:
    return subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout


def test_both_nics_reach_the_other_node(emulated_nodes):
    node0, node1 = emulated_nodes.nodes
    assert node0.addrs == {"eth1": "10.201.0.1", "eth2": "10.202.0.1"}
    assert node1.addrs == {"eth1": "10.201.0.2", "eth2": "10.202.0.2"}
    transfer(node0, node1, "eth1", 64 * 1024)
    transfer(node1, node0, "eth2", 64 * 1024)


def test_counters_rise_only_on_the_nic_that_carried_the_traffic(emulated_nodes):
    node0, node1 = emulated_nodes.nodes
    for used, idle in (("eth1", "eth2"), ("eth2", "eth1")):
        before = {(node, nic): emu.counters(node, nic) for node in (node0, node1) for nic in ("eth1", "eth2")}
        transfer(node0, node1, used, MIB)
        after = {key: emu.counters(*key) for key in before}
        assert after[node0, used].tx_bytes - before[node0, used].tx_bytes >= MIB
        assert after[node1, used].rx_bytes - before[node1, used].rx_bytes >= MIB
        for node in (node0, node1):
            # The idle NIC carried none of the megabyte. Not "exactly nothing":
            # a link-local packet the kernel sent as the link came up (before
            # IPv6 was switched off) can still leave late on a loaded machine,
            # as it did once in a full CI-like run.
            idle_bytes = (after[node, idle].tx_bytes - before[node, idle].tx_bytes
                          + after[node, idle].rx_bytes - before[node, idle].rx_bytes)
            assert idle_bytes < 4096, (node.netns, idle, idle_bytes)


def test_nodes_see_only_their_nics_and_nothing_beyond_their_subnets(emulated_nodes):
    node0 = emulated_nodes[0]
    links = subprocess.run(["ip", "-n", node0.netns, "-o", "link"], capture_output=True, text=True,
                           check=True).stdout
    assert sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines()) == ["eth1", "eth2", "lo"]
    # No default route: an address outside both subnets fails at once rather than leaving the namespace.
    assert send(node0, "10.203.0.1", 1) == {"error": "ENETUNREACH"}
    assert send(node0, "1.1.1.1", 1) == {"error": "ENETUNREACH"}


def test_rate_limit_holds_a_transfer_to_the_rate(make_emulated_nodes):
    nodes = make_emulated_nodes(rate="20mbit")
    node0, node1 = nodes.nodes
    shaped = mbit_per_s(transfer(node0, node1, "eth1", 2_000_000))  # ~0.8 s at 20 mbit/s
    assert 8 < shaped < 21, shaped
    for node in (node0, node1):
        emu.shape(node, "eth1")  # no rate, no delay: back to unshaped
    unshaped = mbit_per_s(transfer(node0, node1, "eth1", 2_000_000))
    assert unshaped > 3 * 20, unshaped


def test_delay_needs_netem(make_emulated_nodes):
    prefix = emu.new_prefix()
    try:
        nodes = make_emulated_nodes(delay="50ms", prefix=prefix)
    except emu.ShapingUnsupported as exc:
        assert "netem" in str(exc)
        assert not [name for name in emu.list_namespaces() if name.startswith(prefix)]
        pytest.skip("this kernel has no netem: checked that asking for a delay fails clearly "
                    "and leaves no namespace behind")
    node0, node1 = nodes.nodes
    with sink(node1, "eth1"):
        start = time.monotonic()
        assert send(node0, node1.addrs["eth1"], 1) == {"ok": True}
        # SYN, SYN-ACK, then data and ack: two round trips of 2 x 50 ms.
        assert time.monotonic() - start >= 0.2


def test_a_nic_taken_down_fails_connections_while_the_other_works(emulated_nodes):
    node0, node1 = emulated_nodes.nodes
    emu.set_link(node0, "eth1", up=False)
    assert send(node0, node1.addrs["eth1"], 1) == {"error": "ENETUNREACH"}  # the local route went with the link
    transfer(node0, node1, "eth2", 64 * 1024)
    emu.set_link(node0, "eth1", up=True)
    transfer(node0, node1, "eth1", 64 * 1024)

    emu.set_link(node1, "eth2", up=False)  # the remote end: ARP goes unanswered, connect times out
    assert send(node0, node1.addrs["eth2"], 1, connect_timeout=0.5) == {"error": "TimeoutError"}
    transfer(node0, node1, "eth1", 64 * 1024)


def test_everything_is_removed_when_the_body_raises(netns_available):
    links = host_links()
    with pytest.raises(RuntimeError, match="body failed"):
        with emu.EmulatedNodes(n=3) as nodes:
            prefix = nodes.prefix
            assert len([name for name in emu.list_namespaces() if name.startswith(prefix)]) == 4
            sleeper = emu.run_in(nodes[2], ["sleep", "30"])
            # Inside once `ip netns exec` has become sleep (on a busy machine the body could
            # otherwise end first, and `ip` find the namespace gone: exit 255).
            until = time.monotonic() + 10
            while Path(f"/proc/{sleeper.pid}/comm").read_text().strip() != "sleep" and time.monotonic() < until:
                time.sleep(0.01)
            raise RuntimeError("body failed")
    assert not [name for name in emu.list_namespaces() if name.startswith(prefix)]
    assert sleeper.wait(timeout=5) == -signal.SIGKILL  # a process inside would have kept its namespace alive
    assert host_links() == links  # nothing was ever made in the host's namespace


def test_cleanup_stale_removes_only_dead_runs(emulated_nodes):
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = emu.EmulatedNodes(n=1, prefix=f"{emu.ROOT_PREFIX}{gone.pid}-abcdef-").up()
    removed = emu.cleanup_stale()
    assert sorted(removed) == sorted([stale.switch, stale[0].netns])
    names = emu.list_namespaces()
    assert all(node.netns in names for node in emulated_nodes.nodes)  # a live run's stay


def test_not_root_is_named_as_the_reason(monkeypatch):
    monkeypatch.setattr(emu.os, "geteuid", lambda: 1000)
    assert emu.netns_unavailable_reason().startswith("not root (euid 1000)")


def test_cli_up_down_and_run_survives_sigterm(netns_available):
    up = subprocess.run([sys.executable, str(SCRIPT), "up", "--nodes", "1", "--rate", "1gbit"],
                        capture_output=True, text=True, check=True, timeout=30)
    described = json.loads(up.stdout)
    try:
        assert described["nodes"][0]["addrs"] == {"eth1": "10.201.0.1", "eth2": "10.202.0.1"}
        assert described["nodes"][0]["netns"] in emu.list_namespaces()  # `up` leaves them
    finally:
        down = subprocess.run([sys.executable, str(SCRIPT), "down", "--prefix", described["prefix"]],
                              capture_output=True, text=True, check=True, timeout=30)
    assert sorted(json.loads(down.stdout)) == sorted([described["switch"], described["nodes"][0]["netns"]])

    run = subprocess.Popen([sys.executable, str(SCRIPT), "run", "--", "sleep", "30"])
    prefix = f"{emu.ROOT_PREFIX}{run.pid}-"
    deadline = time.monotonic() + 20
    while len([name for name in emu.list_namespaces() if name.startswith(prefix)]) < 3:
        assert time.monotonic() < deadline and run.poll() is None
        time.sleep(0.05)
    time.sleep(0.2)  # let the sleepers start, so that teardown has processes to kill
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=20) == 128 + signal.SIGTERM
    assert not [name for name in emu.list_namespaces() if name.startswith(prefix)]
