"""Where checkpoints live in a save directory, and how one becomes visible.

::

    <save_dir>/
      latest                       "iter_0000100": the most recently committed
      iter_0000100/                a complete checkpoint (has manifest.json)
        manifest.json              written last: files, sha256, tensor pieces, self-checksum
        trainer_state.json         step, sampler position, extra trainer state
        model-rank00000.safetensors   the pieces of weights this rank wrote (its TP slices;
                                      none for a DP replica whose twin writes them)
        optim-rank00000.safetensors   optimizer state keyed exp_avg/<name>, ... (ZeRO-1: its ranges)
        rng-rank00000.safetensors     this rank's RNG states
      iter_0000200.tmp/            a save in progress (or one that crashed)

With node-local directories each node's ``save_dir`` holds its own ranks'
files, the same manifest and its own ``trainer_state.json`` and ``latest``
(docs/checkpoints.md). A save writes into ``iter_NNNNNNN.tmp`` and renames it
once the manifest is in; the rename is the commit point, so a crash never
damages a committed checkpoint. The temporary name is derived from the step
rather than drawn at random so that every rank agrees on it without a
message; a leftover from a crashed save at the same step is simply
overwritten (files no manifest lists are removed before the commit).
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

from hetpipe.checkpoint.errors import CheckpointError

# Written last by a save: a directory that has it is a complete checkpoint
# (its contents: hetpipe.checkpoint.manifest).
MANIFEST = "manifest.json"
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
_COMPLETE = re.compile(r"^iter_(\d{7,})$")
_TMP_SUFFIX = ".tmp"


def iter_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


def tmp_dir_name(step: int) -> str:
    return iter_dir_name(step) + _TMP_SUFFIX


def model_file(rank: int) -> str:
    return f"model-rank{rank:05d}.safetensors"


def optim_file(rank: int) -> str:
    return f"optim-rank{rank:05d}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.safetensors"


def part_file(rank: int) -> str:
    """A rank's list of what it wrote; merged into the manifest, then removed."""
    return f"part-rank{rank:05d}.json"


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's contents to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old or the new file, never half."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)


def complete_checkpoints(save_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every committed checkpoint in ``save_dir``, by step."""
    if not save_dir.is_dir():
        return []
    found = []
    for child in save_dir.iterdir():
        match = _COMPLETE.match(child.name)
        if match and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def incomplete_checkpoints(save_dir: Path) -> list[Path]:
    """Interrupted saves: ``iter_*.tmp`` directories, and ``iter_*`` without a manifest."""
    if not save_dir.is_dir():
        return []
    return sorted(child for child in save_dir.iterdir() if child.is_dir() and child.name.startswith("iter_")
                  and not (_COMPLETE.match(child.name) and (child / MANIFEST).is_file()))


def latest_checkpoint(save_dir: Path) -> Optional[Path]:
    """The checkpoint ``latest`` names, else the highest complete step, else None.

    The pointer wins over the highest step because a run restarted from an
    older checkpoint commits new ones below abandoned higher ones.
    """
    pointer = save_dir / LATEST
    if pointer.is_file():
        try:
            name = pointer.read_bytes().decode("ascii").strip()
        except UnicodeDecodeError:
            raise CheckpointError(f"{pointer} holds {pointer.stat().st_size} bytes that are not a checkpoint name "
                                  "(iter_NNNNNNN): remove it to resume from the newest complete checkpoint, or "
                                  "write the name of one") from None
        target = save_dir / name
        if not (_COMPLETE.match(name) and (target / MANIFEST).is_file()):
            raise CheckpointError(f"{pointer} names {name!r}, which is not a complete checkpoint in {save_dir}")
        return target
    complete = complete_checkpoints(save_dir)
    return complete[-1][1] if complete else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from the path of one, or of a save directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.name.endswith(_TMP_SUFFIX):
        raise CheckpointError(f"{path} is an incomplete checkpoint: the save was interrupted before "
                              "it was committed")
    if (path / MANIFEST).is_file():
        return path
    if path.name.startswith("iter_"):
        raise CheckpointError(f"{path} is an incomplete checkpoint: it has no {MANIFEST} "
                              "(the save was interrupted, or the file was removed)")
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise CheckpointError(f"{path} is neither a checkpoint nor a save directory holding a complete one")
    return found


def commit(tmp: Path, save_dir: Path, step: int) -> Path:
    """Make the finished ``tmp`` directory the checkpoint of ``step`` and point ``latest`` at it."""
    final = save_dir / iter_dir_name(step)
    fsync_path(tmp)
    if final.exists():
        # Re-saving a step (a run restarted from an earlier checkpoint): move
        # the old one aside first so the window without iter_N is one rename.
        stale = save_dir / (iter_dir_name(step) + ".replaced")
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale)
    else:
        os.replace(tmp, final)
    fsync_path(save_dir)
    write_text_atomic(save_dir / LATEST, final.name + "\n")
    return final


def prune_incomplete(save_dir: Path, current_step: int) -> list[Path]:
    """Delete leftovers of crashed saves (all but ``current_step``'s). Run by a
    committer before it reports its commit: until then no rank can have
    started its next save, whose temporary directory this must not take."""
    removed = [p for p in incomplete_checkpoints(save_dir) if p.name != tmp_dir_name(current_step)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def prune_complete(save_dir: Path, keep_last: int, current_step: int) -> list[Path]:
    """Delete committed checkpoints older than the newest ``keep_last`` up to
    ``current_step`` (0 keeps all), once every directory has committed it.
    Checkpoints with a higher step, from a timeline this run abandoned, are
    left for the user."""
    removed = []
    if keep_last > 0:
        removed = [p for step, p in complete_checkpoints(save_dir) if step <= current_step][:-keep_last]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
