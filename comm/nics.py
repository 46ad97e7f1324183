"""This node's NICs, and which of them a job's transport config selects.

One command line starts every node of a job, but each node has its own
addresses, and on a mixed cluster even its own interface names (the AMD and
the NVIDIA nodes come from different vendors' images). So the transport
config names NICs in a way each node can resolve by itself: by interface name
(``cluster.transport.interfaces``) or by network (``cluster.transport.subnets``,
one CIDR per stripe, the same on every node); literal ``addresses`` remain for
single-host runs. A node that lacks a named NIC must say so in one line that
lists what it has, and an address must never be published that peers cannot
dial (a wildcard always, loopback once the job spans hosts) - both fail only
as a timeout much later otherwise.

Linux only, standard library only: interfaces from ``socket.if_nameindex()``,
IPv4 addresses (secondary ones included) from the ``SIOCGIFCONF`` ioctl, IPv6
addresses from ``/proc/net/if_inet6``, state, speed and byte counters from
``/sys/class/net/<if>/``. Inside a network namespace entered with
``ip netns exec`` all of these describe that namespace.
"""
from __future__ import annotations

import array
import fcntl
import hashlib
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from hetpipe.devices.cluster import TransportConfig
from hetpipe.errors import ConfigError

def network_identity() -> str:
    """Equal for two processes exactly when they share one network stack (and so one loopback):
    the kernel's boot id and the network namespace. 'unknown' where /proc does not say."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return "unknown"
    return hashlib.sha256(f"{boot}/{netns}".encode()).hexdigest()[:12]


SIOCGIFCONF = 0x8912
# struct ifreq: a 16-byte name and a union whose largest member (struct
# ifmap) makes it 24 bytes on 64-bit Linux, 16 on 32-bit.
_IFREQ_SIZE = 40 if struct.calcsize("P") == 8 else 32
_IFF_UP = 0x1
_SYS_NET = Path("/sys/class/net")
_SUGGESTION = ("select NICs with cluster.transport.interfaces=[NAME,...] or "
               "cluster.transport.subnets=[CIDR,...]")


@dataclass(frozen=True)
class Interface:
    """One network interface of this host as the kernel reports it."""
    name: str
    ipv4: tuple[str, ...]
    # Link-local addresses are left out: they need a scope id to be dialled.
    ipv6: tuple[str, ...]
    # "up" or "down"; another kernel operstate (dormant, lowerlayerdown, ...)
    # passes through as reported.
    state: str
    # Link speed in Mb/s; None where the driver does not say (virtual NICs, a
    # link that is down).
    speed_mbps: Optional[int]
    rx_bytes: Optional[int]
    tx_bytes: Optional[int]

    @property
    def addresses(self) -> tuple[str, ...]:
        return self.ipv4 + self.ipv6


@dataclass(frozen=True)
class Nic:
    """A NIC the transport uses: its interface and the local address to bind."""
    # None only for a wildcard in cluster.transport.addresses, which is no
    # one interface (and is refused by check_dialable).
    name: Optional[str]
    address: str


def list_interfaces() -> list[Interface]:
    """This host's interfaces in kernel index order."""
    ipv4 = _ipv4_by_interface()
    ipv6 = _ipv6_by_interface()
    return [Interface(name=name, ipv4=tuple(ipv4.get(name, ())), ipv6=tuple(ipv6.get(name, ())),
                      state=_state(name), speed_mbps=_speed(name),
                      rx_bytes=_read_int(_SYS_NET / name / "statistics" / "rx_bytes"),
                      tx_bytes=_read_int(_SYS_NET / name / "statistics" / "tx_bytes"))
            for _, name in sorted(socket.if_nameindex())]


def tx_bytes(name: str) -> Optional[int]:
    """Bytes sent so far through interface ``name`` (None where unreadable)."""
    return _read_int(_SYS_NET / name / "statistics" / "tx_bytes")


def selection_setting(transport: TransportConfig) -> str:
    """The config key that selects the NICs: interfaces, then subnets, then addresses."""
    if transport.interfaces is not None:
        return "cluster.transport.interfaces"
    if transport.subnets is not None:
        return "cluster.transport.subnets"
    return "cluster.transport.addresses"


def resolve_local_nics(transport: TransportConfig,
                       interfaces: Optional[Sequence[Interface]] = None) -> list[Nic]:
    """This node's NICs for ``transport``, one per stripe.

    ``interfaces`` by name give each interface's first IPv4 address; else
    ``subnets`` give, per CIDR, the first interface with an address in it;
    else the literal ``addresses`` (host names are resolved), each of which
    must belong to this node unless it is a wildcard. Anything missing is one
    ConfigError that names it and lists what this node has. ``interfaces``
    defaults to :func:`list_interfaces`.
    """
    have = list_interfaces() if interfaces is None else list(interfaces)
    by_name = {i.name: i for i in have}
    setting = selection_setting(transport)
    nics: list[Nic] = []
    missing: list[str] = []
    if transport.interfaces is not None:
        for name in transport.interfaces:
            iface = by_name.get(name)
            if iface is None or not iface.ipv4:
                missing.append(name if iface is None else f"{name} with an IPv4 address")
            else:
                nics.append(Nic(name, iface.ipv4[0]))
        what = "interface"
    elif transport.subnets is not None:
        for cidr in transport.subnets:
            nic = _nic_in(ipaddress.ip_network(cidr, strict=False), have)
            if nic is None:
                missing.append(cidr)
            else:
                nics.append(nic)
        what = "subnet"
    else:
        for address in transport.addresses:
            ip = _as_ip(address, setting)
            owner = next((i for i in have if str(ip) in i.addresses), None)
            if owner is None and not ip.is_unspecified:
                missing.append(address)
            else:
                nics.append(Nic(owner.name if owner else None, str(ip)))
        what = "address"
    if missing:
        plural = "es" if what == "address" else "s"
        raise ConfigError(f"{setting} names {what}{plural if len(missing) > 1 else ''} {', '.join(missing)} "
                          f"that this node lacks (it has {describe(have)})")
    return nics


def check_dialable(addresses: Sequence[str], multi_node: bool,
                   setting: str = "cluster.transport.addresses") -> None:
    """Refuse addresses that peers cannot dial once published.

    A wildcard (0.0.0.0, ::) binds every NIC but names none, so it is refused
    always; loopback is refused when the job spans hosts (``multi_node``).
    ``setting`` is the config key the addresses came from (see
    :func:`selection_setting`), for the message.
    """
    for address in addresses:
        ip = _as_ip(address, setting)
        if ip.is_unspecified:
            raise ConfigError(f"{setting} gives {address}, a wildcard address that peers cannot dial: "
                              f"{_SUGGESTION}")
        if multi_node and ip.is_loopback:
            raise ConfigError(f"{setting} gives {address}, a loopback address that other nodes cannot "
                              f"reach: {_SUGGESTION}")


def socket_ifname(nics: Sequence[Nic]) -> str:
    """The interfaces of ``nics`` as GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME want them: ``eth1,eth2``.

    NCCL matches these names as prefixes (eth1 also matches eth10); prefix the
    value with ``=`` for NCCL to match them exactly. Gloo matches exactly and
    takes no prefix.
    """
    names: list[str] = []
    for nic in nics:
        if nic.name is None:
            raise ConfigError(f"address {nic.address} belongs to no one interface, so no socket interface "
                              f"can be named for it: {_SUGGESTION}")
        if nic.name not in names:
            names.append(nic.name)
    return ",".join(names)


def describe(interfaces: Sequence[Interface]) -> str:
    """``lo 127.0.0.1, eth0 10.0.0.5, eth1 (no address)``: what a node has, for messages."""
    return ", ".join(f"{i.name} {' '.join(i.addresses) or '(no address)'}" for i in interfaces) or "no interfaces"


def _nic_in(network: ipaddress.IPv4Network | ipaddress.IPv6Network, have: Sequence[Interface]) -> Optional[Nic]:
    for iface in have:
        for address in iface.addresses:
            if ipaddress.ip_address(address) in network:
                return Nic(iface.name, address)
    return None


def _as_ip(address: str, setting: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``address`` as an IP, resolving a host name (``localhost``) to its first address."""
    try:
        return ipaddress.ip_address(address)
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError) as exc:
        raise ConfigError(f"{setting} gives {address!r}, which is not an address and does not resolve "
                          f"({exc})") from None


def _ipv4_by_interface() -> dict[str, list[str]]:
    """IPv4 addresses per interface through SIOCGIFCONF, which (unlike
    SIOCGIFADDR) also returns secondary addresses; their labels (``eth0:1``)
    are folded into the interface's name."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        size = 64 * _IFREQ_SIZE
        while True:
            buf = array.array("B", bytes(size))
            request = struct.pack("iL", size, buf.buffer_info()[0])
            used = struct.unpack("iL", fcntl.ioctl(sock.fileno(), SIOCGIFCONF, request))[0]
            if used < size:  # a full buffer may have been truncated: ask again with more room
                break
            size *= 2
    data = buf.tobytes()[:used]
    found: dict[str, list[str]] = {}
    for offset in range(0, used, _IFREQ_SIZE):
        label = data[offset:offset + 16].split(b"\0", 1)[0].decode()
        # struct sockaddr_in after the name: family (2 bytes), port (2), address (4).
        address = socket.inet_ntoa(data[offset + 20:offset + 24])
        found.setdefault(label.split(":", 1)[0], []).append(address)
    return found


def _ipv6_by_interface() -> dict[str, list[str]]:
    """Global and site IPv6 addresses per interface from /proc/net/if_inet6
    (absent where IPv6 is disabled)."""
    found: dict[str, list[str]] = {}
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) < 6:
            continue
        address = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
        if not address.is_link_local:
            found.setdefault(fields[5], []).append(str(address))
    return found


def _state(name: str) -> str:
    """operstate, except that "unknown" (loopback, dummy and tunnel drivers
    report no carrier) becomes the administrative up/down flag."""
    try:
        operstate = (_SYS_NET / name / "operstate").read_text().strip()
    except OSError:
        operstate = "unknown"
    if operstate != "unknown":
        return operstate
    flags = _read_int(_SYS_NET / name / "flags", base=16)
    return "up" if flags is not None and flags & _IFF_UP else "down"


def _speed(name: str) -> Optional[int]:
    speed = _read_int(_SYS_NET / name / "speed")
    return speed if speed is not None and speed > 0 else None  # -1: the driver does not know


def _read_int(path: Path, base: int = 10) -> Optional[int]:
    """An integer sysfs attribute; None where it is absent or unreadable
    (reading ``speed`` of a virtual or down NIC fails with EINVAL)."""
    try:
        return int(path.read_text().strip(), base)
    except (OSError, ValueError):
        return None
