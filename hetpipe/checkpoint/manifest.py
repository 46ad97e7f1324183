"""The manifest of a checkpoint, and reading files only after they are verified.

``manifest.json`` is written last, once every rank's files are on disk, and
lists every file (sha256, size, the rank and node that wrote it) plus an
index from tensor name to the pieces that make it up (a rank saves only what
it holds: its TP slice, its ZeRO range; see :mod:`hetpipe.checkpoint.regions`).
It is the single thing a reader trusts: a directory without one is an
interrupted save, a listed file that is missing, short or altered is refused
by name, every field it states is checked against the checksummed state it
describes (:mod:`hetpipe.checkpoint.consistency`), and it carries a sha256 of
itself. No tensor is read from a file whose checksum was not checked.
Everything is safetensors or JSON; nothing is ever unpickled.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch

from hetpipe.checkpoint.assemble import Readers, Route, plan_route, read_route
from hetpipe.checkpoint.consistency import check_manifest
from hetpipe.checkpoint.digest import SELF_CHECKSUM, file_record, manifest_digest, sha256_file
from hetpipe.checkpoint.errors import CheckpointError
from hetpipe.checkpoint.layout import MANIFEST
from hetpipe.checkpoint.regions import Piece, Region, TensorEntry
from hetpipe.checkpoint.st_io import SafetensorsReader

FORMAT = "hetpipe-checkpoint"
VERSION = 2
# Version 1 (whole tensors, one file each, no self-checksum) is still read.
READABLE = (1, 2)
WHOLE = Region()

# The format's names, some defined where they are used first (digest, layout), all readable from here.
__all__ = ["MANIFEST", "FORMAT", "VERSION", "SELF_CHECKSUM", "Checkpoint", "CheckpointError", "file_record",
           "manifest_digest", "sha256_file"]


def _tensor_entries(manifest: dict[str, Any], where: Path) -> dict[str, TensorEntry]:
    names = [f["name"] for f in manifest["files"]]
    out = {}
    name = "?"
    try:
        for name, e in manifest["tensors"].items():
            if manifest["version"] == 1:
                pieces = [Piece(names[e["file"]], WHOLE)]
            else:
                pieces = [Piece(names[p["file"]], Region.from_json(p)) for p in e["pieces"]]
            out[name] = TensorEntry(tuple(int(x) for x in e["shape"]), str(e["dtype"]), pieces)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        raise CheckpointError(f"{where} has a malformed entry for tensor {name} in its tensor index") from None
    for name, entry in out.items():
        for piece in entry.pieces:
            problem = piece.region.check(entry.shape)
            if problem:
                raise CheckpointError(f"{where}: a piece of tensor {name} {entry.shape} has {problem}")
    return out


class Checkpoint:
    """A complete checkpoint directory opened for reading (and checked: see consistency.py)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.manifest_path = path / MANIFEST
        if not self.manifest_path.is_file():
            raise CheckpointError(f"{path} is an incomplete checkpoint: it has no {MANIFEST} "
                                  "(the save was interrupted, or the file was removed)")
        try:
            manifest = json.loads(self.manifest_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{self.manifest_path} is unreadable: {exc}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"{self.manifest_path} is not a hetpipe checkpoint manifest")
        if manifest.get("version") not in READABLE:
            raise CheckpointError(f"{self.manifest_path} has format version {manifest.get('version')}; "
                                  f"this hetpipe reads versions {', '.join(map(str, READABLE))}")
        missing = {"step", "model", "world_size", "ranks", "files", "tensors"} - set(manifest)
        if missing:
            raise CheckpointError(f"{self.manifest_path} lacks {', '.join(sorted(missing))}")
        self.manifest = manifest
        try:
            self.files: dict[str, dict[str, Any]] = {f["name"]: f for f in manifest["files"]}
        except (KeyError, TypeError):
            raise CheckpointError(f"{self.manifest_path} has a malformed files list") from None
        self.entries = _tensor_entries(manifest, self.manifest_path)
        # Name -> {"shape", "dtype"} of the whole tensor (what export and the fit checks read).
        self.tensors: dict[str, dict[str, Any]] = {
            name: {"shape": list(e.shape), "dtype": e.dtype} for name, e in self.entries.items()}
        self._verified: set[str] = set()
        check_manifest(self)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def model(self) -> dict[str, Any]:
        """The model config the checkpoint was written for (a ModelConfig dict)."""
        return self.manifest["model"]

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    def rank_entry(self, rank: int) -> Optional[dict[str, Any]]:
        return next((e for e in self.manifest["ranks"] if e.get("rank") == rank), None)

    def units_of(self, rank: int) -> Optional[list[list[int]]]:
        """The [start, stop) unit ranges ``rank`` held when saving, or None."""
        entry = self.rank_entry(rank)
        return None if entry is None else [list(r) for r in entry["units"]]

    def has_file(self, name: str) -> bool:
        return name in self.files

    def _missing(self, name: str) -> CheckpointError:
        record = self.files[name]
        writer = record.get("rank")
        # Another file of the same rank here, or one directory for all ranks:
        # this directory should have held it.
        here = any(f.get("rank") == writer and other != name and (self.path / other).is_file()
                   for other, f in self.files.items())
        if writer is None or here or len(self.manifest.get("directories", ())) <= 1:
            return CheckpointError(f"checkpoint file {self.path / name} is missing")
        node = record.get("node") or f"the node of rank {writer}"
        return CheckpointError(f"checkpoint file {self.path / name} is missing: rank {writer} on {node} wrote it, "
                               f"and this directory holds only its own node's files; to resume under another "
                               f"plan or export, copy every node's {self.path.name} into one directory "
                               "(docs/checkpoints.md)")

    def verified_path(self, name: str) -> Path:
        """The path of a listed file, after checking its size and sha256."""
        path = self.path / name
        if name in self._verified:
            return path
        record = self.files.get(name)
        if record is None:
            raise CheckpointError(f"{self.path} does not list {name} in its {MANIFEST}")
        if not path.is_file():
            raise self._missing(name)
        size = path.stat().st_size
        if size != record["size"]:
            raise CheckpointError(f"checkpoint file {path} has {size} bytes but {MANIFEST} records "
                                  f"{record['size']} (truncated or overwritten)")
        if sha256_file(path) != record["sha256"]:
            raise CheckpointError(f"checkpoint file {path} is corrupted: its sha256 differs from "
                                  f"the one in {MANIFEST}")
        self._verified.add(name)
        return path

    def verify(self, names: Iterable[str]) -> None:
        for name in names:
            self.verified_path(name)

    def read_json(self, name: str) -> dict[str, Any]:
        path = self.verified_path(name)
        try:
            return json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"checkpoint file {path} is not JSON: {exc}") from None

    # -- tensors -----------------------------------------------------------

    def plan(self, requests: Sequence[tuple[str, Region]]) -> list[Route]:
        """How to read each (tensor name, region), from the files present here.

        A region that only files absent from this directory hold is refused
        naming the first such file and the node that wrote it.
        """
        present = {name for name in self.files if (self.path / name).is_file()}
        routes = []
        for name, want in requests:
            entry = self.entries.get(name)
            if entry is None:
                raise CheckpointError(f"checkpoint {self.path} has no tensor {name}")
            route = plan_route(name, entry, want, present.__contains__)
            if route is None:
                anywhere = plan_route(name, entry, want, self.files.__contains__)
                if anywhere is None:
                    raise CheckpointError(f"checkpoint {self.path}: the saved pieces of tensor {name} do not "
                                          f"cover the part this rank needs ({MANIFEST} is inconsistent)")
                raise self._missing(next(f for f in anywhere.files if f not in present))
            routes.append(route)
        return routes

    def read(self, routes: Sequence[Route]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for each planned route, from verified files only."""
        self.verify(dict.fromkeys(f for r in routes for f in r.files))
        readers = Readers(lambda file: self.path / file)
        for route in routes:
            name = route.name
            yield name, read_route(route, self.entries[name], lambda p: readers.read(p, name))

    def iter_tensors(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole CPU tensor) for each name, assembled from its pieces.

        Every file involved is verified before the first tensor is returned,
        so a corrupt shard fails the load before anything was copied.
        """
        return self.read(self.plan([(name, WHOLE) for name in names]))

    def read_file(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Every tensor of one small listed file, and its safetensors metadata."""
        reader = SafetensorsReader(self.verified_path(name))
        return {k: reader.get(k) for k in reader.keys()}, reader.metadata()
