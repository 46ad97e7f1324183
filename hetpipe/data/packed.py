"""Fixed-length training samples cut from the document stream, Megatron style.

Pretraining wastes no tokens on padding: all documents (each already ending
in EOD) form one long stream and every sample is the next ``seq_length + 1``
tokens of it. Consecutive samples share one token, because a sample ``s``
trains inputs ``s[:-1]`` against labels ``s[1:]``.
"""

from __future__ import annotations

import numpy as np

from hetpipe.data.indexed import IndexedDataset
from hetpipe.errors import ConfigError, DataError


class PackedSequenceDataset:
    """Sample ``i`` is stream tokens ``[i*seq_length, i*seq_length + seq_length + 1)``
    of the chosen documents' stream."""

    def __init__(self, dataset: IndexedDataset, seq_length: int,
                 documents: tuple[int, int] | None = None) -> None:
        if seq_length < 1:
            raise ConfigError(f"seq_length must be at least 1, got {seq_length}")
        self.dataset = dataset
        self.seq_length = seq_length
        # ``documents`` is a [first, last) range (a train/valid/test split);
        # None streams them all. Documents are contiguous, ordered ranges of
        # sequences, so the stream in document order is simply the sequences
        # in index order.
        first_doc, last_doc = documents if documents is not None else (0, dataset.num_documents)
        self.documents = (int(first_doc), int(last_doc))
        self._first = int(dataset.document_indices[first_doc])
        self._lengths = dataset.sequence_lengths[
            self._first : int(dataset.document_indices[last_doc])].astype(np.int64)
        self._ends = np.cumsum(self._lengths)  # stream offset just past each sequence
        total = int(self._ends[-1]) if len(self._ends) else 0
        self.num_tokens = total
        self.num_samples = (total - 1) // seq_length if total else 0
        if self.num_samples < 1:
            where = f" documents [{first_doc}, {last_doc})" if documents is not None else ""
            raise DataError(
                f"data {dataset.prefix}{where} has {total} tokens, fewer than "
                f"seq_length+1 = {seq_length + 1}"
            )
        # Megatron does not promise that sequences sit back to back in the
        # .bin, so follow the pointers in general; when they do (always, for
        # data written by a preprocessor) a sample is a single slice, however
        # many short documents it spans.
        starts = self._ends - self._lengths
        pointers = dataset.sequence_pointers[self._first : self._first + len(self._lengths)]
        self._contiguous_base: int | None = None
        if np.array_equal(pointers - pointers[0], starts * dataset.dtype.itemsize):
            self._contiguous_base = int(pointers[0])

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        """``seq_length + 1`` tokens as int64."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range ({self.num_samples} samples)")
        count = self.seq_length + 1
        start = int(i) * self.seq_length
        data = self.dataset
        if self._contiguous_base is not None:
            offset = self._contiguous_base + start * data.dtype.itemsize
            return data.read(offset, count).astype(np.int64)
        out = np.empty(count, dtype=np.int64)
        first = int(np.searchsorted(self._ends, start, side="right"))
        last = int(np.searchsorted(self._ends, start + count - 1, side="right"))
        filled = 0
        for seq in range(first, last + 1):
            seq_start = int(self._ends[seq]) - int(self._lengths[seq])
            begin = max(start, seq_start) - seq_start
            take = min(int(self._ends[seq]), start + count) - seq_start - begin
            out[filled : filled + take] = data.get(self._first + seq, begin, take)
            filled += take
        return out
