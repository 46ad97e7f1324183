#!/usr/bin/env python
"""Emulated cluster nodes on one machine: Linux network namespaces with two NICs each.

hetpipe's multi-node paths (rank rendezvous, gloo and TCP boundary channels,
striping over several NICs) need real network hosts to be tested: separate
addresses, separate interfaces whose byte counters show which link carried the
traffic, links that can be slowed down or taken away. One machine (a laptop,
CI) can provide that with network namespaces, which is what this script builds.

Topology, for ``n`` nodes and the default two subnets::

    namespace <prefix>switch:   bridge br1 (subnet A)        bridge br2 (subnet B)
                                  |  ports n<k>-eth1             |  ports n<k>-eth2
                                  |  (veth pairs)                |
    namespace <prefix>node<k>:  eth1 10.201.0.<k+1>/24         eth2 10.202.0.<k+1>/24

Every node has loopback up and one "NIC" per subnet, each a veth whose other
end is a port of that subnet's bridge. The bridges live in their own namespace,
so nothing is created in, routed to, or read from the host's network: a node has
no default route, and an address outside its subnets is unreachable. IPv6 is off
in every namespace so that no autoconfiguration chatter lands on the NICs' byte
counters. The prefix holds the creating process's pid and a random token, so
parallel runs never collide and :func:`cleanup_stale` can tell the leftovers of
a dead process (SIGKILL, power loss) from a live run's namespaces.

Shaping is per NIC, on its egress: ``rate`` is a ``tbf`` token bucket and
``delay`` a ``netem`` delay (netem at the root with the tbf under it, when both
are given). Shaping every node limits each link both ways; :func:`shape` on one
node's NIC limits only what that node sends. ``netem`` is a kernel option
(CONFIG_NET_SCH_NETEM) that some kernels lack, the one this was written on
included: there, asking for a delay raises :class:`ShapingUnsupported`, and rate
limiting still works because tbf is a separate option.

What a process inside a node sees: only ``lo``, ``eth1`` and ``eth2`` and their
addresses; but ``ip netns exec`` separates the network alone, so the hostname
(the UTS namespace), the file system, ``/etc/hosts`` and the pids are the host's.
``socket.gethostname()`` is the same in every node and typically resolves to a
loopback address (127.0.0.1 or 127.0.1.1 from ``/etc/hosts``), and each node's
loopback is private to it. So anything that finds "its own address" from the
hostname (gloo's default device does, and so does ``MASTER_ADDR=$(hostname)``)
binds or connects to loopback and cannot reach another node: name the interface
(``GLOO_SOCKET_IFNAME=eth1``) or the addresses explicitly. Taking a NIC down
(:func:`set_link`) removes its subnet's route in that node, so connecting from
that node fails at once (ENETUNREACH); connecting *to* it from another node
instead stalls on ARP and fails after about three seconds (EHOSTUNREACH) unless
the caller's timeout is shorter; an established connection over it just stalls.

Creating namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2.

    python scripts/emulated_nodes.py up --nodes 3 --rate 100mbit   # prints JSON, leaves them up
    python scripts/emulated_nodes.py down --prefix hetpipe-kept-1234-
    python scripts/emulated_nodes.py down --stale                  # leftovers of dead runs
    python scripts/emulated_nodes.py run --nodes 2 -- sh -c 'echo rank $EMU_NODE_RANK of $EMU_NODES: $EMU_NODE_ETH1'

``run`` starts the command in every node at once, with ``EMU_NODE_RANK``,
``EMU_NODES``, ``EMU_NODE_NETNS``, ``EMU_NODE_<NIC>`` (this node's address on
that NIC, e.g. ``EMU_NODE_ETH1``) and ``EMU_ADDRS_<NIC>`` (every node's address
on it, comma-separated, in rank order) set; the first command to fail stops the
others, and the namespaces are removed when all have finished, on Ctrl-C and on
SIGTERM.
"""
from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any, Iterator, NamedTuple, Sequence

ROOT_PREFIX = "hetpipe-"
DEFAULT_SUBNETS = ("10.201.0.0/24", "10.202.0.0/24")
# Prefixes from new_prefix(); cleanup_stale() reads the owner's pid from them.
# `up` uses "hetpipe-kept-..." instead, which this never matches: those
# namespaces outlive their creator on purpose.
_OWNED = re.compile(rf"^{ROOT_PREFIX}(\d+)-[0-9a-f]+-")
# Units tc accepts for rates: "bit" ones are bits/s, "bps" ones bytes/s.
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message holds the command and its stderr."""


class ShapingUnsupported(NetnsError):
    """The kernel lacks the queueing discipline a shaping request needs."""


class Counters(NamedTuple):
    tx_bytes: int
    rx_bytes: int


@dataclass(frozen=True)
class Node:
    """One emulated node: its namespace and its address on each NIC (``{"eth1": "10.201.0.1", ...}``)."""

    rank: int
    netns: str
    addrs: dict[str, str] = field(compare=False)  # the namespace identifies a node; this keeps it hashable


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _netns(node: Node | str) -> str:
    return node.netns if isinstance(node, Node) else node


def new_prefix() -> str:
    """A namespace-name prefix unique to this call: the pid (for :func:`cleanup_stale`) and a random token."""
    return f"{ROOT_PREFIX}{os.getpid()}-{secrets.token_hex(3)}-"


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``; lines may end in ``(id: N)``)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def netns_unavailable_reason() -> str | None:
    """Why namespaces with veth links cannot be made here, or None when they can (tries one)."""
    if os.geteuid() != 0:
        return f"not root (euid {os.geteuid()}): network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not on PATH"
    probe = f"{new_prefix()}probe"
    try:
        _run(["ip", "netns", "add", probe])
    except NetnsError as exc:
        return f"`ip netns add` failed: {exc}"
    try:
        _run(["ip", "-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"])
        _run(["ip", "-n", probe, "link", "add", "probebr", "type", "bridge"])
    except NetnsError as exc:
        return f"veth pairs or bridges cannot be made: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def run_in(node: Node | str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
    """Start ``argv`` inside the node's namespace. ``ip netns exec`` execs it, so the
    Popen's pid is the command's own; the environment is passed through."""
    return subprocess.Popen(["ip", "netns", "exec", _netns(node), *argv], **popen_kwargs)


def set_link(node: Node | str, nic: str, up: bool) -> None:
    """Take a NIC of the node up or down (like pulling its cable: its routes go with it)."""
    _run(["ip", "-n", _netns(node), "link", "set", nic, "up" if up else "down"])


def counters(node: Node | str, nic: str) -> Counters:
    """The NIC's byte counters. Read with ``cat`` inside the namespace because
    ``ip netns exec`` mounts a /sys of that namespace; this process's /sys shows the host's."""
    stats = f"/sys/class/net/{nic}/statistics"
    out = _run(["ip", "netns", "exec", _netns(node), "cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"]).stdout
    tx, rx = (int(value) for value in out.split())
    return Counters(tx, rx)


def rate_bits(rate: str | int) -> int:
    """Bits per second from an int or a tc-style rate: ``"20mbit"``, ``"1gbit"``, ``"500kbps"`` (bytes)."""
    if isinstance(rate, int):
        bits = rate
    else:
        match = _RATE.match(rate)
        if match is None:
            raise ValueError(f"rate {rate!r}: expected a number with a unit such as kbit, mbit, gbit or mbps")
        value, scale, unit = match.groups()
        bits = round(float(value) * _SCALE[scale.lower()] * (8 if unit.lower() == "bps" else 1))
    if bits <= 0:
        raise ValueError(f"rate {rate!r} must be positive")
    return bits


def _tbf(rate: str | int) -> list[str]:
    bits = rate_bits(rate)
    # A bucket of ~4 ms of traffic: a smaller one starves at high rates on timer
    # granularity, a larger one lets short transfers overshoot the rate. The
    # floor keeps it above a few full-size frames at low rates.
    burst = max(bits // 8 // 250, 16 * 1024)
    return ["tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", "100ms"]


def shape(node: Node | str, nic: str, rate: str | int | None = None, delay: str | None = None) -> None:
    """Replace the NIC's egress shaping: ``rate`` (tc rate, e.g. ``"20mbit"``, or bits/s)
    via tbf, ``delay`` (tc time, e.g. ``"10ms"``) via netem; neither removes shaping."""
    netns = _netns(node)
    tc = ["tc", "-n", netns, "qdisc"]
    removed = subprocess.run([*tc, "del", "dev", nic, "root"], capture_output=True, text=True)
    # Deleting the default (no) qdisc is refused with this message; anything else is a real error.
    if removed.returncode != 0 and "handle of zero" not in removed.stderr:
        raise NetnsError(f"removing the qdisc of {nic} in {netns}: {removed.stderr.strip()}")
    if delay is not None:
        try:
            _run([*tc, "add", "dev", nic, "root", "handle", "1:", "netem", "delay", delay])
        except NetnsError as exc:
            if "unknown" in str(exc).lower():
                raise ShapingUnsupported(
                    f"cannot delay {nic} in {netns}: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM); "
                    "rate limiting alone works (tbf)") from exc
            raise
        if rate is not None:
            _run([*tc, "add", "dev", nic, "parent", "1:1", "handle", "10:", *_tbf(rate)])
    elif rate is not None:
        _run([*tc, "add", "dev", nic, "root", *_tbf(rate)])


def destroy(prefix: str) -> list[str]:
    """Remove every namespace whose name starts with ``prefix`` (which must start with
    ``hetpipe-``), killing the processes still inside them first: a namespace with
    a process in it outlives its name, and with it its links. Returns the names removed."""
    if not prefix.startswith(ROOT_PREFIX) or prefix == ROOT_PREFIX:
        raise ValueError(f"prefix {prefix!r}: only namespaces named {ROOT_PREFIX}<something> are ours to remove")
    names = [name for name in list_namespaces() if name.startswith(prefix)]
    for name in names:
        _kill_inside(name)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return names


def _kill_inside(netns: str, wait_s: float = 2.0) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        pids = [int(pid) for pid in subprocess.run(["ip", "netns", "pids", netns], capture_output=True,
                                                    text=True).stdout.split()]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def cleanup_stale() -> list[str]:
    """Remove the namespaces of earlier runs whose process is gone (crashed or killed
    before its teardown). A live run's namespaces are left alone. Returns the names removed."""
    dead: set[str] = set()
    for name in list_namespaces():
        match = _OWNED.match(name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            dead.add(match.group(0))
        except PermissionError:  # alive, someone else's
            pass
    return [name for prefix in sorted(dead) for name in destroy(prefix)]


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that ``with`` blocks and pytest's fixture teardown run."""


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """While active, SIGTERM raises :class:`Terminated` in the main thread instead of
    killing the process outright, so an :class:`EmulatedNodes` block tears down.
    Leaves a handler someone else installed alone, and does nothing off the main thread
    (where handlers cannot be set)."""
    def raise_terminated(signum: int, frame: FrameType | None) -> None:
        raise Terminated()

    install = (threading.current_thread() is threading.main_thread()
               and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    if install:
        signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        if install:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


class EmulatedNodes:
    """``n`` nodes as namespaces, one NIC per subnet each, optionally shaped; a context
    manager that removes everything it made on exit, also when the body raised.
    :meth:`up` alone leaves them for :func:`destroy`."""

    def __init__(self, n: int = 2, rate: str | int | None = None, delay: str | None = None,
                 subnets: Sequence[str] = DEFAULT_SUBNETS, prefix: str | None = None) -> None:
        if n < 1:
            raise ValueError(f"n={n}: need at least one node")
        networks = [ipaddress.ip_network(subnet) for subnet in subnets]
        for net in networks:
            # Private ranges only, so that no address a node uses can shadow a real host;
            # IPv4 only, because IPv6 is switched off inside the namespaces.
            if net.version != 4 or not net.is_private:
                raise ValueError(f"subnet {net}: must be a private IPv4 network")
            if net.num_addresses - 2 < n:
                raise ValueError(f"subnet {net} has no room for {n} nodes")
        for i, a in enumerate(networks):
            for b in networks[i + 1:]:
                if a.overlaps(b):
                    raise ValueError(f"subnets {a} and {b} overlap; each NIC needs its own")
        if rate is not None:
            rate_bits(rate)  # reject a malformed rate before anything is created
        self.n, self.rate, self.delay, self.networks = n, rate, delay, networks
        self.prefix = prefix or new_prefix()
        self.switch = f"{self.prefix}switch"
        self.nics = [f"eth{i + 1}" for i in range(len(networks))]
        self.nodes = [
            Node(k, f"{self.prefix}node{k}",
                 {nic: str(net.network_address + k + 1) for nic, net in zip(self.nics, networks)})
            for k in range(n)
        ]

    def __getitem__(self, rank: int) -> Node:
        return self.nodes[rank]

    def __len__(self) -> int:
        return self.n

    def __enter__(self) -> EmulatedNodes:
        return self.up()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.down()

    def up(self) -> EmulatedNodes:
        """Create the switch, the nodes and their links; on any failure remove what was made and re-raise."""
        try:
            self._add_namespace(self.switch)
            for i, nic in enumerate(self.nics):
                _run(["ip", "-n", self.switch, "link", "add", f"br{i + 1}", "type", "bridge"])
                _run(["ip", "-n", self.switch, "link", "set", f"br{i + 1}", "up"])
            for node in self.nodes:
                self._add_node(node)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> list[str]:
        """Remove every namespace of this instance (and with them every link). Returns the names removed."""
        return destroy(self.prefix)

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        # Before any NIC exists, so that none gets an IPv6 link-local address.
        _run(["ip", "netns", "exec", name, "sysctl", "-q", "-w",
              "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"])

    def _add_node(self, node: Node) -> None:
        self._add_namespace(node.netns)
        for i, net in enumerate(self.networks):
            nic, port = self.nics[i], f"n{node.rank}-{self.nics[i]}"
            _run(["ip", "-n", node.netns, "link", "add", nic, "type", "veth",
                  "peer", "name", port, "netns", self.switch])
            _run(["ip", "-n", self.switch, "link", "set", port, "master", f"br{i + 1}", "up"])
            _run(["ip", "-n", node.netns, "addr", "add", f"{node.addrs[nic]}/{net.prefixlen}", "dev", nic])
            _run(["ip", "-n", node.netns, "link", "set", nic, "up"])
            if self.rate is not None or self.delay is not None:
                shape(node, nic, rate=self.rate, delay=self.delay)

    def describe(self) -> dict[str, Any]:
        """Names and addresses, as ``up`` prints them."""
        return {
            "prefix": self.prefix,
            "switch": self.switch,
            "subnets": {nic: str(net) for nic, net in zip(self.nics, self.networks)},
            "rate": self.rate,
            "delay": self.delay,
            "nodes": [{"rank": node.rank, "netns": node.netns, "addrs": node.addrs} for node in self.nodes],
        }

    def node_env(self, node: Node) -> dict[str, str]:
        """The ``EMU_*`` variables the ``run`` command gives the process in ``node``."""
        env = {"EMU_NODE_RANK": str(node.rank), "EMU_NODES": str(self.n), "EMU_NODE_NETNS": node.netns}
        for nic in self.nics:
            env[f"EMU_NODE_{nic.upper()}"] = node.addrs[nic]
            env[f"EMU_ADDRS_{nic.upper()}"] = ",".join(other.addrs[nic] for other in self.nodes)
        return env


def _run_everywhere(nodes: EmulatedNodes, command: list[str]) -> int:
    procs = [run_in(node, command, env={**os.environ, **nodes.node_env(node)}) for node in nodes.nodes]
    # Like torchrun: one failed rank stops the rest (teardown kills them), since
    # peers waiting for it would otherwise hang.
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            return failed[0]
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)

    def topology(p: argparse.ArgumentParser) -> None:
        p.add_argument("--nodes", type=int, default=2, help="number of nodes")
        p.add_argument("--rate", help="per-NIC egress rate, tc syntax (e.g. 20mbit, 1gbit)")
        p.add_argument("--delay", help="per-NIC egress delay, tc syntax (e.g. 5ms); needs netem in the kernel")
        p.add_argument("--subnets", default=",".join(DEFAULT_SUBNETS),
                       help="one private IPv4 subnet per NIC, comma-separated (eth1, eth2, ...)")

    up = sub.add_parser("up", help="create the nodes, print them as JSON and leave them up")
    topology(up)
    up.add_argument("--prefix", help=f"namespace prefix (must start with {ROOT_PREFIX}; "
                                     f"default {ROOT_PREFIX}kept-<pid>-<token>-)")
    down = sub.add_parser("down", help="remove namespaces")
    which = down.add_mutually_exclusive_group(required=True)
    which.add_argument("--prefix", help="remove every namespace with this prefix (as `up` printed it)")
    which.add_argument("--stale", action="store_true", help="remove the leftovers of runs whose process died")
    run = sub.add_parser("run", help="create the nodes, run a command in each, remove them")
    topology(run)
    run.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command and its arguments")
    args = parser.parse_args(argv)
    if args.mode == "run":
        if args.command[:1] == ["--"]:
            args.command = args.command[1:]
        if not args.command:
            parser.error("run: give the command after --")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode == "down":
        removed = cleanup_stale() if args.stale else destroy(args.prefix)
        print(json.dumps(removed))
        return 0
    reason = netns_unavailable_reason()
    if reason is not None:
        print(f"emulated_nodes: cannot create namespaces: {reason}", file=sys.stderr)
        return 1
    options = dict(n=args.nodes, rate=args.rate, delay=args.delay, subnets=args.subnets.split(","))
    if args.mode == "up" and args.prefix is not None and not args.prefix.startswith(ROOT_PREFIX):
        print(f"emulated_nodes: --prefix must start with {ROOT_PREFIX}", file=sys.stderr)
        return 2
    try:
        with terminate_raises():
            if args.mode == "run":
                with EmulatedNodes(**options) as nodes:
                    return _run_everywhere(nodes, args.command)
            prefix = args.prefix or f"{ROOT_PREFIX}kept-{os.getpid()}-{secrets.token_hex(3)}-"
            nodes = EmulatedNodes(prefix=prefix, **options).up()
    except (NetnsError, ValueError) as exc:
        print(f"emulated_nodes: {exc}", file=sys.stderr)
        return 1
    except Terminated:
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    print(json.dumps(nodes.describe(), indent=2))
    print(f"remove with: {sys.argv[0]} down --prefix {prefix}", file=sys.stderr)
    return 0

if __name__ == "__main__":
    sys.exit(main())
