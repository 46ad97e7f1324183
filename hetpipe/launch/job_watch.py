"""Stop every rank of a job with the one reason that started it: a lost node, a dead NIC, a failed rank.

When a node dies, the ranks of the other nodes fail in whatever they were
doing: one in a boundary receive, one in a gloo collective ("Connection
closed by peer"), one waiting on a neighbour of its own node that already
left, one killed by its launcher because a sibling exited. Each would say
something different, or nothing, or print a traceback. So the first rank that
knows the *cause* posts it under one key of the job's store (first post wins,
``compare_set``), and every rank exits with the status posted with it (the
first of a node's ranks to stop prints the line, once per node) - 3 (``EXIT_LOST_PEER``) for a node, link or peer that
failed, 1 (``EXIT_CRASH``) for a crashed rank, 4 (``EXIT_OUT_OF_MEMORY``) for
a device out of memory (:mod:`hetpipe.training.memory_fit`), 2 only for bad input - which
the launchers read as "this rank already said why":

* a boundary channel posts from its I/O thread the moment a peer fails mid-
  transfer (:meth:`~hetpipe.comm.threaded.ThreadedChannel.notify_failures`),
  a lost peer after the wait below;
* each rank's watch thread checks this node's NICs - its channel NICs and
  the one that leads to the store - and stops the job when one goes down,
  then polls the key; the NIC check never waits for the store. The store is
  reached through a client of the watch's own, driven by a thread of its own
  (:mod:`hetpipe.launch.store_calls`): a request waits at most half the
  deadline, nobody holds a lock while it waits, and a store that does not
  answer by then, or fails, is node 0 lost (node 0's launcher hosts it),
  named with the NIC this node reaches it through;
* a rank whose collective failed, whose boundary wait timed out without
  evidence of what stalled, or whose boundary peer closed or reset its
  connection, waits up to ``_GRACE_S`` (after a timeout, half the deadline
  more: :func:`grace_for`) for a posted cause before posting its
  own (naming the node whose address gloo's message carries): a lost
  connection is usually the consequence of something its peer's side knows
  better - the peer raised (it posts its exception once its ``finally``
  blocks closed the connection) or was killed (its launcher, which saw the
  signal, posts "rank 1 (pid ...) was killed by SIGKILL", see
  :mod:`hetpipe.launch.agent`); only a whole node gone leaves nobody to say
  more, and then the connection is the cause;
* a rank whose wait on a peer failed first reads its launchers' notes of
  stopped ranks (:mod:`hetpipe.launch.frozen_ranks`): a frozen rank is the
  cause, named at once ("rank 1 (pid ...) stopped responding"), without the
  wait for a better one;
* every rank lingers ``_LINGER_S`` after printing, so that its node's other
  ranks read the cause before their launcher stops them (torchrun stops a
  node's ranks as soon as one exits).

A rank whose code raised something that is not a communication failure has a
bug: its traceback is printed as usual, and the others stop with "rank N
failed" and status 1 (``EXIT_CRASH``), as they do for a rank killed by a signal.

The keys live under the job's attempt (:func:`namespace`): an elastic agent
keeps one store for all restarts of a job (torch's agent hosts it and hands
every attempt the same address), so without it a restarted attempt would read
the last attempt's verdict and stop at once - and gloo would dial the last
attempt's addresses. The verdict is sealed with the job secret for its key
and attempt (:mod:`hetpipe.launch.verdicts`): one that anybody else wrote is
ignored, with one warning line per node, and a job without a secret stops
at start-up, its ranks with status 2 and a line saying what to set.

Measured on two emulated nodes, two busy cores. Every NIC of either node
taken down mid-run, on a switch and on a direct cable (tests/test_nic_faults.py,
deadline 8 s), ended both launchers with status 3 1.9 to 13.3 s later: within
4 s where the other node read the posted cause; where node 1's route to the
store died, its line came 0.15 s after the NIC went down (it used to come
never: the watch blocked in a store request for 9.7 minutes, until killed)
and its launcher exited 10.7 to 13.3 s after (5 s for its rendezvous call,
:func:`hetpipe.process.torch_compat.bound_rendezvous_calls`, and 5 s for the
verdict, hetpipe/launch/agent.py); a node that could no longer reach the
store said so after 4 s (half the deadline) and its launcher exited at 11.2 s.
With a 15 s deadline (tests/test_node_faults.py), a killed node stops the
other's ranks in 3.7 to 4.1 s (1.9 s before their lost connections waited
``_GRACE_S`` for a better cause), a link that goes silent without a NIC
changing state in 9.6 to 10.5 s (half the deadline, comm/tcp.py). A single
rank killed on a node is named by its launcher on every rank of both nodes
(tests/test_root_cause.py).
"""
from __future__ import annotations

import ipaddress
import os
import sys
import re
import socket
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, NoReturn, Optional, Sequence

import torch.distributed as dist

from hetpipe.comm.channel import ChannelError, ChannelTimeout
from hetpipe.comm.nics import Nic, list_interfaces
from hetpipe.comm.tcp_links import LinkStalled, stall_after
from hetpipe.comm.threaded import PeerLost
from hetpipe.errors import EXIT_CRASH, EXIT_LOST_PEER, HetpipeError, error_line
from hetpipe.launch.frozen_ranks import Frozen, frozen_in
from hetpipe.launch.nodes import NodeMap, NodeMissing
from hetpipe.launch.store_calls import BoundedClient, Request
from hetpipe.launch.verdicts import (ABORT_KEY, Verdict, first_on_node, job_seal, namespace, post_in, post_verdict,
                                     posted_verdict, read_in)

__all__ = ["ABORT_KEY", "JobWatch", "Verdict", "namespace", "post_verdict", "posted_verdict", "stop_rank"]

# Four polls a second: a stopped job is noticed well within a second on every
# rank, for one small store request per rank.
_POLL_S = 0.25
# A channel's I/O thread sees a lost peer's EOF within milliseconds of gloo's
# own error, and a launcher posts a killed rank's signal within its 20 ms poll
# of its workers (hetpipe/launch/agent.py); a rank that raised posts once its
# ``finally`` blocks closed its channels (up to 2 s, comm/threaded.py's joins,
# usually milliseconds). The slack is for a busy machine.
_GRACE_S = 2.0
# Four polls: every rank of the node has read the cause before torchrun,
# which stops a node's ranks once one exits (0.1 s later), reaches them.
_LINGER_S = 1.0
# A store request that takes longer than this share of the deadline (at most
# _STORE_CAP_S) has lost the store: as a boundary link that carried nothing for
# half the deadline has stalled (comm/tcp.py). A healthy store answers the
# watch's poll in milliseconds; a request over a NIC that went down waited
# for TCP's retransmission timeout (9.7 minutes, until killed: issue 32).
_STORE_SHARE = 0.5
_STORE_CAP_S = 60.0
_DOWN_STATES = ("down", "lowerlayerdown", "notpresent")
# Where gloo names its peer: "Connection closed by peer [10.201.0.2]:41234".
_GLOO_PEER = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")
_GLOO_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")

_current: Optional[JobWatch] = None
_exiting = threading.Lock()
_said = threading.Lock()  # held once this process printed its line


class JobWatch:
    """This rank's view of the job's one failure: posts it, polls for it, stops the rank on it.

    ``store`` is the job's TCPStore (its host and port give the watch a client
    of its own, whose keys go under ``prefix``, the attempt's :func:`namespace`);
    ``nodes`` and ``boundaries`` (this node's cross-node rank pairs, as ``(this
    rank, peer rank, "stage 1 <-> stage 2")``) come from the topology once the
    roll call is done (:meth:`arm`). The job secret seals what it posts and
    opens what it reads (:mod:`hetpipe.launch.verdicts`); a job without one
    stops here, with one line (:func:`~hetpipe.launch.verdicts.job_seal`).
    """

    def __init__(self, store: dist.TCPStore, rank: int, deadline: float, prefix: str) -> None:
        self.rank = rank
        self.deadline = deadline
        self.nodes: Optional[NodeMap] = None
        self.seal = job_seal()  # also the roll call's and the direct channel's (hetpipe.training.topology)
        self._who = f"[rank {rank}] "
        self._store_at = (store.host, store.port)
        client = dist.PrefixStore(prefix, dist.TCPStore(store.host, store.port, is_master=False,
                                                        timeout=timedelta(seconds=deadline)))
        self._calls = BoundedClient(client, min(deadline * _STORE_SHARE, _STORE_CAP_S),
                                    f"{store.host}:{store.port}", name=f"hetpipe-watch-{rank}-store")
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._nics: list[Nic] = []
        self._store_nic: Optional[Nic] = None  # the NIC this node reaches the store through, if not its own
        self._boundaries: list[tuple[int, int, str]] = []

    # -- life cycle -------------------------------------------------------------
    def install(self) -> JobWatch:
        """Make this the watch that :func:`stop_rank` reports through."""
        global _current
        _current = self
        return self

    def arm(self, nodes: NodeMap, nics: Sequence[Nic], boundaries: Sequence[tuple[int, int, str]]) -> None:
        """Start polling, with the job's nodes, this node's channel NICs and cross-node boundaries
        (and the NIC that leads to the store, when it is on another node)."""
        self.nodes, self._nics, self._boundaries = nodes, list(nics), list(boundaries)
        self._store_nic = _route_to(self._store_at[0])
        up = {i.name for i in list_interfaces() if i.state not in _DOWN_STATES}
        named = {nic.name: nic for nic in [*self._nics, *filter(None, [self._store_nic])]}
        watched = [nic for name, nic in named.items() if name in up]  # one already down cannot go down
        self._thread = threading.Thread(target=self._run, args=(watched,), daemon=True,
                                        name=f"hetpipe-watch-{self.rank}")
        self._thread.start()

    def stop(self) -> None:
        """The job ended, or is ending, here: stop polling. The watch stays installed, so a
        failure that is still unwinding (through ``finally`` blocks) is reported through it."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(2 * _POLL_S)

    # -- the one reason ------------------------------------------------------------
    def posted(self, wait: Optional[float] = None) -> Optional[Verdict]:
        """The reason posted so far, with the status it ends ranks with, if any; raises if the
        store is lost or gives no answer within ``wait`` s (default: its limit)."""
        return self._calls.call(self._read, wait)

    def post(self, reason: str, code: int = EXIT_LOST_PEER) -> Verdict:
        """Post ``reason`` (ending ranks with ``code``) unless one is there already;
        returns the one that stands."""
        return self._calls.call(self._poster(reason, code))

    def _read(self, client: Any) -> Optional[Verdict]:
        return read_in(client, self.seal, self._who)

    def _poster(self, reason: str, code: int) -> Any:
        return lambda client: post_in(client, self.seal, self.rank, reason, code, self._who)[0]

    def report(self, error: ChannelError) -> None:
        """A channel's failure hook (on the channel's I/O thread): post its cause - a lost
        peer only if no better cause is posted within ``_GRACE_S`` (on a thread of its own).
        Never waits for the store: the post is queued ahead of any the main thread makes
        once its transfer fails, so it stands over theirs."""
        if isinstance(error, PeerLost):
            threading.Thread(target=self._report_unless_explained, args=(error,), daemon=True,
                             name=f"hetpipe-watch-{self.rank}-lost").start()
            return
        self._calls.submit(self._poster(self.explain(error), _status_of(error)))

    def _report_unless_explained(self, error: PeerLost) -> None:
        try:
            if self.wait_for_verdict() is None:
                self.post(self.explain(error), _status_of(error))
        except Exception:  # noqa: BLE001 - the store is gone too; the main thread reports
            pass

    def wait_for_verdict(self, grace: float = _GRACE_S) -> Optional[Verdict]:
        """The verdict posted within ``grace`` seconds, if any (None too when the store fails
        or does not answer within it)."""
        until = time.monotonic() + grace
        while True:
            try:
                verdict = self.posted(wait=max(until - time.monotonic(), 0.05))
            except Exception:  # noqa: BLE001
                return None
            if verdict is not None or time.monotonic() >= until:
                return verdict
            time.sleep(0.1)

    def frozen(self) -> Optional[Frozen]:
        """The rank a launcher noted stopped (SIGSTOP, a debugger), if any (None too when the store
        does not answer)."""
        if self.nodes is None:
            return None
        try:
            return self._calls.call(lambda client: frozen_in(client, self.seal, len(self.nodes.node_of)))
        except Exception:  # noqa: BLE001
            return None

    def stop_if_frozen(self) -> None:
        """Stop the job naming a stopped rank, the cause of any wait on it that timed out."""
        frozen = self.frozen()
        if frozen is not None:
            self.stop_job(frozen.line(), EXIT_LOST_PEER)

    def explain(self, exc: BaseException) -> str:
        """One line for ``exc``, naming the node a lost peer or a stalled link leads to."""
        message = _first_line(exc)
        if self.nodes is None:
            return message
        if isinstance(exc, (PeerLost, LinkStalled)):
            peer_node = self.nodes.node_of[exc.peer]
            if peer_node != self.nodes.node_of[self.rank]:
                label = self.nodes.label(peer_node)
                return f"{label} lost: {message}" if isinstance(exc, PeerLost) else \
                    f"link to {label} stalled: {message}"
            return message
        if isinstance(exc, HetpipeError):
            return message
        match = _GLOO_PEER.search(message)
        node = self.nodes.node_at(match.group(1)) if match else None
        if node is not None and node != self.nodes.node_of[self.rank]:
            return f"{self.nodes.label(node)} lost: a collective failed: {message}"
        return f"a collective failed: {message}"

    def announce(self, reason: str, code: int) -> None:
        """Post ``reason`` and print the line that stands, now, and let this rank unwind:
        its ``finally`` blocks run while every other rank already stops. Printed first
        here, since the others, once they read it, linger only ``_LINGER_S`` before
        their launcher may stop this rank too; its exit later prints nothing more."""
        try:
            standing = self.post(reason, code)
        except Exception:  # noqa: BLE001 - the store is unreachable: say our own reason
            standing = Verdict(reason, code)
        _say(self.rank, standing.reason)

    def stop_job(self, reason: str, code: int = EXIT_LOST_PEER, post: bool = True) -> NoReturn:
        """Post ``reason`` (unless another stands, or not ``post``: the store is out of
        reach), print the standing one, stop this rank."""
        standing = Verdict(reason, code)
        if post:
            try:
                standing = self.post(reason, code)
            except Exception:  # noqa: BLE001 - the store is unreachable: say our own reason
                pass
        _exit(self.rank, standing.reason, standing.code)

    # -- the watch thread ------------------------------------------------------------
    def _run(self, watched: list[Nic]) -> None:
        """This node's NICs first, every poll, whatever the store does; then the store's
        answer to the last poll, if it came (a poll never holds up the next NIC check)."""
        pending: Optional[Request[Optional[Verdict]]] = None
        while not self._stopped.wait(_POLL_S):
            self._check_nics(watched)
            pending = self._poll(pending)

    def _check_nics(self, watched: list[Nic]) -> None:
        if not watched:
            return
        states = {i.name: i.state for i in list_interfaces()}
        for nic in watched:
            if states.get(nic.name, "notpresent") in _DOWN_STATES and not self._stopped.is_set():
                # Over a NIC that leads to the store, a post would only wait out the store's limit.
                self.stop_job(self._nic_down(nic), post=nic.name != getattr(self._store_nic, "name", None))

    def _poll(self, pending: Optional[Request[Optional[Verdict]]]) -> Optional[Request[Optional[Verdict]]]:
        """Start a poll of the store, or take the last one's answer; stop the rank on a
        verdict, or when the store is lost."""
        if pending is None:
            return self._calls.submit(self._read)
        if not pending.done.is_set():
            if self._calls.failure() is not None:
                self._store_lost()
            return pending
        try:
            verdict = pending.answer()
        except Exception:  # noqa: BLE001 - any store failure means its host, or the way to it, is gone
            self._store_lost()
            return None
        if verdict is not None and not self._stopped.is_set():
            _exit(self.rank, verdict.reason, verdict.code)
        return None

    def _store_lost(self) -> None:
        if self._stopped.is_set():
            return
        assert self.nodes is not None
        nic = self._store_nic
        via = f", reached through NIC {nic.name} ({nic.address}) of {self.nodes.label_of(self.rank)}" if nic else ""
        _exit(self.rank, f"{self.nodes.label(0)} lost: {self._calls.failure()}{via}", EXIT_LOST_PEER)

    def _nic_down(self, nic: Nic) -> str:
        assert self.nodes is not None
        carried = [f"the job's store connection to {self.nodes.label(0)} at {self._store_at[0]}:{self._store_at[1]}"
                   for store_nic in [self._store_nic] if store_nic is not None and store_nic.name == nic.name]
        index = next((k for k, mine in enumerate(self._nics) if mine.name == nic.name), None)
        if index is not None:
            carried[:0] = [f"{pair} (rank {mine} <-> rank {peer}) with {self.nodes.label_of(peer)} over {nic.address} "
                           f"<-> {(self.nodes.addresses.get(peer, ()) + ('?',) * (index + 1))[index]}"
                           for mine, peer, pair in self._boundaries] or ["this node's share of the world group"]
        return (f"NIC {nic.name} ({nic.address}) of {self.nodes.label_of(self.rank)} went down: it carries "
                f"{'; '.join(carried)}; hetpipe stops rather than move its traffic to the remaining NICs "
                "(comm/tcp.py)")


def _route_to(host: str) -> Optional[Nic]:
    """The NIC through which this node reaches ``host`` (the store's), as routing picks it
    now; None when ``host`` is this node's own (its loopback, or one of its addresses)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)  # a datagram socket's connect sends nothing: it only routes
            source = probe.getsockname()[0]
    except OSError:
        return None
    interfaces = list_interfaces()
    if ipaddress.ip_address(sockaddr[0]).is_loopback or any(sockaddr[0] in i.addresses for i in interfaces):
        return None
    return next((Nic(i.name, source) for i in interfaces if source in i.addresses), None)


def _status_of(exc: HetpipeError) -> int:
    """A peer that misbehaves on the wire is bad input; one that vanished is not; a
    device out of memory is its own status (errors.EXIT_OUT_OF_MEMORY)."""
    return EXIT_LOST_PEER if isinstance(exc, (PeerLost, LinkStalled, NodeMissing)) else exc.exit_status


def _exit(rank: int, reason: str, code: int, linger: bool = True) -> NoReturn:
    """Print the one line (once per process, whichever thread gets here first) and leave."""
    if _exiting.acquire(blocking=False):
        _say(rank, reason)
        _silence_stderr()
        if linger:
            time.sleep(_LINGER_S)
        os._exit(code)  # skip interpreter teardown: peers may hold sockets to us, threads may block
    while True:  # another thread is printing and exiting
        time.sleep(1.0)


def _silence_stderr() -> None:
    """Nothing more on standard error once the rank's line is out: while it lingers, a store
    client whose server (node 0's launcher) is already gone makes torch's C++ side write its
    failure with a native stack (seen on two emulated nodes under load), which would bury the
    one line the job ends with."""
    sys.stderr.flush()
    try:
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 2)
    except OSError:
        pass


def _say(rank: int, reason: str) -> None:
    """This process's one line, once (announce, then _exit, print it once), and
    only by the first rank of its node's launch to get here (:func:`~hetpipe.launch.verdicts.first_on_node`)."""
    if _said.acquire(blocking=False) and first_on_node("said"):
        error_line(f"[rank {rank}] {reason}")


def grace_for(exc: BaseException, deadline: float) -> float:
    """How long a rank stopped by ``exc`` (a secondary or communication failure) waits
    for a posted cause: ``_GRACE_S``, and half the deadline more for a timeout. A
    timeout is the weakest evidence: the rank it waited on may be waiting on the cause
    itself, and a channel names a node gone silent behind a dead link only half the
    deadline after it saw the link close (comm/tcp.py). Upstream ranks have waited
    longest, so their timeouts come first: with node 1's route to the store down,
    node 0's ranks timed out before their channel named node 1 (tests/test_nic_faults.py:
    2 of 3 runs of the module under two workers, none of 6 since)."""
    timeout = isinstance(exc, ChannelTimeout) and not isinstance(exc, LinkStalled) or \
        _is_comm_failure(exc) and "timed out" in str(exc).lower()
    return _GRACE_S + (stall_after(deadline) if timeout else 0.0)


def _first_line(exc: BaseException) -> str:
    """The gist of ``exc``: its first line, without gloo's source location and advice."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    text = _GLOO_LOCATION.sub("", text.splitlines()[0])
    return text.split(" This is typically caused by", 1)[0]


def _is_secondary(exc: BaseException) -> bool:
    """A boundary wait that timed out with no evidence of its own about why, or a
    peer that went away (a lost connection, or a same-vendor transfer that failed
    because gloo's or NCCL's did): usually a consequence of a stall, an exception
    or a kill elsewhere, whose rank (or launcher) reports the cause."""
    if isinstance(exc, PeerLost):
        return True
    if isinstance(exc, ChannelTimeout):
        return not isinstance(exc, LinkStalled)
    return isinstance(exc, ChannelError) and exc.__cause__ is not None and _is_comm_failure(exc.__cause__)


def _is_comm_failure(exc: BaseException) -> bool:
    """torch.distributed failures (gloo raises plain RuntimeErrors that name its transport)."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and dist.Backend.GLOO in str(exc))


def stop_rank(exc: BaseException) -> NoReturn:
    """End this rank for ``exc`` with one line, as the job's watch decides; never returns.

    Before the job has a watch (bad input found at start-up) a
    :class:`HetpipeError` is its own line, and a bug its traceback and one line.
    """
    rank = int(os.environ.get("RANK", "0"))
    watch = _current
    if watch is None:
        if isinstance(exc, HetpipeError):
            code = EXIT_LOST_PEER if isinstance(exc, NodeMissing) else exc.exit_status
            _exit(rank, str(exc), code, linger=False)  # no job yet: no peer to wait for
        traceback.print_exception(exc)
        _exit(rank, _bug(rank, exc), EXIT_CRASH, linger=False)
    waited_on_peer = _is_secondary(exc) or _is_comm_failure(exc) or isinstance(exc, LinkStalled)
    if waited_on_peer:
        watch.stop_if_frozen()  # a stopped rank is the cause, and says nothing itself
    if isinstance(exc, HetpipeError) and not _is_secondary(exc):
        watch.stop_job(watch.explain(exc), _status_of(exc))
    if waited_on_peer:
        verdict = watch.wait_for_verdict(grace_for(exc, watch.deadline))
        if verdict is not None:
            _exit(rank, verdict.reason, verdict.code)
        watch.stop_if_frozen()  # stopped while this rank waited
        watch.stop_job(watch.explain(exc))  # nobody said more: this is the cause (EXIT_LOST_PEER)
    traceback.print_exception(exc)
    watch.stop_job(_bug(rank, exc), EXIT_CRASH)


def _bug(rank: int, exc: BaseException) -> str:
    return f"rank {rank} failed: {type(exc).__name__}: {_first_line(exc)} (traceback on its node)"
