"""Ranks their launcher sees stopped, so that the job's line names the frozen rank.

A rank stopped by SIGSTOP or held by a debugger neither fails nor answers: its
neighbours time out after ``cluster.transport.deadline_s`` and, with nothing
better posted, blamed their timeout - after waiting half the deadline more
for a better cause (:func:`hetpipe.launch.job_watch.grace_for`), so the job
ended well past deadline + 5 s. Only the frozen rank's launcher can see
it: the agent's watch (:mod:`hetpipe.launch.agent`) reads its ranks' states
from /proc (:func:`hetpipe.launch.hung_ranks.process_state`) and, while one is
stopped, keeps a note of it in the attempt's store (sealed with the job
secret, as verdicts are: :mod:`hetpipe.launch.verdicts`), removed when it
runs again. A rank whose wait timed out reads the notes first
(:func:`hetpipe.launch.job_watch.stop_rank`) and, where one is there, stops
the job at once with ``rank 1 (pid 4242) stopped responding``, exit 3.
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple, Optional

from hetpipe.launch.hung_ranks import GONE_STATES, STOPPED_STATES, process_state
from hetpipe.launch.store_seal import Seal, Unsealed

NOTE_KEY = "hetpipe/stopped"


class Frozen(NamedTuple):
    """A rank its launcher saw stopped: since when (``time.time()``), and the launcher's node prefix."""
    rank: int
    pid: int
    since: float
    node: str = ""

    def line(self, now: Optional[float] = None) -> str:
        """``rank 1 (pid 4242) stopped responding: ...``, the job's one line."""
        held = (time.time() if now is None else now) - self.since
        return (f"{self.node}rank {self.rank} (pid {self.pid}) stopped responding: its process has been stopped "
                f"(SIGSTOP, a debugger) for {held:.1f} s")


def _key(rank: int) -> str:
    return f"{NOTE_KEY}/{rank}"


class FrozenNotes:
    """The launcher's side: a note per local rank while it is stopped (``ranks``: pid -> global rank)."""

    def __init__(self, store: Any, seal: Seal, ranks: dict[int, int], node: str = "") -> None:
        self._store = store
        self._seal = seal
        self._ranks = ranks
        self._node = node
        self._noted: set[int] = set()  # pids with a note in the store

    def sweep(self) -> None:
        """Note each newly stopped rank, drop the note of each that runs again."""
        for pid, rank in self._ranks.items():
            state = process_state(pid)
            if state in STOPPED_STATES and pid not in self._noted:
                body = {"rank": rank, "pid": pid, "since": time.time(), "node": self._node}  # a Frozen, sealed
                self._store.set(_key(rank), self._seal.seal(_key(rank), body))
                self._noted.add(pid)
            elif state not in (*STOPPED_STATES, *GONE_STATES) and pid in self._noted:
                # Running again. A rank that died keeps its note: its attempt is over, and the
                # store may be closing with it (a request would wait out the client's timeout).
                self._store.delete_key(_key(rank))
                self._noted.discard(pid)


def frozen_in(client: Any, seal: Seal, world_size: int) -> Optional[Frozen]:
    """The rank stopped longest among the sealed notes in ``client`` (the attempt's namespace), if any;
    a note this job did not seal is ignored."""
    found = []
    for rank in range(world_size):
        if client.check([_key(rank)]):
            try:
                found.append(Frozen(**seal.open(_key(rank), client.get(_key(rank)))))
            except (Unsealed, TypeError):
                continue
    return min(found, key=lambda f: f.since, default=None)
