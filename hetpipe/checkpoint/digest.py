"""The checksums a checkpoint is verified by: each file's sha256, and the manifest's sha256 of itself.

Apart from :mod:`~hetpipe.checkpoint.manifest` because both the manifest
(which verifies files on reading) and :mod:`~hetpipe.checkpoint.consistency`
(which the manifest runs when it opens, and which checks the self-checksum)
need them; in the manifest, they made the two modules import each other.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

# The manifest's field holding the sha256 of the rest of it.
SELF_CHECKSUM = "manifest_sha256"


def sha256_file(path: Path, block: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    """The manifest entry of a written file."""
    return {"name": path.name, "sha256": sha256_file(path), "size": path.stat().st_size}


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON without its own checksum field."""
    body = {k: v for k, v in manifest.items() if k != SELF_CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
