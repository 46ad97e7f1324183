"""NIC discovery and selection (hetpipe.comm.nics): what a node resolves from
cluster.transport, and the one-line errors a user sees when it cannot.

The selection rules run on made-up interface lists; discovery runs on this
host and, where a network namespace can be made (root, iproute2), on a
namespace with two veth NICs, one of them carrying a secondary address.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from hetpipe.devices.cluster import ClusterConfig, TransportConfig
from hetpipe.comm.nics import (Interface, Nic, check_dialable, list_interfaces, resolve_local_nics,
                               selection_setting, socket_ifname)
from hetpipe.errors import ConfigError


def iface(name: str, *ipv4: str, ipv6: tuple[str, ...] = (), state: str = "up") -> Interface:
    return Interface(name=name, ipv4=tuple(ipv4), ipv6=ipv6, state=state, speed_mbps=None, rx_bytes=0, tx_bytes=0)


HOST = [iface("lo", "127.0.0.1", ipv6=("::1",)), iface("eth0", "192.168.1.5"),
        iface("eth1", "10.201.0.7", "10.201.5.1"), iface("eth2", "10.202.0.7"), iface("ib0")]


def test_interfaces_by_name_give_their_first_ipv4_address_in_the_configured_order():
    nics = resolve_local_nics(TransportConfig(interfaces=["eth2", "eth1"]), HOST)
    assert nics == [Nic("eth2", "10.202.0.7"), Nic("eth1", "10.201.0.7")]
    assert socket_ifname(nics) == "eth2,eth1"


def test_subnets_pick_the_interface_with_an_address_in_each():
    nics = resolve_local_nics(TransportConfig(subnets=["10.202.0.0/24", "10.201.5.0/24"]), HOST)
    assert nics == [Nic("eth2", "10.202.0.7"), Nic("eth1", "10.201.5.1")]


def test_explicit_addresses_map_to_their_interface_and_a_wildcard_to_none():
    nics = resolve_local_nics(TransportConfig(addresses=["10.201.0.7", "::1", "0.0.0.0"]), HOST)
    assert nics == [Nic("eth1", "10.201.0.7"), Nic("lo", "::1"), Nic(None, "0.0.0.0")]
    assert resolve_local_nics(TransportConfig(), HOST) == [Nic("lo", "127.0.0.1")]


@pytest.mark.parametrize("transport, named", [
    (TransportConfig(interfaces=["eth1", "eth9", "ib0"]), "names interfaces eth9, ib0 with an IPv4 address"),
    (TransportConfig(subnets=["10.203.0.0/24"]), "names subnet 10.203.0.0/24"),
    (TransportConfig(addresses=["10.9.9.9"]), "names address 10.9.9.9"),
])
def test_a_missing_nic_is_one_error_naming_it_and_listing_what_the_node_has(transport, named):
    with pytest.raises(ConfigError) as err:
        resolve_local_nics(transport, HOST)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{selection_setting(transport)} {named} that this node lacks")
    assert "lo 127.0.0.1 ::1, eth0 192.168.1.5, eth1 10.201.0.7 10.201.5.1, eth2 10.202.0.7, ib0 (no address)" \
        in message


def test_a_wildcard_is_refused_always_and_loopback_only_across_hosts():
    with pytest.raises(ConfigError, match=r"^cluster\.transport\.addresses gives 0\.0\.0\.0, a wildcard .*"
                                          r"cluster\.transport\.interfaces=.*cluster\.transport\.subnets="):
        check_dialable(["10.201.0.7", "0.0.0.0"], multi_node=False)
    with pytest.raises(ConfigError, match="gives ::, a wildcard"):
        check_dialable(["::"], multi_node=False)
    check_dialable(["127.0.0.1", "::1"], multi_node=False)
    with pytest.raises(ConfigError, match=r"^cluster\.transport\.interfaces gives 127\.0\.0\.1, a loopback address "
                                          "that other nodes cannot reach"):
        check_dialable(["10.201.0.7", "127.0.0.1"], multi_node=True, setting="cluster.transport.interfaces")
    check_dialable(["10.201.0.7", "10.202.0.7"], multi_node=True)


def test_socket_ifname_lists_each_interface_once_and_refuses_a_wildcard():
    assert socket_ifname([Nic("eth1", "10.201.0.7"), Nic("eth1", "10.201.5.1"), Nic("eth2", "10.202.0.7")]) \
        == "eth1,eth2"
    with pytest.raises(ConfigError, match="0.0.0.0 belongs to no one interface"):
        socket_ifname([Nic(None, "0.0.0.0")])


@pytest.mark.parametrize("transport, error", [
    ({"interfaces": ["eth1"], "subnets": ["10.201.0.0/24"]}, "set interfaces or subnets, not both"),
    ({"interfaces": []}, "need at least one entry"),
    ({"subnets": ["10.201.0/33"]}, "subnets has '10.201.0/33', which is not a CIDR"),
])
def test_the_cluster_config_refuses_ambiguous_or_malformed_nic_selections(transport, error):
    with pytest.raises(ConfigError, match=error):
        ClusterConfig(transport=TransportConfig(**transport))


def test_this_host_lists_loopback_up_with_its_address_and_counters():
    lo = next(i for i in list_interfaces() if i.name == "lo")
    assert "127.0.0.1" in lo.ipv4 and lo.state == "up"
    assert lo.rx_bytes is not None and lo.tx_bytes is not None


NETNS_PROBE = """
import json
from dataclasses import asdict
from hetpipe.devices.cluster import TransportConfig
from hetpipe.comm.nics import list_interfaces, resolve_local_nics
print(json.dumps({"interfaces": [asdict(i) for i in list_interfaces()],
                  "by_name": [asdict(n) for n in resolve_local_nics(TransportConfig(interfaces=["hpd1", "hpd2"]))],
                  "by_subnet": [asdict(n) for n in resolve_local_nics(TransportConfig(
                      subnets=["10.203.0.0/24", "10.201.0.0/24"]))]}))
"""


def test_discovery_in_a_network_namespace_with_two_nics_and_a_secondary_address():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace")
    ns = f"hpdoc-nics-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode:
        pytest.skip("cannot create a network namespace here")
    try:
        for cmd in (["link", "add", "hpd1", "type", "veth", "peer", "name", "hpd2"],
                    ["addr", "add", "10.201.0.1/24", "dev", "hpd1"],
                    ["addr", "add", "10.202.0.1/24", "dev", "hpd2"],
                    ["addr", "add", "10.203.0.1/24", "dev", "hpd2"],  # a secondary address
                    ["link", "set", "hpd1", "up"], ["link", "set", "hpd2", "up"], ["link", "set", "lo", "up"]):
            subprocess.run(["ip", "-n", ns, *cmd], check=True, capture_output=True)
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", NETNS_PROBE], check=True,
                             capture_output=True, text=True, timeout=60).stdout
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    found = json.loads(out)
    by_name = {i["name"]: i for i in found["interfaces"]}
    assert sorted(by_name) == ["hpd1", "hpd2", "lo"]  # only the namespace's own NICs
    assert by_name["hpd1"]["ipv4"] == ["10.201.0.1"] and by_name["hpd1"]["state"] == "up"
    assert by_name["hpd2"]["ipv4"] == ["10.202.0.1", "10.203.0.1"]
    assert found["by_name"] == [{"name": "hpd1", "address": "10.201.0.1"}, {"name": "hpd2", "address": "10.202.0.1"}]
    assert found["by_subnet"] == [{"name": "hpd2", "address": "10.203.0.1"},
                                  {"name": "hpd1", "address": "10.201.0.1"}]
