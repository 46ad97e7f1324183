"""Reading the history of wandb offline runs without a wandb server.

hetpipe mirrors its metrics into an offline wandb run when
``logging.wandb=true``; ``python -m hetpipe.compare`` reads such a run back
when a run directory has no ``metrics.jsonl``. The record framing is parsed
here; only the protobuf records themselves are decoded by the wandb package.
"""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

from hetpipe.errors import HetpipeError


def wandb_logs(path: Path) -> list[Path]:
    """The ``.wandb`` logs of a run directory, a wandb directory or one
    offline run directory. Offline run directories are named by start time,
    so name order is start order."""
    for pattern in ("run-*.wandb", "offline-run-*/run-*.wandb", "wandb/offline-run-*/run-*.wandb"):
        logs = sorted(path.glob(pattern))
        if logs:
            return logs
    return []


def wandb_rows(logs: list[Path], check_row: Callable[[Any, str], tuple[int, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """History rows of wandb offline logs. A resumed hetpipe run starts one
    wandb run per start; a later start's rows replace the earlier ones of the
    same step, as they replace them in metrics.jsonl. ``check_row`` validates
    each row (and names the record when it is malformed)."""
    try:
        from google.protobuf.message import DecodeError
        from wandb.proto import wandb_internal_pb2
    except ImportError:
        raise HetpipeError(f"{logs[0].parent}: reading wandb runs needs the wandb package "
                           "(pip install 'hetpipe[wandb]')") from None
    rows: dict[int, dict[str, Any]] = {}
    for log in logs:
        for offset, payload in _wandb_records(log):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(payload)
            except DecodeError:
                raise HetpipeError(f"{log}: undecodable record at byte {offset}") from None
            if record.WhichOneof("record_type") != "history":
                continue
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            row.setdefault("step", record.history.step.num)
            step, row = check_row(row, f"{log}: history record at byte {offset}")
            rows[step] = row
    return rows


# A .wandb log is a 7-byte header (":W&B", magic 0xBEE1, version) followed by
# LevelDB's log framing: 32 KiB blocks of chunks, each with a crc32, a length
# and a type that says whether it is a whole record or a piece of one. The
# framing has not changed since wandb adopted it; only the protobuf schema of
# the records (read through the wandb package) evolves, so only that part is
# left to wandb, whose own Python reader of the framing was dropped in 0.2x.
_WANDB_HEADER = struct.Struct("<4sHB")
_CHUNK_HEADER = struct.Struct("<IHB")
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_records(path: Path) -> Iterator[tuple[int, bytes]]:
    """(byte offset, payload) of each record of a ``.wandb`` log."""
    data = path.read_bytes()
    if len(data) < _WANDB_HEADER.size or _WANDB_HEADER.unpack_from(data)[:2] != (b":W&B", 0xBEE1):
        raise HetpipeError(f"{path}: not a wandb transaction log")
    pos, start, pending = _WANDB_HEADER.size, 0, b""
    while True:
        if _BLOCK - pos % _BLOCK < _CHUNK_HEADER.size:
            pos += _BLOCK - pos % _BLOCK  # a block's tail too short for a header is zero padding
        if pos + _CHUNK_HEADER.size > len(data):
            return
        crc, length, kind = _CHUNK_HEADER.unpack_from(data, pos)
        chunk = data[pos + _CHUNK_HEADER.size:pos + _CHUNK_HEADER.size + length]
        if len(chunk) < length:
            return  # cut off mid-record: the run was still writing, or died; earlier rows stand
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc or kind not in (_FULL, _FIRST, _MIDDLE, _LAST):
            raise HetpipeError(f"{path}: corrupt record at byte {pos}")
        if kind in (_FULL, _FIRST):
            start, pending = pos, b""
        pending += chunk
        pos += _CHUNK_HEADER.size + length
        if kind in (_FULL, _LAST):
            yield start, pending
