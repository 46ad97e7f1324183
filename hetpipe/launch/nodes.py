"""Which node each rank runs on, and the start-up roll call that names a node that never came.

An error about a lost peer helps only if it says which machine to look at -
"node 1 (amd, 10.201.0.2)", not "rank 2". Ranks are numbered group by group
and node by node in the cluster config's order (launch_cluster.sh sets RANK
from it, see :mod:`hetpipe.launch.scheduler_env`), so a rank's node follows from the
config; its addresses are what it says at the roll call.

The roll call is the first thing every rank does with the job's store, before
the gloo world group: each rank publishes its NIC addresses, which network
stack it runs in and the device it really runs on (:mod:`hetpipe.devices.facts`),
then waits for all the others within the transport deadline. A rank that
never arrives is named by its node then; gloo's own rendezvous would wait 30
minutes and name a store key. The network stacks also tell whether the job
really spans hosts: two torchrun "nodes" on one machine share a loopback, two
machines do not. The devices are checked against the plan once all arrived.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch.distributed as dist

from hetpipe.devices.cluster import ClusterConfig
from hetpipe.comm.nics import network_identity
from hetpipe.devices.facts import DeviceFacts
from hetpipe.errors import EXIT_LOST_PEER, HetpipeError
from hetpipe.launch.scheduler_env import node_layout
from hetpipe.launch.store_seal import ForgedStoreValue, Seal, Unsealed

# How often the roll call looks for a failure another rank posted meanwhile.
_POLL_S = 0.5


def launched_multi_node(cluster: ClusterConfig) -> bool:
    """The job spans more than one node: the cluster config says so, or the launcher
    started more than one (launch_cluster.sh's HETPIPE_NNODES, torchrun's GROUP_WORLD_SIZE)."""
    counts = (os.environ.get(name, "").strip() for name in ("HETPIPE_NNODES", "GROUP_WORLD_SIZE"))
    return not cluster.single_node or any(c.isdigit() and int(c) > 1 for c in counts)


class NodeMissing(HetpipeError):
    """Ranks of the job did not reach the roll call within the deadline."""


@dataclass(frozen=True)
class NodeMap:
    """Every rank's node, each node's group, and the addresses ranks published."""

    node_of: tuple[int, ...]  # global rank -> node index
    groups: tuple[str, ...]  # node index -> its vendor group's name
    addresses: dict[int, tuple[str, ...]]  # rank -> its channel NIC addresses (ranks that arrived)
    # More than one network stack among the ranks: loopback cannot join them.
    multi_host: bool = False
    # rank -> the device it runs on, as it reported it (ranks that arrived with one).
    devices: dict[int, DeviceFacts] = field(default_factory=dict)

    @classmethod
    def layout(cls, cluster: ClusterConfig, multi_node: bool) -> NodeMap:
        """Nodes as the launcher numbers them; a job on one node is node 0 throughout."""
        if not multi_node:
            return cls((0,) * cluster.world_size, ("+".join(g.name for g in cluster.groups),), {})
        node_of: list[int] = []
        groups: list[str] = []
        for k, slot in enumerate(node_layout(cluster)):
            node_of += [k] * slot.group.ranks_per_node
            groups.append(slot.group.name)
        return cls(tuple(node_of), tuple(groups), {})

    def label(self, node: int) -> str:
        """``node 1 (amd, 10.201.0.2)``: its group and its first rank's first address, once known."""
        first = next((self.addresses[r][0] for r in self.ranks_on(node) if self.addresses.get(r)), None)
        return f"node {node} ({self.groups[node]}{', ' + first if first else ''})"

    def label_of(self, rank: int) -> str:
        return self.label(self.node_of[rank])

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, k in enumerate(self.node_of) if k == node]

    def node_at(self, address: str) -> Optional[int]:
        """The node one of whose ranks published ``address``."""
        return next((self.node_of[r] for r, addrs in self.addresses.items() if address in addrs), None)


def _key(rank: int) -> str:
    return f"hetpipe/roll_call/{rank}"


def roll_call(store: dist.Store, rank: int, layout: NodeMap, addresses: Sequence[str], deadline: float,
              posted: Callable[[], Optional[tuple[str, int]]], device: Optional[DeviceFacts] = None,
              seal: Optional[Seal] = None) -> NodeMap:
    """Publish this rank's ``addresses`` and ``device`` and wait up to ``deadline`` s for every rank
    of ``layout``. With ``seal`` (the job secret's), every entry is sealed, and one that is not
    this job's ends the roll call (:class:`ForgedStoreValue`): the addresses decide where ranks dial.

    Returns ``layout`` with every rank's addresses and devices. Ranks still missing at the
    deadline are a :class:`NodeMissing` naming their nodes; a failure another
    rank reported meanwhile (``posted``) ends the wait with that reason.
    """
    mine = json.dumps({"addresses": list(addresses), "network": network_identity(),
                       "device": device.to_dict() if device else None})
    store.set(_key(rank), seal.seal_text(_key(rank), mine) if seal else mine)
    world = len(layout.node_of)
    keys = [_key(r) for r in range(world)]
    until = time.monotonic() + deadline
    while True:
        try:
            store.wait(keys, timedelta(seconds=max(min(_POLL_S, until - time.monotonic()), 0.001)))
            break
        except RuntimeError:  # torch's DistStoreError on timeout
            verdict = posted()  # (reason, exit status) another rank posted
            if verdict is not None:
                reason, code = verdict
                raise (NodeMissing(reason) if code == EXIT_LOST_PEER else HetpipeError(reason)) from None
            if time.monotonic() >= until:
                raise NodeMissing(_missing(store, layout, deadline)) from None
    facts = {r: json.loads(_entry(store, r, seal)) for r in range(world)}
    return NodeMap(layout.node_of, layout.groups, {r: tuple(f["addresses"]) for r, f in facts.items()},
                   multi_host=len({f["network"] for f in facts.values()}) > 1,
                   devices={r: DeviceFacts.from_dict(f["device"]) for r, f in facts.items() if f.get("device")})


def _entry(store: dist.Store, rank: int, seal: Optional[Seal]) -> str:
    raw = store.get(_key(rank))
    if seal is None:
        return raw.decode()
    try:
        return seal.open_text(_key(rank), raw)
    except Unsealed as exc:
        raise ForgedStoreValue(f"the roll-call entry of rank {rank}", _key(rank), exc) from None


def _missing(store: dist.Store, layout: NodeMap, deadline: float) -> str:
    absent = [r for r in range(len(layout.node_of)) if not store.check([_key(r)])]
    known = NodeMap(layout.node_of, layout.groups, {})
    parts = []
    for node in sorted({layout.node_of[r] for r in absent}):
        ranks = [r for r in absent if layout.node_of[r] == node]
        every = ranks == layout.ranks_on(node)
        parts.append(f"{known.label(node)}{'' if every else ' ranks ' + ', '.join(map(str, ranks))} "
                     f"did not arrive")
    return (f"{'; '.join(parts)} within {deadline:g} s (cluster.transport.deadline_s): its ranks never reached "
            "the world group - see that node's own output, or whether its launcher started at all")
