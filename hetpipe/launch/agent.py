"""The elastic agent both launchers run: torch's own, plus the job's root cause, a line
per restart, and each attempt's environment.

``torch.distributed.launcher.api.launch_agent`` - behind ``elastic_launch`` (the
local launcher) and torchrun's ``run`` (``python -m hetpipe.launch``) - builds
its agent from that module's ``LocalElasticAgent`` name; :func:`agent_run`
points the name at :class:`HetpipeAgent` for one launch, so rendezvous,
restarts, signal forwarding and shutdown stay torch's (and its rendezvous
registry at :class:`hetpipe.launch.store_bind.BoundStores`, so that the
launcher's stores listen on the job's addresses only). What the subclass adds:

* **Who died first, and how.** A thread asks the kernel every 20 ms, without
  reaping (``waitid`` with ``WNOWAIT``), whether a worker ended, so the first
  death is known before the agent's own poll (every 0.1-0.2 s) stops the other
  workers with SIGTERM and before their lost connections say anything. A rank
  killed by a signal cannot say why; the agent posts "rank 1 (pid ...) was
  killed by SIGKILL" (with "probably by the kernel's out-of-memory killer" when
  its cgroup's OOM count rose, :mod:`hetpipe.launch.exit_cause`) as the job's verdict
  (:mod:`hetpipe.launch.job_watch`), which every other node prints once
  instead of the connection it lost (those wait ``job_watch._GRACE_S`` for a
  better cause), and prints it itself. A rank that exited 1, 2, 3 or 4 printed
  its own line; the launcher adds none and exits with that status.
* **A frozen rank is named.** While a rank is stopped (SIGSTOP, a debugger) the
  watch keeps a note of it in the job's store; a neighbour whose wait times out
  reads it and stops the job with "rank 1 (pid ...) stopped responding"
  (:mod:`hetpipe.launch.frozen_ranks`) instead of its own timeout.
* **A rank that hangs** while its attempt fails - stopped, or deaf to
  SIGTERM - is SIGKILLed (a stopped one at once, another after
  :data:`_HANG_GRACE_S`) instead of after torch's 30 s
  (:mod:`hetpipe.launch.hung_ranks`), and left out of the cause.
* **Restarts** (``max_restarts``: torch's): one line each, naming the cause;
  none after a rank ran out of device memory (status 4), which would recur.
* **Each attempt's environment**, set before its ranks start:
  ``HETPIPE_ATTEMPT``, the rendezvous round since the first - equal on every
  node, which ``TORCHELASTIC_RESTART_COUNT`` is not (an agent that restarts
  because another node's ranks failed does not count it) - under which the
  ranks namespace their store keys (torch's agent keeps one store server for
  every attempt - torch 2.13's "new TCPStore for every retry" is a new client
  of it: a key written in attempt 0 was still there in attempt 1, at the same
  port);
  and ``HETPIPE_PREEMPT_DIR``, a fresh directory where each rank that saved
  a checkpoint on a preemption signal leaves ``rank<R>.json``. Forked ranks
  (the local launcher's, and a torchrun node's ``hetpipe.pretrain``) come from a
  server started before any attempt and see neither variable: the directory
  is ``$HETPIPE_LAUNCH_DIR/attempt<N>``, and the attempt is torch's restart
  count on one node, an argument of :func:`hetpipe.launch.fork_server.node_rank`
  on a torchrun node (hetpipe.launch.fork_server).
* **Preemption.** On SIGTERM (and SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2:
  :data:`HANDLED_SIGNALS`, SIGUSR1 and SIGUSR2 added to torch's default list,
  whose default action would kill the launcher and orphan its ranks) torch's
  agent forwards the signal to its ranks and waits up to its shutdown timeout
  (30 s: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, torchrun's ``--shutdown-timeout``)
  before SIGKILL. The launcher then exits 0 if every local rank left its
  marker, else says it was stopped before the ranks saved, with status
  128 + the signal's number.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, NamedTuple, NoReturn, Optional, TypeVar

import torch.distributed as dist
import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from hetpipe.observe import console_log
from hetpipe.errors import (EXIT_BAD_INPUT, EXIT_CRASH, EXIT_LOST_PEER, EXIT_OUT_OF_MEMORY, HetpipeError, error_line,
                            fail)
from hetpipe.launch.departure import leave_in_order
from hetpipe.launch.dir_lock import release_all as release_dir_locks
from hetpipe.launch.exit_cause import Ending, OomCounters, ending_from_exitcode, ending_of
from hetpipe.launch.fd_limit import ensure_fd_limit, launcher_need
from hetpipe.launch.frozen_ranks import FrozenNotes
from hetpipe.launch.hung_ranks import HungRanks
from hetpipe.launch.job_watch import namespace, post_verdict, posted_verdict
from hetpipe.launch.fork_server import fork_node_ranks, stop_fork_server
from hetpipe.launch.preemption import LAUNCH_DIR_ENV, PREEMPT_DIR_ENV
from hetpipe.process.rank_env import ATTEMPT_ENV
from hetpipe.launch.store_bind import BoundStores
from hetpipe.launch.verdicts import job_seal
from hetpipe.process.torch_compat import AgentHooks, agent_can_set_shutdown_timeout, rendezvous_round

T = TypeVar("T")

# torch's default (SIGTERM,SIGINT,SIGHUP,SIGQUIT) plus the other signals
# train.preemption_signals accepts.
HANDLED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
_FORWARDED = {getattr(signal, name) for name in HANDLED_SIGNALS.split(",")}
# The watch's poll of its workers: 50 waitid calls a second per worker, nothing
# beside a rank's work, and 5-10x finer than the agent's own poll (0.1-0.2 s),
# so that the first death is seen alone. Measured on two busy cores, 20
# SIGKILLs: the verdict was in the store 5 ms after the kill (median; 10 ms at
# most), far inside the 2 s its neighbours wait for one (job_watch._GRACE_S).
_POLL_S = 0.02
# Every this many polls (a quarter of a second, as ranks poll the store) the
# watch reads its ranks' states for a stopped one (hetpipe.launch.frozen_ranks).
_FROZEN_EVERY = 12
# A worker that died of a signal the launcher also handles may have got it
# together with the launcher (Slurm signals every process of a step, a
# terminal's Ctrl-C the whole process group): that is a stop, not a crash,
# once the launcher's own handler has run - which takes it milliseconds.
_SETTLE_S = 0.5
# Connecting to the job's store (node 0's agent hosts it): a store that does
# not answer within this is gone, and the cause is printed without posting it.
_STORE_TIMEOUT_S = 5.0
# Once an attempt is failing, how long its ranks may take to leave before
# SIGKILL (a stopped one gets it at once; hetpipe.launch.hung_ranks). A rank
# that still runs then may be waiting up to 2 s for a better cause than its
# own and lingering 1 s after its line (job_watch._GRACE_S, _LINGER_S): 2 s
# more for a busy machine. A frozen rank's job (deadline 8 s, two busy cores)
# ended 13 s after the freeze instead of 42 s (tests/test_launcher_restart.py).
_HANG_GRACE_S = 5.0
# Statuses a rank exits with after printing its own line (job_watch.stop_rank).
_SAID_WHY = (EXIT_CRASH, EXIT_BAD_INPUT, EXIT_LOST_PEER, EXIT_OUT_OF_MEMORY)
# Failures a restart would meet again: a device out of memory runs out at the
# same step of the same plan (hetpipe.training.memory_fit).
_RECURRING = (EXIT_OUT_OF_MEMORY,)


class Cause(NamedTuple):
    """Why an attempt failed, the status it ends the launcher with, and whether a line said it already."""
    reason: str
    code: int
    printed: bool = False


class HetpipeAgent(AgentHooks):
    """torch's local elastic agent, reporting the job's root cause (see the module)."""

    def __init__(self, *args: Any, node: str = "", **kwargs: Any) -> None:
        self.rank_argv = fork_node_ranks(kwargs)
        super().__init__(*args, **kwargs)
        ensure_fd_limit(launcher_need(self.worker_group.spec.local_world_size))  # torchrun's launcher too
        self.node = node  # "node 1 of 2: " under torchrun on several nodes, else ""
        self.attempt = 0
        self.first_round: Optional[int] = None
        # Forked ranks (the local launcher's, and a torchrun node's hetpipe.pretrain)
        # come from a server whose environment was set before any attempt: they find
        # the directory it made through it (hetpipe.launch.fork_server.start_fork_server).
        self.forked = bool(os.environ.get(LAUNCH_DIR_ENV))
        self.launch_dir = Path(os.environ.get(LAUNCH_DIR_ENV) or tempfile.mkdtemp(prefix="hetpipe-launch-"))
        self.watch: Optional[_WorkerWatch] = None
        self.hung: Optional[HungRanks] = None
        self.failed: Optional[RunResult] = None

    @property
    def preempt_dir(self) -> Path:
        return self.launch_dir / f"attempt{self.attempt}"

    # -- the hooks of torch's agent (hetpipe.process.torch_compat.AgentHooks) ----------------------
    def after_rendezvous(self, worker_group: WorkerGroup) -> None:
        round_ = rendezvous_round(worker_group.spec.rdzv_handler)
        if round_ is None:  # another handler than c10d's: count attempts by this agent's restarts
            self.attempt = worker_group.spec.max_restarts - self.remaining_restarts
        else:
            if self.first_round is None:
                self.first_round = round_
            self.attempt = round_ - self.first_round

    def worker_env(self) -> dict[str, str]:
        self.preempt_dir.mkdir(exist_ok=True)
        if self.rank_argv is not None:  # a torchrun node's forked ranks: their attempt is an argument
            self.worker_group.spec.args = (str(self.attempt), *self.rank_argv)
        if self.forked:  # nothing reaches a forked rank from here (the local launcher's: torch's restart count)
            return {}
        return {ATTEMPT_ENV: str(self.attempt), PREEMPT_DIR_ENV: str(self.preempt_dir)}

    def after_start(self, worker_group: WorkerGroup, pids: dict[int, Any]) -> None:
        ranks = {pid: worker_group.workers[local].global_rank for local, pid in pids.items()}
        self.watch = _WorkerWatch(self, ranks, worker_group.master_addr, worker_group.master_port, self.attempt)
        self.watch.start()
        if self.hung is not None:
            self.hung.close()
        self.hung = HungRanks(list(pids.values()), self.watch.attempt_failing, _HANG_GRACE_S, self.attempt)
        self.hung.start()

    def after_monitor(self, worker_group: WorkerGroup, result: RunResult) -> None:
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self.failed = result
            if self.watch is not None:
                # The agent may have reaped the first rank to die before the
                # watch's next poll, on a busy machine: its cause is posted from here.
                self.watch.settle(self.not_killed_here(result.failures))
            if any(f.exitcode in _RECURRING for f in result.failures.values()):
                self.stop_restarting()

    def before_restart(self, worker_group: WorkerGroup) -> None:
        spec = worker_group.spec
        if self.failed is not None:
            cause = self.cause(self.failed).reason
            restart = spec.max_restarts - self.remaining_restarts
            # The cause names its node already (it may be another node's).
            _say(f"hetpipe: {cause}; restarting the job (restart {restart} of {spec.max_restarts})")
        else:  # torch restarts a healthy node when another node's agent rejoins the rendezvous
            _say(f"hetpipe: {self.node}another node is restarting the job; restarting this node's ranks with it")
        self.failed = None

    def before_shutdown(self) -> None:
        self.end_watch()  # the ranks this ends are no news

    # -- the end of a launch -------------------------------------------------------
    def report_failure(self, exc: ChildFailedError) -> NoReturn:
        """The job failed and no restart is left: the cause's line unless printed, and its status."""
        cause = self.cause(self.failed or RunResult(state=WorkerState.FAILED, failures=exc.failures))
        if not cause.printed:
            error_line(cause.reason)
        raise SystemExit(cause.code)

    def report_signal(self, sig: signal.Signals) -> NoReturn:
        """The launcher got ``sig`` and torch's agent stopped the ranks: 0 if every local
        rank saved on it (its preemption marker), else ``128 + sig``."""
        ranks = sorted(w.global_rank for w in self.worker_group.workers)
        markers = [self.preempt_dir / f"rank{r}.json" for r in ranks] if self.watch is not None else []
        missing = [r for r, marker in zip(ranks, markers) if not marker.is_file()]
        if markers and not missing:
            if 0 not in ranks:  # rank 0 says it for the job; another node says it for its own ranks
                saved = json.loads(markers[0].read_text())
                _say(f"hetpipe: {self.node}preempted by {sig.name}: ranks {', '.join(map(str, ranks))} saved "
                     f"step {saved.get('step')} (checkpoint {saved.get('checkpoint')}); exiting 0")
            raise SystemExit(0)
        which = f" (no checkpoint marker from rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))})" \
            if missing else ""
        error_line(f"{self.node}stopped by {sig.name} before the ranks saved{which}")
        raise SystemExit(128 + sig.value)

    def close(self) -> None:
        self.end_watch()
        if self.hung is not None:
            self.hung.close()
        if not self.forked:  # the local launcher's outlives this launch (hetpipe.launch.local)
            shutil.rmtree(self.launch_dir, ignore_errors=True)

    # -- the cause -------------------------------------------------------------------
    def cause(self, result: RunResult) -> Cause:
        """The failed attempt's cause, its exit status, and whether a line already said it."""
        watch = self.watch
        standing = None if watch is None else watch.verdict or watch.read_verdict()
        return root_cause(standing, _first_failure(self.not_killed_here(result.failures)), self.node,
                          result.state.name)

    def not_killed_here(self, failures: dict[int, Any]) -> dict[int, Any]:
        """``failures`` (global rank -> torch's ProcessFailure) less the ranks this agent
        killed for hanging: their deaths followed from the cause."""
        killed = set() if self.hung is None else self.hung.killed
        return {rank: f for rank, f in failures.items() if f.pid not in killed}

    def end_watch(self) -> None:
        if self.watch is not None:
            self.watch.stop()

    def leave_in_order(self, hosting: bool) -> None:
        """Before a launcher whose job failed or was signalled exits, its ranks gone: its mark in
        the job's store, and if it hosts a store, the other nodes' (hetpipe.launch.departure)."""
        nodes = self.worker_group.group_world_size or 1
        if self.watch is not None and self.watch.store is not None and nodes > 1:
            leave_in_order(self.watch.store, self.watch.where, nodes, hosting)


class _WorkerWatch(threading.Thread):
    """Polls one attempt's workers; on the first failed one that could not say why itself,
    posts and (when no restart follows) prints its cause."""

    def __init__(self, agent: HetpipeAgent, ranks: dict[int, int], host: str, port: int, attempt: int) -> None:
        super().__init__(daemon=True, name=f"hetpipe-agent-watch-{attempt}")
        self._agent = agent
        self._ranks = ranks  # pid -> global rank
        self._address = (host, port)
        self._attempt = attempt
        self._oom = {pid: OomCounters(pid) for pid in ranks}
        self._stopped = threading.Event()
        self._store: Optional[dist.Store] = None
        self._frozen: Optional[FrozenNotes] = None
        self._alive_at = time.time()  # every worker not seen ended since was alive then
        self._handled = False
        self.verdict: Optional[Cause] = None  # the first failure's, when it was handled here

    @property
    def store(self) -> Optional[dist.Store]:
        """The attempt's namespace of the store the agent shares with the ranks (None if it did not answer)."""
        return self._store

    @property
    def where(self) -> str:
        return f"{self._address[0]}:{self._address[1]}"

    def stop(self) -> None:
        """Stop watching; a failure being handled is handled to the end (its post, its line)."""
        self._stopped.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(_STORE_TIMEOUT_S + 1.0)

    def settle(self, failures: dict[int, Any]) -> None:
        """The agent found the attempt failed (``failures``: global rank -> torch's
        ProcessFailure): stop polling, and handle the first failure unless the poll did."""
        self.stop()
        if not self._handled:
            first = _first_failure(failures)
            if first is not None:
                self._handle(first)

    def run(self) -> None:
        self._connect()
        polls = 0
        while True:
            swept_at = time.time()
            polls += 1
            if polls % _FROZEN_EVERY == 0:
                self._note_frozen()
            ended = [e for e in (ending_of(pid, rank) for pid, rank in self._ranks.items()) if e is not None]
            failed = sorted((e for e in ended if e.failed), key=lambda e: e.signal in _FORWARDED)
            if failed:
                first = failed[0]
                if first.signal in _FORWARDED and self._stopped.wait(_SETTLE_S):
                    return  # the launcher was signalled too: torch's agent is stopping the ranks
                self._handle(first)
                return
            self._alive_at = swept_at
            if self._stopped.wait(_POLL_S):
                return

    def _note_frozen(self) -> None:
        """Keep the store's notes of stopped ranks current; a store that fails ends the notes
        (the deaths it would post are said here anyway)."""
        if self._frozen is None:
            return
        try:
            self._frozen.sweep()
        except Exception:  # noqa: BLE001 - the store's host is gone: nobody would read them
            self._frozen = None

    def _handle(self, first: Ending) -> None:
        self._handled = True
        if first.signal is None and first.status in _SAID_WHY:
            return  # the rank printed its own line (job_watch.stop_rank)
        oom = self._oom[first.pid].evidence() if first.pid in self._oom else None
        reason = f"{self._agent.node}{_unexplained(first, oom)}"
        standing, posted_at = None, 0.0
        if self._store is not None:
            try:
                standing, posted_at = post_verdict(self._store, first.rank, reason, EXIT_CRASH, attempt=self._attempt)
            except Exception:  # noqa: BLE001 - the store's host is gone: say it here only
                standing = None
        if standing is not None and standing.reason != reason and posted_at < self._alive_at:
            # A cause was posted while this rank still lived (and the ranks print it):
            # its death followed from it. One posted since may be a lost connection
            # to it (a transport that does not wait for a better cause): this is the cause.
            self.verdict = Cause(standing.reason, standing.code, printed=True)
            return
        last_attempt = self._agent.remaining_restarts == 0
        if last_attempt:
            error_line(reason)  # first: the other ranks print it after their wait for a cause
        self.verdict = Cause(reason, EXIT_CRASH, printed=last_attempt)

    def attempt_failing(self) -> bool:
        """Whether a rank of this attempt failed: seen here, or a verdict posted in the store."""
        return self._handled or self.read_verdict() is not None

    def read_verdict(self) -> Optional[Cause]:
        """The verdict the ranks of this attempt posted (and printed), if the store answers."""
        if self._store is None:
            return None
        try:
            verdict = posted_verdict(self._store, attempt=self._attempt)
        except Exception:  # noqa: BLE001
            return None
        return None if verdict is None else Cause(verdict.reason, verdict.code, printed=True)

    def _connect(self) -> None:
        try:
            client = dist.TCPStore(self._address[0], self._address[1], is_master=False,
                                   timeout=timedelta(seconds=_STORE_TIMEOUT_S))
            self._store = dist.PrefixStore(namespace(self._attempt), client)
            self._frozen = FrozenNotes(self._store, job_seal(self._attempt), self._ranks, self._agent.node)
        except Exception:  # noqa: BLE001 - the causes are printed here, not posted
            self._store = None


def _first_failure(failures: dict[int, Any]) -> Optional[Ending]:
    """The failure torch's agent recorded that is likeliest the first: a rank killed by a
    signal the agent does not send itself, else the earliest (``failures``: global rank ->
    ProcessFailure; whole seconds, and for spawned ranks only the one it noticed first)."""
    ordered = sorted(failures.items(), key=lambda item: item[1].timestamp)
    if not ordered:
        return None
    rank, failure = next(((r, f) for r, f in ordered if f.exitcode < 0 and -f.exitcode not in _FORWARDED),
                         ordered[0])
    return ending_from_exitcode(rank, failure.pid, failure.exitcode)


def root_cause(standing: Optional[Cause], ending: Optional[Ending], node: str = "",
               state: str = "FAILED") -> Cause:
    """The attempt's cause from the verdict that stands (posted by a rank or this
    agent's watch, and printed) and the first failure torch's agent recorded.

    A lost connection (status 3) is a consequence: when a rank was killed by a
    signal the agent does not send, that death is the cause even if the lost
    connection was posted first. The watch normally posts the death within
    milliseconds, long before a peer's 2 s wait for a cause ends; once in six
    fresh-clone suite runs on two busy cores it did not, and the restart line
    named the connection instead of the SIGKILL (tests/test_launcher_restart.py).
    """
    killed = ending is not None and ending.signal is not None and ending.signal not in _FORWARDED
    if standing is not None and not (killed and standing.code == EXIT_LOST_PEER):
        return standing
    if ending is None:
        return Cause(f"{node}the ranks stopped in state {state}", EXIT_CRASH)
    if ending.signal is None and ending.status in _SAID_WHY:
        return Cause(f"{node}{ending.describe()}", ending.status, printed=True)
    return Cause(f"{node}{_unexplained(ending)}", EXIT_CRASH)


def _unexplained(ending: Ending, oom: Optional[str] = None) -> str:
    """A death its rank could not explain: a signal, or a status no hetpipe line goes with."""
    if ending.signal is not None:
        return ending.describe(oom)
    return f"{ending.describe()} without saying why (see its output above)"


def _say(line: str) -> None:
    """One launcher line on stderr in one write, so that ranks' lines never run into it."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (line + "\n").encode())


def agent_run(start: Callable[[], T], node: str = "") -> T:
    """Run ``start()`` - a call of torch's ``elastic_launch(...)(...)`` or torchrun's ``run``
    - with :class:`HetpipeAgent` as its agent; a failure or a signal ends this process with
    hetpipe's lines and status (see the module)."""
    agents: list[HetpipeAgent] = []

    def build(*args: Any, **kwargs: Any) -> HetpipeAgent:
        agent = HetpipeAgent(*args, node=node, **kwargs)
        agents.append(agent)
        return agent

    agent_can_set_shutdown_timeout()  # one line where this torch ignores the timeout asked for
    original, registry = launcher_api.LocalElasticAgent, launcher_api.rdzv_registry
    stores = BoundStores(registry)  # the stores listen on the job's addresses
    launcher_api.LocalElasticAgent = build  # type: ignore[misc,assignment]
    launcher_api.rdzv_registry = stores  # type: ignore[assignment]
    try:
        return start()
    except HetpipeError as exc:  # bad input met before any rank started (the open-file limit)
        fail(str(exc), exc.exit_status)
    except ChildFailedError as exc:
        try:
            agents[-1].report_failure(exc)
        except SystemExit as stop:
            _leave(agents, int(stop.code or 0), stores.hosting)
    except SignalException as exc:
        if not agents:
            error_line(f"{node}stopped by {exc.sigval.name} before the ranks started")
            raise SystemExit(128 + exc.sigval.value) from None
        try:
            agents[-1].report_signal(exc.sigval)
        except SystemExit as stop:
            _leave(agents, int(stop.code or 0), stores.hosting)
    finally:
        launcher_api.LocalElasticAgent, launcher_api.rdzv_registry = original, registry  # type: ignore[misc]
        for agent in agents:
            agent.close()


def _leave(agents: list[HetpipeAgent], status: int, hosting: bool) -> NoReturn:
    """End a launcher stopped by a signal, or whose job failed, now, its ranks gone and
    its lines written, without the interpreter's shutdown: torch's store and rendezvous
    threads may be inside C++ calls then, and one such exit aborted the launcher after
    every rank had saved ("terminate called without an active exception", status -6;
    once in a fresh-clone suite run); after a frozen rank's line the shutdown alone took
    seconds on a loaded machine, past the deadline + 5 s a failed job ends within
    (README, "When a node, NIC or link fails"; tests/test_launcher_restart.py).
    A launcher that hosts the job's stores (``hosting``) leaves after the other nodes
    (hetpipe.launch.departure)."""
    for agent in agents:
        agent.close()
        if agent.forked:  # what the local launcher's atexit hooks would do: its directory, its fork server
            shutil.rmtree(agent.launch_dir, ignore_errors=True)
            stop_fork_server()
    if agents:
        agents[-1].leave_in_order(hosting)
    release_dir_locks()  # what its atexit hook would do: a failed job leaves no lock file behind
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    console_log.drain()  # the job's last lines written (pretrain.log) before the prompt comes back
    os._exit(status)


def quiet_torch_launcher() -> None:
    """The elastic agent logs state changes, signals and a failed rank's traceback,
    and torch.multiprocessing a warning for each rank it stops; a failure is
    reported in one line instead (by this agent, and by the ranks themselves).
    torch's elastic modules set a level on each of their own loggers, so each is
    quietened, not just their parent (they exist: this module imported
    torch.distributed.launcher.api, which creates them)."""
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing.spawn", "torch.distributed.launcher")
    names = [n for n in list(logging.Logger.manager.loggerDict) if n.startswith(prefixes)]
    for name in {*prefixes, *names}:
        logging.getLogger(name).setLevel(logging.CRITICAL)

