"""The cross-vendor transports: one entry per channel kind, the one place that names them.

Every reader takes a transport's facts from its entry and never tests its name
(``tests/test_transports.py`` fails on a module that does): the cluster schema
(which kinds and movers ``cluster.transport`` takes, whether ``message_mac``
applies), the channel factory (which module builds the channel, whether the
kind chooses a mover per boundary), the topology (whether the job secret is
needed) and the planner (which cost model prices its messages, whether they
stripe over NICs). Ground floor: strings and booleans only, so the planner
reads it without loading torch or the channels.

Adding a channel: its module ``comm/<kind>.py`` with a ``build_channel``
function (the signature of :func:`hetpipe.comm.tcp.build_channel`), its entry
here, and its tests (docs/architecture.md, "How to add a mover or a channel").
"""
from __future__ import annotations

from dataclasses import dataclass

from hetpipe.errors import ConfigError


@dataclass(frozen=True)
class Transport:
    name: str
    # "module:function" that builds this kind's channel from the cluster config
    # (imported when a boundary needs it: the registry stays free of torch).
    builder: str
    # Its connections authenticate with the job's secret (comm/handshake.py), so every
    # rank of a job with such a boundary needs one (hetpipe/launch/job_secret.py).
    needs_job_secret: bool
    # cluster.transport.message_mac can MAC its frames (comm/message_mac.py).
    message_mac: bool
    # The cluster.transport.mover values it takes; () for a kind that moves its own bytes.
    movers: tuple[str, ...]
    # The planner's cost model for its messages (partitioner/planner_config.py TRANSPORT_MODELS).
    cost_model: str
    # Its messages stripe over cluster.transport's addresses times streams_per_address.
    stripes: bool


# What moves a direct boundary's bytes (comm/direct.py _MOVER_MAKERS builds each one).
MOVERS = ("auto", "shm", "ipc", "mooncake-tcp", "mooncake-rdma")
# Movers that map memory of one host only.
ONE_HOST_MOVERS = ("shm", "ipc")

TCP = Transport("tcp", builder="hetpipe.comm.tcp:build_channel", needs_job_secret=True, message_mac=True,
                movers=(), cost_model="cpu_forwarding", stripes=True)
DIRECT = Transport("direct", builder="hetpipe.comm.direct:build_channel", needs_job_secret=True,
                   message_mac=False, movers=MOVERS, cost_model="direct", stripes=True)
GLOO = Transport("gloo", builder="hetpipe.comm.gloo:build_channel", needs_job_secret=False, message_mac=False,
                 movers=(), cost_model="cpu_forwarding", stripes=False)

TRANSPORTS: dict[str, Transport] = {t.name: t for t in (TCP, DIRECT, GLOO)}
# What kind=auto runs, and where a direct boundary goes when no mover can run: the
# CPU-forwarding channel runs anywhere, while direct's IPC mover needs one vendor's runtime
# on both sides (true only when emulating) and its RDMA path is not verified by hetpipe's
# tests (kind=direct opts in).
FALLBACK = TCP
AUTO = "auto"
# The names cluster.transport.kind takes.
KINDS = (*TRANSPORTS, AUTO)


def transport(kind: str) -> Transport:
    """The entry ``cluster.transport.kind`` runs (auto: :data:`FALLBACK`)."""
    if kind == AUTO:
        return FALLBACK
    if kind not in TRANSPORTS:
        raise ConfigError(f"cluster.transport.kind={kind!r} is not one of {KINDS}")
    return TRANSPORTS[kind]
