"""safetensors files written in one pass (hashed as they are written) and opened with one-line errors.

:func:`write_safetensors` writes the format itself (an 8-byte little-endian
header length, the JSON header padded with spaces to 8 bytes, then the
tensors' bytes back to back, largest element size first so every tensor is
aligned) straight from the tensors' memory: safetensors' own ``save_file``
first copies every tensor into a ``bytes`` object, and hashing its output
would read the file back. The sha256 is computed over the same buffers as
they are written, and the file is fsynced before its record is returned.

:func:`open_safetensors` is ``safe_open`` whose failures (a header length
larger than the file, garbage JSON, offsets that do not add up) become one
:class:`CheckpointError` naming the file.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from safetensors import SafetensorError, safe_open

from hetpipe.checkpoint.errors import CheckpointError

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor],
                      metadata: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """Write CPU ``tensors`` to ``path``; returns ``{"name", "sha256", "size"}``."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key in order:
        t = tensors[key]
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot save tensor {key} of dtype {t.dtype} in a checkpoint")
        size = t.numel() * t.element_size()
        header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(text)), text, *(_bytes(tensors[k]) for k in order)):
            f.write(chunk)
            digest.update(chunk)
        f.flush()
        os.fsync(f.fileno())
    return {"name": path.name, "sha256": digest.hexdigest(), "size": 8 + len(text) + offset}


class SafetensorsReader:
    """One open safetensors file; every failure is a :class:`CheckpointError` naming it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._file = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file: {_first_line(exc)}") from None

    def keys(self) -> list[str]:
        return list(self._file.keys())

    def metadata(self) -> dict[str, str]:
        return dict(self._file.metadata() or {})

    def get(self, key: str) -> torch.Tensor:
        if key not in self._file.keys():
            raise CheckpointError(f"{self.path} has no tensor {key}")
        try:
            return self._file.get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{self.path}: tensor {key} cannot be read: {_first_line(exc)}") from None

    def shape(self, key: str) -> list[int]:
        if key not in self._file.keys():
            raise CheckpointError(f"{self.path} has no tensor {key}")
        return list(self._file.get_slice(key).get_shape())


def open_safetensors(path: Path) -> SafetensorsReader:
    return SafetensorsReader(path)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
