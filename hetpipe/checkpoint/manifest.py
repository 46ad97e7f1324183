"""The manifest of a checkpoint, and reading files only after they are verified.

``manifest.json`` is written last, after every rank's files are on disk, and
lists every file with its sha256 and size plus an index from tensor name to
file. It is the single thing a reader trusts: a directory without one is an
interrupted save, a listed file that is missing, short or altered is refused
by name, and no tensor is read from a file whose checksum was not checked.
Everything is safetensors or JSON; nothing is ever unpickled.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from safetensors import safe_open

from hetpipe.errors import HetpipeError

MANIFEST = "manifest.json"
FORMAT = "hetpipe-checkpoint"
VERSION = 1


class CheckpointError(HetpipeError):
    """A checkpoint (or HF model directory) is missing, incomplete, corrupted or does not fit."""


def sha256_file(path: Path, block: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    """The manifest entry of a written file."""
    return {"name": path.name, "sha256": sha256_file(path), "size": path.stat().st_size}


class Checkpoint:
    """A complete checkpoint directory opened for reading."""

    def __init__(self, path: Path) -> None:
        self.path = path
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointError(f"{path} is an incomplete checkpoint: it has no {MANIFEST} "
                                  "(the save was interrupted, or the file was removed)")
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{manifest_path} is unreadable: {exc}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"{manifest_path} is not a hetpipe checkpoint manifest")
        if manifest.get("version") != VERSION:
            raise CheckpointError(f"{manifest_path} has format version {manifest.get('version')}; "
                                  f"this hetpipe reads version {VERSION}")
        missing = {"step", "model", "world_size", "ranks", "files", "tensors"} - set(manifest)
        if missing:
            raise CheckpointError(f"{manifest_path} lacks {', '.join(sorted(missing))}")
        self.manifest = manifest
        self.files: dict[str, dict[str, Any]] = {f["name"]: f for f in manifest["files"]}
        names = [f["name"] for f in manifest["files"]]
        self.tensors: dict[str, dict[str, Any]] = {
            name: {**entry, "file": names[entry["file"]]} for name, entry in manifest["tensors"].items()}
        self._verified: set[str] = set()

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

    def units_of(self, rank: int) -> Optional[list[list[int]]]:
        """The [start, stop) unit ranges ``rank`` held when saving, or None."""
        for entry in self.manifest["ranks"]:
            if entry["rank"] == rank:
                return [list(r) for r in entry["units"]]
        return None

    def has_file(self, name: str) -> bool:
        return name in self.files

    def verified_path(self, name: str) -> Path:
        """The path of a listed file, after checking its size and sha256."""
        path = self.path / name
        if name in self._verified:
            return path
        record = self.files.get(name)
        if record is None:
            raise CheckpointError(f"{self.path} does not list {name} in its {MANIFEST}")
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
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
        return json.loads(path.read_text())

    def iter_tensors(self, names: Iterable[str]) -> Iterable[tuple[str, torch.Tensor]]:
        """(name, CPU tensor) for each name, one tensor in memory at a time.

        Every file involved is verified before the first tensor is returned,
        so a corrupt shard fails the load before anything was copied.
        """
        by_file: dict[str, list[str]] = {}
        for name in names:
            entry = self.tensors.get(name)
            if entry is None:
                raise CheckpointError(f"checkpoint {self.path} has no tensor {name}")
            by_file.setdefault(entry["file"], []).append(name)
        self.verify(by_file)
        for file, file_names in by_file.items():
            path = self.path / file
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in file_names:
                    yield name, f.get_tensor(name)

    def read_file(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Every tensor of one small listed file, and its safetensors metadata."""
        path = self.verified_path(name)
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
