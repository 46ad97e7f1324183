"""Which channel carries each of this rank's boundary ranks, and how each transport is built.

The topology decides *which* ranks this rank exchanges activations with (its
routes); this module knows every transport's constructor. Same-vendor
neighbours share one :class:`~hetpipe.comm.p2p.TorchP2PChannel` over the
per-direction process groups, cross-vendor neighbours one channel of the
configured kind (``cluster.transport.kind``). Keeping that knowledge here
keeps the topology to ranks, groups and routes (like torchtitan's
``ParallelDims``) and the engine to stages.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from hetpipe.cluster import ClusterConfig
from hetpipe.comm.channel import Channel
from hetpipe.comm.direct import DirectChannel
from hetpipe.comm.gloo import GlooChannel
from hetpipe.comm.p2p import TorchP2PChannel
from hetpipe.comm.tcp import TcpChannel
from hetpipe.errors import ConfigError


def check_transport_available(cluster: ClusterConfig) -> str:
    """The cross-vendor channel kind this release runs for ``cluster.transport.kind``
    ('tcp', 'direct' or 'gloo'); a :class:`ConfigError` if it cannot run on ``cluster``."""
    kind = cluster.transport.kind
    if kind == "direct" and not cluster.single_node:
        raise ConfigError("cluster.transport.kind=direct moves data through shared memory or CUDA/HIP IPC, "
                          "so both sides of a boundary must be on one host; the RDMA (verbs) mover is not "
                          "implemented yet: use tcp across nodes")
    # auto is the CPU-forwarding channel: direct's IPC mover needs one vendor's
    # runtime on both sides (true only when emulating), and it has no RDMA mover.
    return "tcp" if kind == "auto" else kind


def build_rank_channels(rank: int, *, same_vendor: Sequence[int], cross_vendor: Sequence[int],
                        names: Mapping[int, str], store: dist.Store, cluster: ClusterConfig, token: str,
                        device: torch.device,
                        p2p_groups: Mapping[tuple[int, int], dist.ProcessGroup]) -> dict[int, Channel]:
    """The channel to each of ``same_vendor`` and ``cross_vendor`` (global ranks), keyed by rank.

    ``names`` names every rank in errors; ``store`` is the job's rendezvous
    store (socket channels publish their endpoints there) and ``token`` the
    job's shared secret for their handshakes; ``p2p_groups`` maps each ordered
    (sender, receiver) pair of same-vendor ranks to its process group. The
    whole ``cluster`` is taken because whether a transport runs depends on
    it (``direct`` needs one host). Ranks that share a transport share one
    channel object: close each distinct channel once.
    """
    transport = cluster.transport
    kind = check_transport_available(cluster)
    by_rank: dict[int, Channel] = {}
    if same_vendor:
        p2p = TorchP2PChannel(rank, list(same_vendor), dict(names), dict(p2p_groups),
                              deadline=transport.deadline_s)
        by_rank.update({r: p2p for r in same_vendor})
    if cross_vendor:
        peers = list(cross_vendor)
        if kind == "direct":
            cross: Channel = DirectChannel(rank, peers, dict(names), store, token=token,
                                           deadline=transport.deadline_s, device=device,
                                           address=transport.addresses[0])
        elif kind == "tcp":
            cross = TcpChannel(rank, peers, dict(names), store, token=token, addresses=list(transport.addresses),
                               streams_per_address=transport.streams_per_address,
                               deadline=transport.deadline_s, device=device)
        else:
            cross = GlooChannel(rank, peers, dict(names), None, deadline=transport.deadline_s)
        by_rank.update({r: cross for r in cross_vendor})
    return by_rank
