"""How the ranks of a save meet: which directory each writes into, what each
holds, each rank's part of the manifest and each directory's commit.

Saves are written by a background thread on every rank while the main
threads train, so they never use the job's process groups (a collective of
the writer would interleave with the step's collectives). :class:`StoreBoard`
goes through the job's TCPStore instead, with a client of its own (as
:mod:`hetpipe.launch.job_watch` does), under keys namespaced by the restart attempt
(:func:`hetpipe.process.rank_env.restart_attempt`, the same on every node) and by step, so a restarted job never reads
what an earlier attempt posted. Values are small JSON documents.

Which ranks share a directory is found once, at the first save: every rank
creates a probe file in its ``save_dir`` and reports which ranks' probes it
sees. With a shared filesystem that is every rank (one directory, one
committer); with node-local disks it is each node's ranks, and each node's
lowest rank commits the same manifest into its own directory.

:class:`LocalBoard` serves a one-rank job; :class:`FileBoard` the
synchronous :func:`~hetpipe.checkpoint.sync_save.save_checkpoint`, whose ranks
(possibly played one after another in one process) share a directory and
pass their parts as files between two barriers.
"""
from __future__ import annotations

import json
import secrets
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

from hetpipe.checkpoint.errors import CheckpointError
from hetpipe.checkpoint.layout import part_file
from hetpipe.process.rank_env import restart_attempt

# How long a rank waits for the others' parts and commits: longer than any
# write of a rank's share we expect (at 1 GB/s, 30 min is 1.8 TB); a rank
# that died makes its launcher stop the job long before that.
WAIT_S = 1800.0
_POLL_S = 0.05
_boards = 0  # StoreBoards made in this process: the same count on every rank


class Abandoned(Exception):
    """The board was closed while a save waited on it (the job is ending for another reason)."""


class Board:
    """The interface; one rank's view."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.stopped = threading.Event()
        self.committers: list[int] = [0]

    def directory(self, save_dir: Path) -> list[int]:
        """The ranks that write into the same directory as this one (this rank included), sorted."""
        self.committers = [0]
        return list(range(self.world))

    def holdings(self, mine: dict[str, Any]) -> Optional[dict[int, dict[str, Any]]]:
        return {self.rank: mine}

    def post_part(self, step: int, part: dict[str, Any], tmp: Path) -> None:
        raise NotImplementedError

    def parts(self, step: int, tmp: Path) -> list[dict[str, Any]]:
        raise NotImplementedError

    def post_outcome(self, step: int, outcome: dict[str, Any]) -> None:
        raise NotImplementedError

    def outcomes(self, step: int) -> dict[int, dict[str, Any]]:
        raise NotImplementedError

    def release(self, step: int) -> None:
        pass

    def close(self) -> None:
        self.stopped.set()


def _check_parts(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    failed = next((p for p in parts if "error" in p), None)
    if failed is not None:
        raise CheckpointError(f"rank {failed['rank']} could not write its files: {failed['error']}")
    return parts


class LocalBoard(Board):
    """One rank: nothing to meet."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self._part: Optional[dict[str, Any]] = None
        self._outcome: dict[str, Any] = {}

    def post_part(self, step: int, part: dict[str, Any], tmp: Path) -> None:
        self._part = part

    def parts(self, step: int, tmp: Path) -> list[dict[str, Any]]:
        return _check_parts([self._part or {}])

    def post_outcome(self, step: int, outcome: dict[str, Any]) -> None:
        self._outcome = outcome

    def outcomes(self, step: int) -> dict[int, dict[str, Any]]:
        return {0: self._outcome}


class FileBoard(Board):
    """Parts as files in the shared temporary directory, between two ``barrier()`` calls; rank 0 commits."""

    def __init__(self, rank: int, world: int, barrier: Callable[[], None]) -> None:
        super().__init__(rank, world)
        self.barrier = barrier
        self._outcome: dict[str, Any] = {}

    def holdings(self, mine: dict[str, Any]) -> Optional[dict[int, dict[str, Any]]]:
        return None  # ranks played in turn cannot wait for each other: each saves all it owns

    def post_part(self, step: int, part: dict[str, Any], tmp: Path) -> None:
        (tmp / part_file(self.rank)).write_text(json.dumps(part))
        self.barrier()

    def parts(self, step: int, tmp: Path) -> list[dict[str, Any]]:
        parts = []
        for r in range(self.world):
            path = tmp / part_file(r)
            if not path.is_file():
                raise CheckpointError(f"rank {r} wrote no {path.name} into {tmp}; the checkpoint is incomplete")
            parts.append(json.loads(path.read_text()))
        return _check_parts(parts)

    def post_outcome(self, step: int, outcome: dict[str, Any]) -> None:
        self._outcome = outcome

    def outcomes(self, step: int) -> dict[int, dict[str, Any]]:
        self.barrier()
        return {0: self._outcome} if self.rank == 0 else {}


class StoreBoard(Board):
    """The job's TCPStore, through a client of this board's own."""

    def __init__(self, store: Any, rank: int, world: int, wait_s: float = WAIT_S, seal: Any = None) -> None:
        """``seal`` (hetpipe.launch.store_seal.Seal, the job secret's) seals every value this board
        posts; a value that is not this job's then fails the save in one line."""
        import torch.distributed as dist

        global _boards
        super().__init__(rank, world)
        self.wait_s = wait_s
        base = store  # the topology's store is the attempt's PrefixStore over the TCPStore client
        while not hasattr(base, "host") and hasattr(base, "underlying_store"):
            base = base.underlying_store
        if hasattr(base, "host") and hasattr(base, "port"):
            store = dist.TCPStore(base.host, base.port, is_master=False, timeout=timedelta(seconds=wait_s))
        self.client = store
        self.seal = seal
        _boards += 1
        self.prefix = f"hetpipe/checkpoint/attempt{restart_attempt()}/board{_boards}/"

    def _key(self, *parts: object) -> str:
        return self.prefix + "/".join(map(str, parts))

    def _set(self, key: str, text: str) -> None:
        self.client.set(key, self.seal.seal_text(key, text) if self.seal else text)

    def _get(self, key: str) -> str:
        raw = self.client.get(key)
        if self.seal is None:
            return raw.decode()
        try:
            return self.seal.open_text(key, raw)
        except ValueError as exc:
            raise CheckpointError(f"the checkpoint board's {key} in the job's store is not this job's: {exc}; "
                                  "a process outside the job wrote it, so this save stops rather than trust it") \
                from None

    def _wait(self, keys: list[str], what: str) -> None:
        until = time.monotonic() + self.wait_s
        while not self.client.check(keys):
            if self.stopped.is_set():
                raise Abandoned(what)
            if time.monotonic() > until:
                absent = [k.rsplit("/", 1)[-1] for k in keys if not self.client.check([k])]
                raise CheckpointError(f"{what}: rank(s) {', '.join(absent)} posted nothing within "
                                      f"{self.wait_s:g} s")
            time.sleep(_POLL_S)

    def _gather(self, name: str, ranks: list[int], what: str) -> dict[int, Any]:
        keys = [self._key(name, r) for r in ranks]
        self._wait(keys, what)
        return {r: json.loads(self._get(k)) for r, k in zip(ranks, keys)}

    def directory(self, save_dir: Path) -> list[int]:
        everyone = list(range(self.world))
        if self.rank == 0:
            self._set(self._key("probe", "nonce"), secrets.token_hex(8))
        self._wait([self._key("probe", "nonce")], "finding which ranks share a checkpoint directory")
        nonce = self._get(self._key("probe", "nonce"))
        probe = save_dir / f".probe-{nonce}-rank{self.rank:05d}"
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
            probe.write_text(f"{self.rank}\n")
        except OSError as exc:
            raise CheckpointError(f"checkpoint directory {save_dir} is not writable: "
                                  f"{exc.strerror or exc}") from None
        self._set(self._key("probe", "written", self.rank), "1")
        self._gather("probe/written", everyone, "finding which ranks share a checkpoint directory")
        # By name rather than by listing: a lookup revalidates on NFS where a cached listing may lag.
        seen = [r for r in everyone if (save_dir / f".probe-{nonce}-rank{r:05d}").exists()]
        self._set(self._key("probe", "seen", self.rank), json.dumps(seen))
        views = self._gather("probe/seen", everyone, "finding which ranks share a checkpoint directory")
        probe.unlink()
        for r, view in views.items():
            if r in seen and view != seen:
                raise CheckpointError(f"ranks {self.rank} and {r} disagree on which ranks share checkpoint directory "
                                      f"{save_dir} ({seen} vs {view}): is the filesystem consistent across nodes?")
        self.committers = sorted({min(view) for view in views.values()})
        return seen

    def holdings(self, mine: dict[str, Any]) -> Optional[dict[int, dict[str, Any]]]:
        self._set(self._key("holdings", self.rank), json.dumps(mine))
        return self._gather("holdings", list(range(self.world)), "exchanging what each rank holds")

    def post_part(self, step: int, part: dict[str, Any], tmp: Path) -> None:
        self._set(self._key(f"step{step}", "part", self.rank), json.dumps(part))

    def parts(self, step: int, tmp: Path) -> list[dict[str, Any]]:
        got = self._gather(f"step{step}/part", list(range(self.world)), f"committing the checkpoint of step {step}")
        return _check_parts([got[r] for r in range(self.world)])

    def post_outcome(self, step: int, outcome: dict[str, Any]) -> None:
        self._set(self._key(f"step{step}", "outcome", self.rank), json.dumps(outcome))

    def outcomes(self, step: int) -> dict[int, dict[str, Any]]:
        return self._gather(f"step{step}/outcome", self.committers, f"waiting for the commit of step {step}")

    def release(self, step: int) -> None:
        # Every committer has read every part once all outcomes are in: the big values can go.
        self.client.delete_key(self._key(f"step{step}", "part", self.rank))
