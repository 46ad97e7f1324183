"""Which channel carries each of this rank's boundary ranks, and how each transport is built.

The topology decides *which* ranks this rank exchanges activations with (its
routes); this module builds their channels. Same-vendor neighbours share one
:class:`~hetpipe.comm.p2p.TorchP2PChannel` over the per-direction process
groups, cross-vendor neighbours one channel of the configured kind
(``cluster.transport.kind``), built by the function its entry in
:mod:`hetpipe.pipeline.transports` names. Keeping that knowledge here
keeps the topology to ranks, groups and routes (like torchtitan's
``ParallelDims``) and the engine to stages.

The socket channels (tcp, direct) listen on and publish this node's own NICs
as ``cluster.transport`` selects them, resolved and checked at start-up by
the topology (:mod:`hetpipe.comm.nics`): one config file names NICs by
interface or subnet, each node resolves its own addresses, and an address no
peer could dial is refused before it is published, not found out as a
connect timeout on the other node.

A ``direct`` boundary's mover is chosen per boundary (:func:`choose_mover`)
from what both ends publish in the store before any channel is built (their
network stack, GPU runtime and whether Mooncake's RDMA transport can run), so
both ends choose alike without another round trip; one line per boundary
says what was chosen and why.
"""
from __future__ import annotations

import importlib
import json
import sys
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable, Mapping, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from hetpipe.devices.cluster import ClusterConfig
from hetpipe.comm.channel import Channel, ChannelError
from hetpipe.comm.mooncake_mover import rdma_unavailable_reason
from hetpipe.comm.nics import Nic, network_identity
from hetpipe.comm.p2p import TorchP2PChannel
from hetpipe.comm.threaded import ThreadedChannel
from hetpipe.errors import ConfigError
from hetpipe.pipeline.transports import AUTO, FALLBACK, ONE_HOST_MOVERS, TRANSPORTS, Transport, transport

_FACTS_KEY = "hetpipe/direct_facts/{}"


def check_transport_available(cluster: ClusterConfig) -> Transport:
    """The cross-vendor transport this release runs for ``cluster.transport.kind`` (auto: the
    registry's fallback); a :class:`ConfigError` if it cannot run on ``cluster``."""
    entry, mover = transport(cluster.transport.kind), cluster.transport.mover
    if entry.movers and mover in ONE_HOST_MOVERS and not cluster.single_node:
        raise ConfigError(f"cluster.transport.mover={mover} maps memory of one host, but this cluster spans "
                          f"nodes: use mover={AUTO} (Mooncake over RDMA where both ends have it, else "
                          f"{FALLBACK.name}) or a mooncake mover")
    return entry


@dataclass(frozen=True)
class MoverFacts:
    """What a rank publishes so both ends of a direct boundary choose the same mover."""

    network: str  # nics.network_identity(): equal exactly when two ranks share a host's network stack
    runtime: str  # 'cpu', 'cuda' or 'hip': IPC maps memory of one runtime only
    rdma: str | None  # why Mooncake over RDMA cannot run on this rank; None where it can

    @classmethod
    def local(cls, device: torch.device) -> "MoverFacts":
        runtime = "cpu" if device.type != "cuda" else ("hip" if torch.version.hip else "cuda")
        return cls(network_identity(), runtime, rdma_unavailable_reason(device))


def choose_mover(a: MoverFacts, b: MoverFacts) -> tuple[str, str]:
    """(mover, why) for a direct boundary between ranks with facts ``a`` and ``b`` under
    ``cluster.transport.mover=auto``; the mover is the same for (b, a), so both ends agree.
    A transport's name instead of a mover's means the boundary falls back to that channel."""
    if a.network == b.network:
        if a.runtime == b.runtime:
            return "auto", "one host: " + ("shared memory" if a.runtime == "cpu" else f"{a.runtime.upper()} IPC")
        return FALLBACK.name, f"one host, but IPC cannot map {a.runtime} memory into a {b.runtime} rank"
    missing = sorted(r for r in (a.rdma, b.rdma) if r is not None)
    if not missing:
        return "mooncake-rdma", ("two hosts, both with RDMA; RDMA, GPU memory over RDMA and ROCm are not "
                                 "verified by hetpipe's tests (docs/architecture.md)")
    return FALLBACK.name, f"two hosts, no RDMA on one end: {missing[0]}"


class Sealer(Protocol):
    """The job secret's seal for store values (hetpipe.launch.store_seal.Seal): ``open_text``
    raises a ValueError, saying why, for a value this job did not write."""

    def seal_text(self, key: str, text: str) -> str: ...

    def open_text(self, key: str, raw: bytes) -> str: ...


def exchange_mover_facts(store: dist.Store, rank: int, peers: Sequence[int], mine: MoverFacts,
                         names: Mapping[int, str], deadline: float,
                         seal: Optional[Sealer] = None) -> dict[int, MoverFacts]:
    """Publish ``mine`` and read each peer's, waiting at most ``deadline`` s; with ``seal``,
    sealed, and a peer's entry that is not this job's stops the channel (the facts decide
    which mover both ends run)."""
    text = json.dumps(asdict(mine))
    store.set(_FACTS_KEY.format(rank), seal.seal_text(_FACTS_KEY.format(rank), text) if seal else text)
    keys = [_FACTS_KEY.format(p) for p in peers]
    try:
        store.wait(keys, timedelta(seconds=deadline))
    except RuntimeError:  # torch's DistStoreError on timeout
        late = [names[p] for p, k in zip(peers, keys) if not store.check([k])]
        raise ChannelError(f"{names[rank]} waited {deadline:g} s for {', '.join(late)} to say which direct "
                           "movers it can run (cluster.transport.deadline_s)") from None
    facts = {}
    for p, key in zip(peers, keys):
        raw = store.get(key)
        try:
            text = seal.open_text(key, raw) if seal else raw.decode()
        except ValueError as exc:
            raise ChannelError(f"{names[p]}'s direct-mover facts ({key}) in the job's store are not this job's: "
                               f"{exc}; a process outside the job wrote them, so the channel stops rather than "
                               "let them choose its mover") from None
        try:
            facts[p] = MoverFacts(**json.loads(text))
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            raise ChannelError(f"{names[p]} published malformed mover facts: {exc}") from None
    return facts


def build_rank_channels(rank: int, *, same_vendor: Sequence[int], cross_vendor: Sequence[int],
                        names: Mapping[int, str], store: dist.Store, cluster: ClusterConfig, token: str,
                        device: torch.device, p2p_groups: Mapping[tuple[int, int], dist.ProcessGroup],
                        nics: Sequence[Nic],
                        on_failure: Callable[[ChannelError], None] | None = None,
                        seal: Optional[Sealer] = None) -> dict[int, Channel]:
    """The channel to each of ``same_vendor`` and ``cross_vendor`` (global ranks), keyed by rank.

    ``names`` names every rank in errors; ``store`` is the job's rendezvous
    store (socket channels publish their endpoints there) and ``token`` the
    job's shared secret for their handshakes; ``p2p_groups`` maps each ordered
    (sender, receiver) pair of same-vendor ranks to its process group;
    ``nics`` are this node's channel NICs (resolved and checked by the
    topology), whose addresses the socket channels listen on and publish. ``on_failure``
    hears of a cross-vendor peer that fails mid-transfer
    (:meth:`~hetpipe.comm.threaded.ThreadedChannel.notify_failures`). The
    whole ``cluster`` is taken because whether a transport runs depends on
    it (``direct`` chooses a mover per boundary). Ranks that share a
    transport share one channel object: close each distinct channel once.
    """
    addresses = [nic.address for nic in nics]
    transport = cluster.transport
    entry = check_transport_available(cluster)
    by_rank: dict[int, Channel] = {}
    if same_vendor:
        p2p = TorchP2PChannel(rank, list(same_vendor), dict(names), dict(p2p_groups),
                              deadline=transport.deadline_s)
        by_rank.update({r: p2p for r in same_vendor})
    if cross_vendor:
        peers = list(cross_vendor)
        choices = _routes(entry, peers, rank=rank, names=names, store=store, cluster=cluster, device=device,
                          seal=seal)
        for route in sorted({route for route, _ in choices.values()}):
            group = [p for p in peers if choices[p][0] == route]
            # A route is a transport of its own (the kind, or a direct boundary's fallback) or a mover.
            build = _builder(TRANSPORTS.get(route, entry))
            cross = build(rank, group, names=names, store=store, cluster=cluster, token=token, device=device,
                          addresses=addresses, route=route)
            if entry.movers:
                label = f"{route} channel (fallback)" if route in TRANSPORTS else \
                    f"{entry.name} channel, mover {route}"
                for p in group:
                    if rank < p:  # one line per boundary, from its lower rank
                        print(f"hetpipe: boundary {names[rank]} <-> {names[p]}: {label}: {choices[p][1]}",
                              file=sys.stderr, flush=True)
            if on_failure is not None and isinstance(cross, ThreadedChannel):
                cross.notify_failures(on_failure)
            by_rank.update({r: cross for r in group})
    return by_rank


def _routes(entry: Transport, peers: list[int], *, rank: int, names: Mapping[int, str], store: dist.Store,
            cluster: ClusterConfig, device: torch.device, seal: Optional[Sealer]) -> dict[int, tuple[str, str]]:
    """Each peer's route and why: the kind itself, or for a kind with movers the mover that
    carries the boundary (chosen per boundary under mover=auto)."""
    transport = cluster.transport
    if not entry.movers:
        return {p: (entry.name, f"cluster.transport.kind={entry.name}") for p in peers}
    if transport.mover == AUTO:
        mine = MoverFacts.local(device)
        facts = exchange_mover_facts(store, rank, peers, mine, names, transport.deadline_s, seal)
        return {p: choose_mover(facts[p], mine) for p in peers}
    return {p: (transport.mover, f"cluster.transport.mover={transport.mover}") for p in peers}


def _builder(entry: Transport) -> Callable[..., Channel]:
    """The entry's channel builder, imported now: only the kinds a job runs are loaded."""
    module, _, function = entry.builder.partition(":")
    return getattr(importlib.import_module(module), function)
