"""A node that hosts the job's stores leaves last when the job ends in failure or on a signal.

The launcher of one node hosts the stores every node uses (the rendezvous
store, and the store its agent shares with the ranks: hetpipe.launch.store_bind).
When a job fails, each launcher leaves as soon as its own ranks are gone
(hetpipe.launch.agent._leave); another node may still be in its last store
calls then - its ranks waiting for the job's verdict, its agent closing the
rendezvous. If the host left first, each of those calls would meet a closed
connection, and torch's C++ client prints such an error with its C++ frames,
after the job's one line. So each launcher marks its leaving in
the attempt's namespace of the shared store once its ranks are gone and its
rendezvous is closed, and a launcher that hosts a store waits for every
node's mark before it exits - at most :data:`WAIT_S`: a node whose way to the
store is gone never marks, and its calls fail on their own timeout instead.
A job that succeeds needs none of this: torch's agents pass an exit barrier.
"""
from __future__ import annotations

import time
from typing import Any

from hetpipe.launch.store_calls import call_within

KEY = "left"
# How long a hosting launcher waits for the other nodes' marks: the other
# nodes' ranks stop within their wait for a cause and their linger
# (job_watch._GRACE_S + _LINGER_S) of the host's. A node that cannot reach the
# store never marks, and delays the host's exit by this much.
WAIT_S = 3.0
# A mark, or a count of them, that takes longer than this is from a node whose
# way to the store is gone: it leaves without.
_CALL_S = 1.0
_POLL_S = 0.05


def leave_in_order(store: Any, where: str, nodes: int, hosting: bool) -> bool:
    """Mark this node's leaving in ``store`` (the attempt's namespace of the shared store, at
    ``where``); if ``hosting``, wait until all ``nodes`` marked or :data:`WAIT_S` passed.
    Whether every node marked (False also when the store did not answer)."""
    try:
        left = call_within(lambda: store.add(KEY, 1), _CALL_S, where)
        until = time.monotonic() + WAIT_S
        while hosting and left < nodes and time.monotonic() < until:
            time.sleep(_POLL_S)
            left = call_within(lambda: store.add(KEY, 0), _CALL_S, where)
    except Exception:  # noqa: BLE001 - the store is gone, or the way to it: nobody is left to wait for
        return False
    return left >= nodes
