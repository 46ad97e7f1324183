"""Saving checkpoints while training goes on: the trainer's one checkpoint object per rank.

``save(step, ...)`` takes a snapshot - this rank's pieces copied to host
memory (:mod:`hetpipe.checkpoint.snapshot`) - and returns; a background
thread then writes the files (safetensors, fsync, sha256), posts this rank's
part of the manifest (:mod:`hetpipe.checkpoint.board`), and, on each
directory's committer, assembles the manifest and commits it
(:mod:`hetpipe.checkpoint.commit`). At most one save is in flight: a new one
first waits for the last. ``wait()`` blocks until the save in flight is
committed in every directory and returns this rank's checkpoint directory;
a save that failed in the background (disk full, no permission, another
rank's failure) is raised there, or at the next ``save()``, as one
:class:`CheckpointError`. ``checkpoint.async_save=false`` does all of it
inside ``save()``.

The trainer makes one with :meth:`CheckpointSaver.for_topology`, calls
``save`` when :func:`~hetpipe.checkpoint.settings.should_save` says so, and
``close()`` in its ``finally`` (which waits for the last save unless an
exception is on its way out, so a finished job's last checkpoint is on disk).
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from hetpipe.process import faults
from hetpipe.checkpoint.board import Abandoned, Board, LocalBoard, StoreBoard
from hetpipe.checkpoint.commit import assemble_manifest, commit_directory
from hetpipe.checkpoint.errors import CheckpointError
from hetpipe.checkpoint.layout import iter_dir_name, prune_complete, prune_incomplete, tmp_dir_name
from hetpipe.checkpoint.settings import CheckpointConfig, resolve_save_dir
from hetpipe.checkpoint.snapshot import HostBuffers, Snapshot, take_snapshot
from hetpipe.checkpoint.writes import Holding, holdings, plan_writes
from hetpipe.checkpoint.st_io import write_safetensors
from hetpipe.models import CausalLM, ModelConfig
from hetpipe.partitioner.plan_data import Plan


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class CheckpointSaver:
    """One rank's checkpoint writer (see the module docstring)."""

    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path, *, model_cfg: ModelConfig, rank: int = 0,
                 world_size: int = 1, plan: Optional[Plan] = None, store: Any = None, node: int = 0,
                 node_label: Optional[str] = None, board: Optional[Board] = None, seal: Any = None) -> None:
        self.cfg, self.model_cfg, self.plan = cfg, model_cfg, plan
        self.rank, self.world_size, self.node = rank, world_size, node
        self.node_label = node_label or f"node {node}"
        self.save_dir = resolve_save_dir(cfg, run_dir, node)
        if board is None:
            if world_size > 1 and store is None:
                raise ValueError("a CheckpointSaver of a job with several ranks needs the job's store")
            board = StoreBoard(store, rank, world_size, seal=seal) if world_size > 1 else LocalBoard()
        self.board = board
        self._directory: Optional[list[int]] = None
        self._everyone: Optional[dict[int, dict[str, Holding]]] = None
        self._held: Optional[dict[str, Holding]] = None
        self._buffers = HostBuffers()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._last: Optional[Path] = None
        # One entry per committed save: step, stall_s (the step's wait in save()),
        # write_s (files, part, commit), bytes (this rank's files).
        self.timings: list[dict[str, float]] = []

    @classmethod
    def for_topology(cls, cfg: CheckpointConfig, run_dir: str | Path, topo: Any, model_cfg: ModelConfig,
                     plan: Optional[Plan]) -> CheckpointSaver:
        """The saver of the rank ``topo`` (a :class:`hetpipe.training.topology.Topology`) describes."""
        nodes, watch = getattr(topo, "nodes", None), getattr(topo, "watch", None)
        return cls(cfg, run_dir, model_cfg=model_cfg, rank=topo.rank, world_size=topo.world_size, plan=plan,
                   store=topo.store, node=nodes.node_of[topo.rank] if nodes else 0,
                   node_label=nodes.label_of(topo.rank) if nodes else None,
                   seal=watch.seal if watch is not None else None)

    # -- the trainer's API ---------------------------------------------------

    def save(self, step: int, chunks: Sequence[CausalLM], optimizer: torch.optim.Optimizer,
             loader_state: Mapping[str, Any], extra_state: Optional[Mapping[str, Any]] = None) -> None:
        """Checkpoint the state after ``step`` optimizer steps; every rank calls it at the same step."""
        waited = time.monotonic()
        self.wait()
        waited = time.monotonic() - waited
        held = holdings(chunks)
        if self._directory is None:
            self._directory = self.board.directory(self.save_dir)
        if self._held != held:
            everyone = self.board.holdings({k: v.to_json() for k, v in held.items()})
            self._everyone = None if everyone is None else {
                int(r): {k: Holding.from_json(v) for k, v in h.items()} for r, h in everyone.items()}
            self._held = held
        writes = plan_writes(self.rank, held, self._everyone, self._directory)
        background = self.cfg.async_save
        snap = take_snapshot(step, self.rank, chunks, optimizer, writes, held,
                             self._buffers if background else None, loader_state, extra_state)
        snap.stall_s += waited
        if not background:
            self._last = self._write(snap)
            return
        self._thread = threading.Thread(target=self._background, args=(snap,), daemon=True,
                                        name=f"hetpipe-checkpoint-{self.rank}")
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        """Whether a save is being written in the background."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def last_timing(self) -> Optional[dict[str, float]]:
        return self.timings[-1] if self.timings else None

    def wait(self) -> Optional[Path]:
        """Block until the save in flight is committed; its directory (or the last one's). Raises its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._last

    def close(self, wait: Optional[bool] = None) -> None:
        """Finish: wait for the save in flight (default: unless an exception is propagating, as in a
        ``finally`` block after a failure, when it is abandoned), then let go of the store."""
        if wait is None:
            wait = sys.exc_info()[0] is None
        try:
            if wait:
                self.wait()
        finally:
            self.board.close()
            if self._thread is not None:
                self._thread.join(1.0)

    # -- the write -----------------------------------------------------------

    def _background(self, snap: Snapshot) -> None:
        try:
            self._last = self._write(snap)
        except Abandoned:
            pass
        except BaseException as exc:  # noqa: BLE001 - surfaced on the main thread by wait()
            self._error = exc

    def _write(self, snap: Snapshot) -> Path:
        step, rank, board = snap.step, self.rank, self.board
        tmp = self.save_dir / tmp_dir_name(step)
        written = time.monotonic()
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            records = []
            for i, (name, tensors) in enumerate(snap.files.items()):
                record = write_safetensors(tmp / name, tensors, snap.metadata.get(name))
                records.append({**record, "rank": rank, "node": self.node_label})
                if i == 0:
                    faults.hit("save", rank, step)
            directory = min(self._directory or [rank])
            board.post_part(step, {"rank": rank, "node": self.node_label, "directory": directory,
                                   "units": snap.units, "files": records, "tensors": snap.index,
                                   "trainer_state": snap.trainer_state}, tmp)
        except Abandoned:
            raise
        except Exception as exc:
            message = f"checkpoint of step {step} could not be written to {tmp}: {_one_line(exc)}"
            try:
                board.post_part(step, {"rank": rank, "error": message}, tmp)
            except Exception:  # noqa: BLE001 - the store may be what failed; our own error says why
                pass
            raise CheckpointError(message) from None
        committer = self._directory is None or rank == min(self._directory)
        removed: list[Path] = []
        if committer:
            try:
                parts = board.parts(step, tmp)
                manifest = assemble_manifest(parts, step, self.world_size, self.model_cfg, self.plan, tmp)
                final = commit_directory(tmp, self.save_dir, step, manifest, parts[0]["trainer_state"],
                                         self._directory or [rank])
                removed = prune_incomplete(self.save_dir, step)
                board.post_outcome(step, {"path": str(final)})
            except Abandoned:
                raise
            except Exception as exc:
                message = exc.args[0] if isinstance(exc, CheckpointError) else _one_line(exc)
                board.post_outcome(step, {"error": f"{self.node_label} (rank {rank}): {message}"})
        outcomes = board.outcomes(step)
        failed = next((o["error"] for o in outcomes.values() if "error" in o), None)
        if failed is not None:
            raise CheckpointError(f"the checkpoint of step {step} was not committed: {failed}")
        final = self.save_dir / iter_dir_name(step)
        if committer:  # older checkpoints go once every directory holds this one
            removed += prune_complete(self.save_dir, self.cfg.keep_last, step)
        board.release(step)
        took = time.monotonic() - written
        self.timings.append({"step": step, "stall_s": snap.stall_s, "write_s": took,
                             "bytes": sum(r["size"] for r in records)})
        if rank == 0:
            size = sum(f["size"] for f in manifest["files"])
            note = f", removed {', '.join(p.name for p in removed)}" if removed else ""
            how = (f"the step waited {snap.stall_s:.2f} s for the snapshot, the background write took {took:.1f} s"
                   if self.cfg.async_save else f"{time.monotonic() - snap.started:.1f} s, synchronous")
            print(f"hetpipe: saved checkpoint {final} ({size / 2**20:.1f} MiB; {how}{note})", flush=True)
        return final
