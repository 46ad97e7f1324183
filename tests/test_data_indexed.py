"""Megatron .bin/.idx compatibility, corrupt-file refusal, and sequence packing."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from hetpipe.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from hetpipe.data.packed import PackedSequenceDataset
from hetpipe.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"


def megatron_idx(
    lengths: list[int],
    dtype_code: int,
    itemsize: int,
    pointers: list[int] | None = None,
    document_indices: list[int] | None = None,
    modes: list[int] | None = None,
) -> bytes:
    """An .idx built field by field from Megatron's layout, independent of hetpipe."""
    if pointers is None:
        pointers, offset = [], 0
        for n in lengths:
            pointers.append(offset)
            offset += n * itemsize
    if document_indices is None:
        document_indices = list(range(len(lengths) + 1))
    out = MAGIC
    out += struct.pack("<Q", 1)
    out += struct.pack("<B", dtype_code)
    out += struct.pack("<Q", len(lengths))
    out += struct.pack("<Q", len(document_indices))
    out += b"".join(struct.pack("<i", n) for n in lengths)
    out += b"".join(struct.pack("<q", p) for p in pointers)
    out += b"".join(struct.pack("<q", d) for d in document_indices)
    if modes is not None:
        out += b"".join(struct.pack("<b", m) for m in modes)
    return out


def write_pair(prefix, idx: bytes, bin_: bytes) -> str:
    with open(f"{prefix}.idx", "wb") as f:
        f.write(idx)
    with open(f"{prefix}.bin", "wb") as f:
        f.write(bin_)
    return str(prefix)


def random_docs(rng: np.random.Generator, high: int, count: int = 20) -> list[np.ndarray]:
    return [rng.integers(0, high, size=int(rng.integers(0, 50))) for _ in range(count)]


@pytest.mark.parametrize("dtype, high", [(np.uint16, 65_000), (np.int32, 150_000)])
def test_writer_reader_round_trip(tmp_path, dtype, high):
    docs = random_docs(np.random.default_rng(0), high)
    with IndexedDatasetWriter(tmp_path / "d", dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    data = IndexedDataset(tmp_path / "d")
    assert data.dtype == np.dtype(dtype)
    assert len(data) == len(docs) and data.num_documents == len(docs)
    assert data.num_tokens == sum(len(d) for d in docs)
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(data.get(i), doc)
    long = max(range(len(docs)), key=lambda i: len(docs[i]))
    np.testing.assert_array_equal(data.get(long, 3, 5), docs[long][3:8])


def test_optimal_dtype_follows_megatron():
    assert optimal_dtype(257) is np.uint16
    assert optimal_dtype(65_499) is np.uint16
    assert optimal_dtype(65_500) is np.int32
    assert optimal_dtype(128_256) is np.int32


def test_writer_bytes_equal_hand_built_megatron_index(tmp_path):
    docs = [np.array([5, 6, 7]), np.array([1]), np.array([9, 9, 9, 9, 2])]
    with IndexedDatasetWriter(tmp_path / "d", np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
    reference = megatron_idx([3, 1, 5], dtype_code=8, itemsize=2)
    assert (tmp_path / "d.idx").read_bytes() == reference
    assert (tmp_path / "d.bin").read_bytes() == np.concatenate(docs).astype("<u2").tobytes()


def test_reads_hand_built_pair_with_scattered_pointers_and_modes(tmp_path):
    # Sequences stored out of order in the .bin, two sequences in the first
    # document, and Megatron's optional multimodal mode bytes at the end.
    seqs = [
        np.array([10, 11], np.int32),
        np.array([20, 21, 22], np.int32),
        np.array([30], np.int32),
    ]
    bin_ = seqs[2].tobytes() + seqs[0].tobytes() + seqs[1].tobytes()
    idx = megatron_idx(
        [2, 3, 1],
        dtype_code=4,
        itemsize=4,
        pointers=[4, 12, 0],
        document_indices=[0, 2, 3],
        modes=[0, 1, 0],
    )
    data = IndexedDataset(write_pair(tmp_path / "h", idx, bin_))
    assert data.dtype == np.int32 and len(data) == 3 and data.num_documents == 2
    for i, seq in enumerate(seqs):
        np.testing.assert_array_equal(data.get(i), seq)
    np.testing.assert_array_equal(data.document_indices, [0, 2, 3])


def good_pair() -> tuple[bytes, bytes]:
    return megatron_idx([2, 3], dtype_code=8, itemsize=2), np.arange(5, dtype="<u2").tobytes()


@pytest.mark.parametrize(
    "corrupt, file, words",
    [
        (
            lambda i, b: (b"XXXXXXX\x00\x00" + i[9:], b),
            "idx",
            "not a Megatron indexed-dataset index",
        ),
        (lambda i, b: (i[:9] + struct.pack("<Q", 2) + i[17:], b), "idx", "version 2"),
        (lambda i, b: (i[:17] + struct.pack("<B", 9) + i[18:], b), "idx", "dtype code 9"),
        (lambda i, b: (i[:-4], b), "idx", "truncated"),
        (lambda i, b: (i[:20], b), "idx", "truncated"),
        (lambda i, b: (i + b"\x00" * 5, b), "idx", "corrupt"),
        (lambda i, b: (i, b[:-2]), "bin", "truncated"),
    ],
    ids=[
        "magic",
        "version",
        "dtype",
        "truncated-idx",
        "header-only",
        "trailing-junk",
        "truncated-bin",
    ],
)
def test_corrupt_files_are_refused_naming_the_file(tmp_path, corrupt, file, words):
    idx, bin_ = corrupt(*good_pair())
    prefix = write_pair(tmp_path / "bad", idx, bin_)
    with pytest.raises(DataError) as err:
        IndexedDataset(prefix)
    message = str(err.value)
    assert f"{prefix}.{file}" in message and words in message


def test_missing_files_point_to_preprocessing(tmp_path):
    with pytest.raises(
        DataError, match=r"expected .*nope\.bin and .*nope\.idx .*preprocess_data\.py"
    ):
        IndexedDataset(tmp_path / "nope")


def test_failed_write_leaves_no_dataset(tmp_path):
    with pytest.raises(DataError, match="does not fit"):
        with IndexedDatasetWriter(tmp_path / "d", np.uint16) as writer:
            writer.add_document(np.array([1, 2, 3]))
            writer.add_document(np.array([70_000]))
    assert list(tmp_path.iterdir()) == []


def stream_of(docs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(docs).astype(np.int64)


def test_packing_overlaps_one_token_and_crosses_documents(tmp_path):
    docs = random_docs(np.random.default_rng(1), 257, count=30)
    with IndexedDatasetWriter(tmp_path / "d", np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
    packed = PackedSequenceDataset(IndexedDataset(tmp_path / "d"), seq_length=16)
    stream = stream_of(docs)
    assert len(packed) == (len(stream) - 1) // 16
    for i in range(len(packed)):
        sample = packed[i]
        assert sample.dtype == np.int64 and sample.shape == (17,)
        np.testing.assert_array_equal(sample, stream[i * 16 : i * 16 + 17])
        if i:
            assert packed[i - 1][-1] == sample[0]


def test_packing_follows_pointers_when_sequences_are_not_contiguous(tmp_path):
    seqs = [np.arange(100, 107), np.arange(200, 203), np.array([], int), np.arange(300, 311)]
    order = [3, 0, 2, 1]  # storage order in the .bin
    pointers, bin_, offset = [0] * 4, b"", 0
    for s in order:
        pointers[s] = offset
        bin_ += seqs[s].astype("<u2").tobytes()
        offset += 2 * len(seqs[s])
    idx = megatron_idx([len(s) for s in seqs], dtype_code=8, itemsize=2, pointers=pointers)
    packed = PackedSequenceDataset(
        IndexedDataset(write_pair(tmp_path / "s", idx, bin_)), seq_length=4
    )
    stream = stream_of(seqs)
    assert len(packed) == (21 - 1) // 4
    for i in range(len(packed)):
        np.testing.assert_array_equal(packed[i], stream[i * 4 : i * 4 + 5])


def test_packing_refuses_too_little_data(tmp_path):
    with IndexedDatasetWriter(tmp_path / "tiny", np.uint16) as writer:
        writer.add_document(np.arange(8))
    with pytest.raises(DataError, match=r"tiny has 8 tokens, fewer than seq_length\+1 = 9"):
        PackedSequenceDataset(IndexedDataset(tmp_path / "tiny"), seq_length=8)
    assert len(PackedSequenceDataset(IndexedDataset(tmp_path / "tiny"), seq_length=7)) == 1
