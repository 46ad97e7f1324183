"""The engine's link to one neighbouring pipeline *stage*, whatever ranks and transports lie behind it.

With tensor and data parallelism a stage runs on ``TP x DP`` ranks, and the
pipeline engine should not care: it sends to "stage 2" and receives from
"stage 0". A :class:`StageLink` turns that into rank-level transfers on the
per-rank channels (:func:`hetpipe.comm.factory.build_rank_channels`: the
vendor's P2P inside a group, the cross-vendor channel across one): a send goes
to every rank of the neighbour that takes its data from this rank (one,
several when the neighbour has more TP ranks, none when it has fewer), a
receive comes from the one rank this rank takes its data from. The routes come
from :meth:`hetpipe.training.topology.Topology.routes`.

A link is not a :class:`~hetpipe.comm.channel.Channel`: a channel's ``peer`` is
always a global rank, and a link has no peer argument at all, since it
reaches exactly one stage.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from hetpipe.comm.channel import Channel, ChannelError, Handle


class _AllHandle(Handle):
    """Several transfers that complete together (a send fanned out to several ranks)."""

    def __init__(self, handles: Sequence[Handle]) -> None:
        self._handles = list(handles)

    def wait(self, timeout: float | None = None) -> None:
        for handle in self._handles:
            handle.wait(timeout)

    def done(self) -> bool:
        return all(handle.done() for handle in self._handles)


class StageLink:
    """Stage-level isend/irecv between this rank and neighbouring stage ``stage``.

    ``targets`` are the ranks this rank sends that stage's messages to,
    ``source`` the rank it receives them from, and ``by_rank`` the channel
    that reaches each of those ranks. The channels belong to whoever built
    them (the topology closes them); a link holds nothing to close.
    """

    def __init__(self, rank: int, stage: int, stage_name: str, targets: Sequence[int], source: int,
                 by_rank: Mapping[int, Channel]) -> None:
        missing = [r for r in [*targets, source] if r not in by_rank]
        if missing:
            raise ChannelError(f"rank {rank} has no channel to rank(s) {missing} of {stage_name}")
        self.rank = rank
        self.stage = stage
        self.stage_name = stage_name
        self.targets = list(targets)
        self.source = source
        self.by_rank = dict(by_rank)

    def isend(self, tensor: torch.Tensor, *, microbatch: int, kind: str) -> Handle:
        """Send ``tensor`` to every rank of the stage that takes it from this rank."""
        return _AllHandle([self.by_rank[r].isend(tensor, r, microbatch=microbatch, kind=kind)
                           for r in self.targets])

    def irecv(self, tensor: torch.Tensor, *, microbatch: int, kind: str) -> Handle:
        """Receive into ``tensor`` from the one rank of the stage this rank takes its data from."""
        return self.by_rank[self.source].irecv(tensor, self.source, microbatch=microbatch, kind=kind)
