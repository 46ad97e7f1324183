"""A committer's job: every rank's part into one manifest, checked, then into place.

Each directory's committer (its lowest rank) assembles the same manifest
from all ranks' parts (sorted by rank, so every directory's copy is
byte-identical), refuses to commit one that could not restore the whole
model, writes ``trainer_state.json`` (rank 0's text, identical in every
directory) and the manifest last, and renames ``iter_N.tmp`` into place
(:func:`hetpipe.checkpoint.layout.commit`: the commit point).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Optional, Sequence

from hetpipe.checkpoint.assemble import plan_route
from hetpipe.checkpoint.digest import SELF_CHECKSUM, manifest_digest
from hetpipe.checkpoint.errors import CheckpointError
from hetpipe.checkpoint.layout import MANIFEST, TRAINER_STATE, commit, fsync_path
from hetpipe.checkpoint.manifest import FORMAT, VERSION, WHOLE
from hetpipe.checkpoint.names import whole_model_shapes
from hetpipe.checkpoint.regions import Piece, Region, TensorEntry
from hetpipe.models import ModelConfig
from hetpipe.partitioner.plan_data import Plan


def _check_covered(tensors: dict[str, dict[str, Any]], files: list[dict[str, Any]], model_cfg: ModelConfig,
                   where: Path) -> None:
    names = [f["name"] for f in files]

    def entry(name: str) -> TensorEntry:
        e = tensors[name]
        return TensorEntry(tuple(e["shape"]), e["dtype"],
                           [Piece(names[p["file"]], Region.from_json(p)) for p in e["pieces"]])

    shapes = whole_model_shapes(model_cfg)
    keys = sorted({name.partition("/")[0] for name in tensors if "/" in name})
    for name, shape in shapes.items():
        if name not in tensors:
            raise CheckpointError(f"no rank saved tensor {name}, so {where} would not hold the whole model")
        if tuple(tensors[name]["shape"]) != shape:
            raise CheckpointError(f"tensor {name} was saved with shape {tensors[name]['shape']}, "
                                  f"not the model's {list(shape)}")
        for key in keys:
            if f"{key}/{name}" not in tensors:
                raise CheckpointError(f"no rank saved optimizer state {key}/{name}, so {where} would not hold "
                                      "the whole optimizer state")
        for full in [name] + [f"{key}/{name}" for key in keys]:
            if plan_route(full, entry(full), WHOLE, lambda _: True) is None:
                raise CheckpointError(f"the ranks' pieces of tensor {full} do not cover all of it, so {where} "
                                      "would not hold the whole model")


def assemble_manifest(parts: Sequence[dict[str, Any]], step: int, world_size: int, model_cfg: ModelConfig,
                      plan: Optional[Plan], where: Path) -> dict[str, Any]:
    """The manifest of the checkpoint that ``parts`` (one per rank) describe."""
    parts = sorted(parts, key=lambda p: p["rank"])
    files = [f for part in parts for f in part["files"]]
    text = parts[0].get("trainer_state")
    if parts[0]["rank"] != 0 or text is None:
        raise CheckpointError(f"rank 0 sent no trainer state for {where}")
    data = text.encode()
    files.append({"name": TRAINER_STATE, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)})
    position: dict[str, int] = {}
    for i, f in enumerate(files):
        if f["name"] in position:
            raise CheckpointError(f"two ranks wrote a file named {f['name']} into {where}")
        position[f["name"]] = i
    tensors: dict[str, dict[str, Any]] = {}
    for part in parts:
        for name, e in part["tensors"].items():
            slot = tensors.setdefault(name, {"shape": e["shape"], "dtype": e["dtype"], "pieces": []})
            if (slot["shape"], slot["dtype"]) != (e["shape"], e["dtype"]):
                raise CheckpointError(f"rank {part['rank']} saved tensor {name} as {e['shape']} {e['dtype']}, "
                                      f"another rank as {slot['shape']} {slot['dtype']}")
            slot["pieces"] += [{**p, "file": position[p["file"]]} for p in e["pieces"]]
    _check_covered(tensors, files, model_cfg, where)
    directories: dict[int, list[int]] = {}
    for part in parts:
        directories.setdefault(part["directory"], []).append(part["rank"])
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "model": model_cfg.to_dict(),
        "plan": dataclasses.asdict(plan) if plan is not None else None,
        "world_size": world_size,
        "ranks": [{"rank": p["rank"], "units": p["units"], "node": p.get("node")} for p in parts],
        "directories": [{"committer": c, "ranks": ranks, "node": parts[c].get("node")}
                        for c, ranks in sorted(directories.items())],
        "files": files,
        "tensors": dict(sorted(tensors.items())),
    }
    manifest[SELF_CHECKSUM] = manifest_digest(manifest)
    return manifest


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    fsync_path(path)


def commit_directory(tmp: Path, save_dir: Path, step: int, manifest: dict[str, Any], trainer_state: str,
                     ranks: Sequence[int]) -> Path:
    """Put the files of ``ranks`` (this directory's) with ``manifest`` in place as ``iter_<step>``."""
    mine = {f["name"] for f in manifest["files"] if f.get("rank") in ranks}
    for name in sorted(mine):
        if not (tmp / name).is_file():
            raise CheckpointError(f"{tmp / name} is missing: a rank of this directory reported it written")
    for child in tmp.iterdir():  # part files, and leftovers of a crashed save
        if child.name not in mine:
            child.unlink()
    _write(tmp / TRAINER_STATE, trainer_state)
    _write(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return commit(tmp, save_dir, step)
