"""The engine's view of a neighbouring pipeline *stage* when stages span several ranks.

With tensor and data parallelism a stage runs on ``TP x DP`` ranks, and the
pipeline engine should not care: it sends to "stage 2" and receives from
"stage 0". :class:`RoutedChannel` turns that into rank-level transfers on the
per-rank channels the topology built (the vendor's P2P inside a group, the
cross-vendor channel across one): a send goes to every rank of the neighbour
that takes its data from this rank (one, several when the neighbour has more
TP ranks, none when it has fewer), a receive comes from the one rank this rank
takes its data from. The routes come from :meth:`hetpipe.topology.Topology.routes`.
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


class RoutedChannel(Channel):
    """Stage-level isend/irecv over rank-level channels.

    ``peer`` in :meth:`isend`/:meth:`irecv` is the neighbouring stage's
    pipeline index; ``targets`` are the ranks this rank sends that stage's
    messages to, ``source`` the rank it receives them from, and ``by_rank``
    the channel that reaches each of those ranks.
    """

    def __init__(self, rank: int, stage: int, stage_name: str, targets: Sequence[int], source: int,
                 by_rank: Mapping[int, Channel]) -> None:
        missing = [r for r in [*targets, source] if r not in by_rank]
        if missing:
            raise ChannelError(f"rank {rank} has no channel to rank(s) {missing} of {stage_name}")
        first = by_rank[source]
        super().__init__(rank, [], {}, first.deadline)
        self.stage = stage
        self.stage_name = stage_name
        self.targets = list(targets)
        self.source = source
        self.by_rank = dict(by_rank)

    def _check_stage(self, peer: int) -> None:
        if peer != self.stage:
            raise ChannelError(f"rank {self.rank}'s channel to {self.stage_name} was asked for stage {peer}")

    def isend(self, tensor: torch.Tensor, peer: int, *, microbatch: int, kind: str) -> Handle:
        self._check_stage(peer)
        return _AllHandle([self.by_rank[r].isend(tensor, r, microbatch=microbatch, kind=kind)
                           for r in self.targets])

    def irecv(self, tensor: torch.Tensor, peer: int, *, microbatch: int, kind: str) -> Handle:
        self._check_stage(peer)
        return self.by_rank[self.source].irecv(tensor, self.source, microbatch=microbatch, kind=kind)

    def close(self) -> None:
        # The rank-level channels belong to the topology, which closes them.
        self._closed = True
