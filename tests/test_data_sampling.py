"""Global sample order, DP splitting, resume, and the per-step loader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hetpipe.data.demo import stdlib_sources
from hetpipe.data.indexed import IndexedDataset, IndexedDatasetWriter
from hetpipe.data.loader import MicrobatchLoader
from hetpipe.data.packed import PackedSequenceDataset
from hetpipe.data.sampler import GlobalBatchSampler
from hetpipe.data.tokenizer import ByteTokenizer
from hetpipe.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[1]


def steps(sampler: GlobalBatchSampler, count: int) -> list[list[list[int]]]:
    return [[mb.tolist() for mb in sampler.next_step()] for _ in range(count)]


def test_order_is_seeded_and_each_epoch_is_a_permutation():
    a = steps(GlobalBatchSampler(96, 16, 4, seed=7), 12)
    b = steps(GlobalBatchSampler(96, 16, 4, seed=7), 12)
    c = steps(GlobalBatchSampler(96, 16, 4, seed=8), 12)
    assert a == b and a != c
    flat = [i for step in a for mb in step for i in mb]
    assert sorted(flat[:96]) == list(range(96)) and sorted(flat[96:]) == list(range(96))
    assert flat[:96] != flat[96:]  # each epoch has its own shuffle


def test_global_batch_straddles_epochs():
    sampler = GlobalBatchSampler(10, 4, 2, seed=3)
    steps(sampler, 2)  # consumes positions 0..7
    first, second = (np.random.default_rng([3, e]).permutation(10) for e in (0, 1))
    expected = np.concatenate([first[8:10], second[0:2]])
    assert [i for mb in sampler.next_step() for i in mb] == expected.tolist()
    assert sampler.consumed_samples == 12


@pytest.mark.parametrize("dp_size", [2, 4, 8])
def test_dp_ranks_partition_the_global_batch(dp_size):
    reference = GlobalBatchSampler(50, 32, 2, seed=1)
    ranks = [GlobalBatchSampler(50, 32, 2, r, dp_size, seed=1) for r in range(dp_size)]
    assert ranks[0].num_microbatches == 32 // (2 * dp_size)
    for _ in range(5):
        whole = [i for mb in reference.next_step() for i in mb]
        per_rank = [rank.next_step() for rank in ranks]
        assert all(len(mbs) == ranks[0].num_microbatches for mbs in per_rank)
        assert all(len(mb) == 2 for mbs in per_rank for mb in mbs)
        assert [i for mbs in per_rank for mb in mbs for i in mb] == whole


def test_resume_from_state_dict_continues_exactly():
    uninterrupted = GlobalBatchSampler(37, 12, 3, seed=5)
    expected = steps(uninterrupted, 9)

    first = GlobalBatchSampler(37, 12, 3, seed=5)
    before = steps(first, 4)
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON checkpoint
    resumed = GlobalBatchSampler(37, 12, 3, seed=5)
    resumed.load_state_dict(state)
    assert before + steps(resumed, 5) == expected

    # The order is global: resuming on 2 DP ranks sees the same global batches.
    halves = [GlobalBatchSampler(37, 12, 3, r, 2, seed=5) for r in range(2)]
    for half in halves:
        half.load_state_dict(state)
    for step in expected[4:]:
        assert [i for h in halves for mb in h.next_step() for i in mb] == [
            i for mb in step for i in mb
        ]


@pytest.mark.parametrize(
    "field, value", [("seed", 6), ("num_samples", 38), ("global_batch_size", 24)]
)
def test_mismatched_state_is_refused(field, value):
    state = GlobalBatchSampler(37, 12, 3, seed=5).state_dict() | {field: value}
    with pytest.raises(ConfigError, match=f"{field}={value} but this run has {field}="):
        GlobalBatchSampler(37, 12, 3, seed=5).load_state_dict(state)


def test_indivisible_batch_sizes_are_refused():
    with pytest.raises(ConfigError, match="global_batch_size 12 is not divisible"):
        GlobalBatchSampler(100, 12, 4, dp_size=2)
    with pytest.raises(ConfigError, match="dp_rank 2"):
        GlobalBatchSampler(100, 16, 4, dp_rank=2, dp_size=2)


def write_docs(prefix: Path, docs: list[np.ndarray]) -> str:
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
    return str(prefix)


def test_loader_serves_shifted_token_label_pairs(tmp_path):
    rng = np.random.default_rng(0)
    prefix = write_docs(
        tmp_path / "d", [rng.integers(0, 257, int(rng.integers(1, 90))) for _ in range(40)]
    )
    loader = MicrobatchLoader(
        prefix,
        "byte",
        seq_length=16,
        global_batch_size=8,
        micro_batch_size=2,
        vocab_size=320,
        dp_rank=1,
        dp_size=2,
    )
    assert loader.num_microbatches == 2 and loader.tokens_per_step == 8 * 16
    mirror = GlobalBatchSampler(loader.samples.num_samples, 8, 2, 1, 2)
    packed = PackedSequenceDataset(IndexedDataset(prefix), 16)
    for _ in range(3):
        batches = loader.next_step()
        for (tokens, labels), indices in zip(batches, mirror.next_step(), strict=True):
            assert tokens.dtype == labels.dtype == torch.int64
            assert tokens.shape == labels.shape == (2, 16)
            window = np.stack([packed[int(i)] for i in indices])
            assert torch.equal(tokens, torch.from_numpy(window[:, :-1]))
            assert torch.equal(labels, torch.from_numpy(window[:, 1:]))
    assert loader.state_dict()["consumed_samples"] == 24


@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_eod_mask_loss_drops_the_labels_after_each_end_of_document(tmp_path, micro_batch_size):
    # Megatron's --eod-mask-loss: a position whose input is EOD predicts the next document's
    # first token; its label becomes -100. Inputs are untouched (with one sample per
    # microbatch, tokens and labels start as views of one window).
    rng = np.random.default_rng(1)
    eod = ByteTokenizer().eod
    prefix = write_docs(tmp_path / "d", [np.append(rng.integers(0, 256, int(rng.integers(1, 9))), eod)
                                         for _ in range(60)])
    plain, masked = (MicrobatchLoader(prefix, "byte", 16, 4, micro_batch_size, 320, eod_mask_loss=mask)
                     for mask in (False, True))
    ends = 0
    for _ in range(3):
        for (tokens, labels), (masked_tokens, masked_labels) in zip(plain.next_step(), masked.next_step()):
            assert torch.equal(masked_tokens, tokens)
            assert torch.equal(masked_labels, torch.where(tokens == eod, -100, labels))
            ends += int((tokens == eod).sum())
    assert ends > 10


def test_loader_refuses_small_model_vocab(tmp_path):
    prefix = write_docs(tmp_path / "d", [np.arange(100)])
    with pytest.raises(
        DataError, match="tokenizer byte has 257 tokens but the model's vocab_size is 200"
    ):
        MicrobatchLoader(prefix, "byte", 8, 2, 1, vocab_size=200)


def test_loader_names_out_of_range_token_ids(tmp_path):
    # Data written with a bigger vocabulary than the model's.
    prefix = write_docs(tmp_path / "big", [np.full(64, 300)])
    loader = MicrobatchLoader(prefix, "byte", 8, 2, 1, vocab_size=257)
    with pytest.raises(DataError, match=r"big sample \d+ holds token id 300.*different tokenizer"):
        loader.next_step()


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory) -> Path:
    """The demo corpus, built by two processes racing into one cache directory."""
    cache = tmp_path_factory.mktemp("cache")
    code = (
        "from hetpipe.data import demo_corpus; import sys; print(demo_corpus('byte', sys.argv[1]))"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(cache)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [r.communicate(timeout=120) for r in racers]
    assert all(r.returncode == 0 for r in racers), results
    assert results[0][0] == results[1][0]
    return cache


def test_demo_corpus_is_the_stdlib_sources(demo_cache):
    from hetpipe.data import demo_corpus

    prefix = demo_corpus("byte", str(demo_cache))
    leftovers = [
        p.name for p in (demo_cache / "demo").iterdir() if not p.name.endswith((".bin", ".idx"))
    ]
    assert leftovers == []
    data = IndexedDataset(prefix)
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_sources()]
    assert data.num_documents == sum(1 for t in texts if t)
    assert data.num_tokens > 4_000_000
    first = ByteTokenizer().encode(texts[0]).tolist() + [256]
    assert data.get(0).tolist() == first


def test_loader_trains_on_demo(demo_cache, monkeypatch):
    monkeypatch.setenv("HETPIPE_CACHE", str(demo_cache))
    loader = MicrobatchLoader(
        "demo", "byte", seq_length=64, global_batch_size=4, micro_batch_size=2, vocab_size=257
    )
    assert loader.data_path.startswith(str(demo_cache))
    (tokens, labels), _ = loader.next_step()
    assert tokens.shape == (2, 64) and int(tokens.max()) < 257
