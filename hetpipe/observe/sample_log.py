"""``logging.sample_log``: which samples every optimizer step trained on.

Rank 0 writes, beside ``metrics.jsonl``, two files into the run directory:

* ``samples.json``, the header: the global batch size, ``seq_length``, the
  seed, whether labels were masked at ends of documents (and the EOD id), the
  layout of a record, and each source of the data (its ``prefix``, blend
  ``weight``, the ``documents`` range of ``data.split``'s part, its
  ``num_samples`` and the ``offset`` of its first sample in the global index).
* ``samples.bin``, one fixed-size little-endian record per step, appended and
  flushed once the step is done (a crash keeps every finished step; a record
  cut short by one is ignored by the reader and dropped by the next run):
  ``step`` (int64, 1-based), ``applied`` (uint8: 0 for a step skipped for a
  non-finite loss or gradient norm: its batch was consumed all the same, as in
  Megatron, so it is logged, and the sampler moves on past it), ``sample``
  (the global batch's sample indices in global order: uint32, or int64 for
  corpora of 2**32 samples or more) and, for a blend only, ``source`` (the
  source of each sample, uint8, or uint16 past 256 sources).

A sample ``i`` of source ``s`` is its sample ``i - offset[s]``: the tokens
``[j * seq_length, (j + 1) * seq_length]`` (``seq_length + 1`` of them) of
that source's stream of documents ``documents[0]..documents[1]-1``, each ending
in EOD (:class:`hetpipe.data.PackedSequenceDataset`), which is what Megatron's
sample index maps a sample to. The global batch's order is the one DP ranks
split: DP rank ``d`` of ``D`` trains the ``d``-th contiguous share of
``global_batch_size / D`` samples, in microbatches of ``micro_batch_size`` in
order; inputs are a sample's first ``seq_length`` tokens, labels its last.

Why rank 0: every rank's sampler draws the whole global batch (and then
takes its share), so one rank knows it and one file holds it. A resumed run
keeps the records up to its checkpoint's step and appends from there, as
``metrics.jsonl`` keeps its rows; a fresh run starts the file anew.
"""
from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Any

import numpy as np

from hetpipe.data import MicrobatchLoader, PackedSequenceDataset
from hetpipe.data.indexed import IndexedDataset
from hetpipe.data.sources import BlendedSamples
from hetpipe.errors import ConfigError

HEADER = "samples.json"
RECORDS = "samples.bin"
VERSION = 1


def describe(loader: MicrobatchLoader, seed: int) -> dict[str, Any]:
    """The header of ``loader``'s sample log."""
    sampler, samples = loader.sampler, loader.samples
    weights = sampler.weights or [1.0]
    sources = [{"prefix": str(p.dataset.prefix), "weight": w, "documents": list(p.documents),
                "num_samples": p.num_samples, "offset": offset}
               for p, w, offset in zip(samples.sources, weights, samples.offsets)]
    index = "<u4" if samples.num_samples < 2**32 else "<i8"
    record: list[list[Any]] = [["step", "<i8"], ["applied", "|u1"], ["sample", index, sampler.global_batch_size]]
    if len(sources) > 1:
        record.append(["source", "|u1" if len(sources) <= 256 else "<u2", sampler.global_batch_size])
    return {"format": "hetpipe sample log", "version": VERSION, "global_batch_size": sampler.global_batch_size,
            "micro_batch_size": sampler.micro_batch_size, "seq_length": loader.seq_length, "seed": seed,
            "eod_mask_loss": loader.eod_mask_loss, "eod": loader.eod, "record": record, "sources": sources}


def record_dtype(header: dict[str, Any]) -> np.dtype:
    """A record of ``samples.bin`` as a numpy structured dtype (packed)."""
    return np.dtype([tuple(field) for field in header["record"]])


class SampleLog:
    """Rank 0's writer: one record per finished step (see the module docstring)."""

    def __init__(self, run_dir: Path, loader: MicrobatchLoader, seed: int, start_step: int = 0) -> None:
        self.loader = loader
        header = describe(loader, seed)
        self.dtype = record_dtype(header)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / RECORDS
        keep = _records_through(path, self.dtype, start_step, run_dir / HEADER) if start_step else 0
        self._file = path.open("r+b" if keep else "wb")
        self._file.truncate(keep * self.dtype.itemsize)
        self._file.seek(keep * self.dtype.itemsize)
        (run_dir / HEADER).write_text(json.dumps(header, indent=1) + "\n")
        self._row = np.zeros(1, dtype=self.dtype)

    def record(self, step: int, applied: bool) -> None:
        """Append step ``step``'s global batch (the sampler's last) and flush it."""
        indices, sources = self.loader.sampler.last_batch
        row = self._row[0]
        row["step"], row["applied"], row["sample"] = step, applied, indices
        if "source" in self.dtype.names:
            row["source"] = sources
        self._file.write(self._row.tobytes())
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _records_through(path: Path, dtype: np.dtype, step: int, header_path: Path) -> int:
    """How many of ``path``'s records a run resuming after ``step`` keeps: those
    of steps up to ``step`` (records are in step order, so a bisection finds
    them by reading a few step fields, whatever the file's length)."""
    if not (path.is_file() and header_path.is_file()):
        return 0
    if record_dtype(json.loads(header_path.read_text())) != dtype:
        raise ConfigError(f"{path} holds records of another layout than this run's (global batch size or "
                          "sources changed): move it away or use another run directory")
    count = path.stat().st_size // dtype.itemsize
    with path.open("rb") as f:
        def step_of(i: int) -> int:
            f.seek(i * dtype.itemsize)
            return int(np.frombuffer(f.read(8), dtype="<i8")[0])
        return bisect.bisect_right(range(count), step, key=step_of)


def read_sample_log(run_dir: Path | str) -> tuple[dict[str, Any], np.ndarray]:
    """(header, records) of a run's sample log; ``records["step"]``,
    ``records["sample"][k]`` (the k-th record's global batch) and so on."""
    run_dir = Path(run_dir)
    header = json.loads((run_dir / HEADER).read_text())
    dtype = record_dtype(header)
    path = run_dir / RECORDS
    return header, np.fromfile(path, dtype=dtype, count=path.stat().st_size // dtype.itemsize)


def sample_tokens(header: dict[str, Any], samples: np.ndarray) -> np.ndarray:
    """The ``[len(samples), seq_length + 1]`` tokens of logged global sample
    indices, read from the sources the header names (nothing else needed)."""
    sources = BlendedSamples([
        PackedSequenceDataset(IndexedDataset(s["prefix"]), header["seq_length"], tuple(s["documents"]))
        for s in header["sources"]])
    if sources.offsets != [s["offset"] for s in header["sources"]]:
        raise ConfigError(f"the data at {header['sources'][0]['prefix']} (or another source) is not what the "
                          "sample log was written from: its sample counts differ")
    return np.stack([sources[int(i)] for i in samples])
