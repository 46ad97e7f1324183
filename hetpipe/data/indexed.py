"""Megatron-Core indexed dataset (``.bin`` + ``.idx``), byte for byte.

Users arrive with corpora already preprocessed for Megatron-LM; reading and
writing the exact same format means that data loads here unchanged, and data
written here loads in Megatron. The layout (``megatron/core/datasets/
indexed_dataset.py``), all little-endian:

``.idx``::

    magic            9 bytes  b"MMIDIDX\\x00\\x00"
    version          <Q       1
    dtype code       <B       see DTYPE_CODES
    sequence_count   <Q
    document_count   <Q       length of the document-index array (documents + 1)
    sequence_lengths int32[sequence_count]   tokens per sequence
    sequence_ptrs    int64[sequence_count]   byte offset of each sequence in .bin
    document_indices int64[document_count]   0 ... sequence_count, sequence
                                              range [d[i], d[i+1]) is document i
    sequence_modes   int8[sequence_count]    optional, multimodal only

``.bin`` is the token arrays themselves, in the dtype named by the index.

Both files are memory-mapped, so opening a multi-terabyte corpus costs only the
header checks.
"""

from __future__ import annotations

import os
import struct
import uuid
from array import array
from pathlib import Path
from types import TracebackType

import numpy as np
import numpy.typing as npt

from hetpipe.errors import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1

# Megatron's DType enum: the code is what the .idx stores.
DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_CODES.items()}

# magic + version + dtype code + sequence_count + document_count
_HEADER = struct.Struct("<9sQBQQ")


def optimal_dtype(vocab_size: int) -> type[np.generic]:
    """The token dtype Megatron picks for a vocabulary: uint16 if it fits, else int32.

    65500 rather than 65536 is Megatron's own threshold; keeping it means we
    choose the same dtype Megatron would for the same tokenizer.
    """
    return np.uint16 if vocab_size < 65500 else np.int32


def data_file_path(prefix: str | os.PathLike[str]) -> str:
    """``prefix.bin``."""
    return f"{os.fspath(prefix)}.bin"


def index_file_path(prefix: str | os.PathLike[str]) -> str:
    """``prefix.idx``."""
    return f"{os.fspath(prefix)}.idx"


def encode_index(sequence_lengths: npt.ArrayLike, dtype: npt.DTypeLike) -> bytes:
    """The ``.idx`` bytes for one-sequence-per-document data of the given lengths.

    The sequence pointers follow from the lengths because the writer lays the
    sequences out back to back; that is also what Megatron's builder does.
    """
    np_dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1] * np_dtype.itemsize, out=pointers[1:])
    document_indices = np.arange(len(lengths) + 1, dtype=np.int64)
    header = _HEADER.pack(
        INDEX_MAGIC, INDEX_VERSION, _CODE_OF_DTYPE[np_dtype], len(lengths), len(document_indices)
    )
    return b"".join(
        (
            header,
            lengths.astype("<i4").tobytes(),
            pointers.astype("<i8").tobytes(),
            document_indices.astype("<i8").tobytes(),
        )
    )


class IndexedDatasetWriter:
    """Writes one ``prefix.bin`` / ``prefix.idx`` pair, one sequence per document.

    Tokens stream to a temporary ``.bin`` as documents arrive; only
    :meth:`finalize` renames the pair into place, ``.bin`` first and ``.idx``
    last. Readers require both files, so a crash mid-write leaves nothing that
    looks like a valid dataset, and a new ``.idx`` always has its full ``.bin``
    beside it. (Overwriting an existing pair briefly leaves the old ``.idx``
    beside the new ``.bin``; rewriting identical data, as concurrent cache
    builders do, is therefore safe, while replacing live data is not.)

    Use as a context manager: a clean exit finalizes, an exception discards.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: npt.DTypeLike) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            raise ValueError(
                f"dtype {self.dtype} has no Megatron dtype code "
                f"(supported: {', '.join(str(np.dtype(t)) for t in DTYPE_CODES.values())})"
            )
        self.prefix = os.fspath(prefix)
        directory = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(directory, exist_ok=True)
        base = os.path.basename(self.prefix)
        # Unique temporary names in the target directory: os.replace is only
        # atomic within one file system, and two writers of the same prefix
        # (e.g. two ranks building a cache) must not share a temp file.
        # (Not mkstemp: its 0600 mode would survive the rename.)
        tmp = os.path.join(directory, f".{base}.{uuid.uuid4().hex}")
        self._tmp_bin, self._tmp_idx = f"{tmp}.bin.tmp", f"{tmp}.idx.tmp"
        self._bin = open(self._tmp_bin, "xb")
        # int32 is what the .idx stores per sequence; array('i') keeps millions
        # of lengths compact without a Python int per document.
        self._lengths = array("i")
        self.num_tokens = 0
        self._done = False
        if self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            self._id_range: tuple[int, int] | None = (int(info.min), int(info.max))
        else:
            self._id_range = None

    @property
    def num_documents(self) -> int:
        """Documents added so far."""
        return len(self._lengths)

    def add_document(self, tokens: npt.ArrayLike) -> None:
        """Append one document (a 1-D array of token ids) as one sequence."""
        tokens = np.asarray(tokens)
        self.add_documents(tokens, np.array([tokens.size], dtype=np.int64))

    def add_documents(self, tokens: npt.ArrayLike, lengths: npt.ArrayLike) -> None:
        """Append many documents at once: ``tokens`` is their concatenation,
        ``lengths`` the size of each. One write per call, no Python per document.
        """
        if self._done:
            raise RuntimeError(f"writer for {self.prefix} is already finalized")
        tokens = np.asarray(tokens).reshape(-1)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(
                f"lengths sum to {int(lengths.sum())} but {tokens.size} tokens were given"
            )
        if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
            raise DataError(
                f"{data_file_path(self.prefix)}: a document length is outside the int32 range "
                "the Megatron index can store"
            )
        if self._id_range is not None and tokens.size:
            low, high = int(tokens.min()), int(tokens.max())
            if low < self._id_range[0] or high > self._id_range[1]:
                bad = low if low < self._id_range[0] else high
                raise DataError(
                    f"{data_file_path(self.prefix)}: token id {bad} does not fit the "
                    f"dataset dtype {self.dtype} (vocabulary larger than the dtype chosen for it?)"
                )
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype.newbyteorder("<")).tobytes())
        self._lengths.frombytes(lengths.astype(np.int32).tobytes())
        self.num_tokens += tokens.size

    def finalize(self) -> None:
        """Write the index and move both files to their final names."""
        if self._done:
            raise RuntimeError(f"writer for {self.prefix} is already finalized")
        self._bin.close()
        try:
            with open(self._tmp_idx, "wb") as f:
                f.write(encode_index(np.frombuffer(self._lengths, dtype=np.int32), self.dtype))
            os.replace(self._tmp_bin, data_file_path(self.prefix))
            os.replace(self._tmp_idx, index_file_path(self.prefix))
        except BaseException:
            self._discard()
            raise
        self._done = True

    def _discard(self) -> None:
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.unlink(path)
        self._done = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._done:
            return
        if exc_type is None:
            self.finalize()
        else:
            self._discard()


class IndexedDataset:
    """Read-only, memory-mapped view of a Megatron ``prefix.bin`` / ``prefix.idx`` pair.

    Indexing is by *sequence* (Megatron's unit; one per document for data this
    project writes). :meth:`get` returns a zero-copy read-only view into the
    ``.bin`` mapping.
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = os.fspath(prefix)
        idx_path, bin_path = index_file_path(self.prefix), data_file_path(self.prefix)
        if not (os.path.isfile(idx_path) and os.path.isfile(bin_path)):
            raise DataError(
                f"data path '{self.prefix}' not found: expected {bin_path} and {idx_path} "
                "(write them with scripts/preprocess_data.py)"
            )
        index = _map_file(idx_path)
        if index.size < _HEADER.size:
            raise DataError(
                f"{idx_path}: truncated index ({index.size} bytes, shorter than the "
                f"{_HEADER.size}-byte header)"
            )
        magic, version, code, sequence_count, document_count = _HEADER.unpack_from(index)
        if magic != INDEX_MAGIC:
            raise DataError(
                f"{idx_path}: not a Megatron indexed-dataset index "
                f"(magic {magic!r}, expected {INDEX_MAGIC!r})"
            )
        if version != INDEX_VERSION:
            raise DataError(
                f"{idx_path}: unsupported index version {version} (expected {INDEX_VERSION})"
            )
        if code not in DTYPE_CODES:
            raise DataError(
                f"{idx_path}: unknown dtype code {code} "
                f"(expected one of {', '.join(map(str, DTYPE_CODES))})"
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + 12 * sequence_count + 8 * document_count
        # Megatron appends one int8 mode per sequence for multimodal data; we
        # have no use for modes, but such files are otherwise valid.
        if index.size not in (expected, expected + sequence_count):
            raise DataError(
                f"{idx_path}: index is {index.size} bytes but its header "
                f"({sequence_count} sequences, {document_count} document indices) "
                f"needs {expected} (truncated or corrupt)"
            )
        offset = _HEADER.size
        self.sequence_lengths = np.frombuffer(index, "<i4", sequence_count, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(index, "<i8", sequence_count, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(index, "<i8", document_count, offset)
        if (
            document_count == 0
            or self.document_indices[0] != 0
            or (self.document_indices[-1] != sequence_count)
        ):
            raise DataError(
                f"{idx_path}: document indices must run from 0 to the sequence count "
                f"{sequence_count} (corrupt index)"
            )

        self._bin = _map_file(bin_path)
        if sequence_count:
            needed = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * (
                self.dtype.itemsize
            )
            if self._bin.size < needed:
                raise DataError(
                    f"{bin_path}: data file is {self._bin.size} bytes but its index points "
                    f"up to byte {needed} (truncated, or paired with the wrong .idx)"
                )
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        """Documents (not sequences): one fewer than the document-index entries."""
        return len(self.document_indices) - 1

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` (to its end if
        ``length`` is None), as a read-only view of the memory-mapped ``.bin``."""
        n = len(self.sequence_lengths)
        if not 0 <= i < n:
            raise IndexError(f"sequence {i} out of range for {self.prefix} ({n} sequences)")
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {i} "
                f"of {self.prefix} ({size} tokens)"
            )
        return self.read(int(self.sequence_pointers[i]) + offset * self.dtype.itemsize, length)

    def read(self, byte_offset: int, count: int) -> np.ndarray:
        """``count`` tokens starting at ``byte_offset`` of the ``.bin``, across
        sequence boundaries (for packing sequences stored back to back)."""
        if byte_offset < 0 or byte_offset + count * self.dtype.itemsize > self._bin.size:
            raise IndexError(
                f"{count} tokens at byte {byte_offset} run past the end of "
                f"{data_file_path(self.prefix)} ({self._bin.size} bytes)"
            )
        return np.frombuffer(self._bin, self.dtype.newbyteorder("<"), count, byte_offset)


def _map_file(path: str) -> np.ndarray:
    """Memory-map ``path`` read-only as bytes; an empty file (mmap refuses
    those) becomes an empty array."""
    if Path(path).stat().st_size == 0:
        return np.empty(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")
