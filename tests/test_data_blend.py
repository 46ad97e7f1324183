"""Weighted blends, ``data.path="w1 prefix1 w2 prefix2 ..."`` as in Megatron:
the mix follows the weights to within one sample (Megatron's deterministic
rule), every source keeps its own shuffled epochs, the position survives a
checkpoint so a resumed run reads the same samples, and a malformed blend is
one line of error."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_cli, run_pretrain
from hetpipe.data.blend import BlendSchedule
from hetpipe.data.indexed import IndexedDatasetWriter
from hetpipe.data.loader import MicrobatchLoader
from hetpipe.data.sampler import GlobalBatchSampler
from hetpipe.data.sources import DataSource, parse_data_path
from hetpipe.data.tokenizer import ByteTokenizer
from hetpipe.errors import ConfigError

pytestmark = pytest.mark.timeout(300)


def write_corpus(prefix, low: int, high: int, num_docs: int = 60, seed: int = 0) -> str:
    """Random documents with token ids in [low, high), so a sample tells its source."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(num_docs):
            writer.add_document(rng.integers(low, high, int(rng.integers(5, 60))))
    return str(prefix)


def test_blend_strings_parse_like_megatron():
    assert parse_data_path("demo") == [DataSource("demo", 1.0)]
    assert parse_data_path("3 a 1 b") == [DataSource("a", 0.75), DataSource("b", 0.25)]
    assert parse_data_path("0.7  a\n0.3 b") == [DataSource("a", 0.7), DataSource("b", 0.3)]


@pytest.mark.parametrize("spec, message", [
    ("0.7 a 0.3", "has 3 entries, but a blend is weight-prefix pairs"),
    ("0 a 1 b", "the weight of a is 0; weights must be positive"),
    ("1 a -2 b", "the weight of b is -2; weights must be positive"),
    ("a 0.5 b 0.5", "'a' stands where the weight of 0.5 belongs"),
    ("nan a 1 b", "weights must be positive"),
    ("  ", "is empty"),
])
def test_malformed_blends_are_refused(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_data_path(spec)


def test_each_position_goes_to_the_source_furthest_below_its_share():
    # Megatron's sequence for 0.7/0.3, worked by hand from its rule.
    sources, before = BlendSchedule([0.7, 0.3]).assign(0, 10)
    assert sources.tolist() == [0, 1, 0, 0, 1, 0, 0, 1, 0, 0] and before == [0, 0]
    for weights in ([0.7, 0.3], [0.5, 0.3, 0.2], [0.01, 0.99]):
        sources, _ = BlendSchedule(weights).assign(0, 20_000)
        seen = np.arange(1, sources.size + 1)
        for i, w in enumerate(weights):
            assert np.abs(np.cumsum(sources == i) - w * seen).max() <= 1.0
    # Asking again, or for a later stretch, gives the same answer.
    schedule = BlendSchedule([0.7, 0.3])
    whole, _ = schedule.assign(0, 100)
    assert schedule.assign(40, 60)[0].tolist() == whole[40:].tolist()
    assert schedule.assign(0, 100)[0].tolist() == whole.tolist()
    assert schedule.counts_at(100) == [70, 30]


def test_loader_serves_each_source_by_its_weight(tmp_path):
    a, b = write_corpus(tmp_path / "a", 0, 100), write_corpus(tmp_path / "b", 150, 250, num_docs=20, seed=1)
    loader = MicrobatchLoader(f"0.7 {a} 0.3 {b}", "byte", seq_length=8, global_batch_size=20,
                              micro_batch_size=2, vocab_size=257)
    size_b = loader.samples.sizes[1]
    served = from_b = 0
    for _ in range(50):
        for tokens, _ in loader.next_step():
            from_b += int((tokens.min(dim=1).values >= 150).sum())
            served += tokens.shape[0]
        # Exact to one sample after every step, not just on average.
        assert abs(from_b - 0.3 * served) <= 1
    assert served == 1000 and from_b == 300 > 2 * size_b
    # Source b went round more than twice: each of its epochs is a fresh
    # permutation of all its samples.
    sampler = GlobalBatchSampler(loader.samples.sizes, 1000, 2, weights=[0.7, 0.3])
    ids = sampler.global_batch()
    local_b = ids[ids >= loader.samples.offsets[1]] - loader.samples.offsets[1]
    first, second = local_b[:size_b], local_b[size_b:2 * size_b]
    assert sorted(first) == sorted(second) == list(range(size_b)) and first.tolist() != second.tolist()


def steps(sampler: GlobalBatchSampler, count: int) -> list[list[int]]:
    return [[i for mb in sampler.next_step() for i in mb] for _ in range(count)]


def test_blend_position_resumes_from_json_state():
    def sampler(**kwargs):
        return GlobalBatchSampler([37, 11], 12, 3, seed=5, weights=[0.7, 0.3], **kwargs)

    expected = steps(sampler(), 9)
    first = sampler()
    before = steps(first, 4)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["consumed_samples"] == 48 and sum(state["source_consumed"]) == 48
    resumed = sampler()
    resumed.load_state_dict(state)
    assert before + steps(resumed, 5) == expected
    # On two DP ranks the resumed global batches are the same.
    halves = [sampler(dp_rank=r, dp_size=2) for r in range(2)]
    for half in halves:
        half.load_state_dict(state)
    assert [steps(halves[0], 1)[0] + steps(halves[1], 1)[0] for _ in range(5)] == expected[4:]
    with pytest.raises(ConfigError, match=r"weights=\[0.7, 0.3\] but this run has weights=\[0.6, 0.4\]"):
        GlobalBatchSampler([37, 11], 12, 3, seed=5, weights=[0.6, 0.4]).load_state_dict(state)
    with pytest.raises(ConfigError, match="does not split consumed_samples=48"):
        sampler().load_state_dict(state | {"source_consumed": [30, 17]})


COMMON = ["+model=tiny_llama", "model.hidden_size=64", "model.ffn_hidden_size=160", "train.seq_length=32",
          "train.micro_batch_size=2", "train.global_batch_size=8", "optimizer.lr=3e-3",
          # A schedule that does not depend on train_iters, so a short run is a prefix of a long one.
          "optimizer.lr_warmup_iters=2", "optimizer.lr_decay_iters=8", "logging.progress=false",
          "cluster.groups.0.device_type=CPU"]


@pytest.fixture(scope="module")
def blend(tmp_path_factory, corpus_prefix, corpus_text) -> str:
    """The test corpus blended 0.7/0.3 with its paragraphs in reverse order."""
    paragraphs = corpus_text.read_text(encoding="utf-8").split("\n\n")[::-1]
    tokenizer = ByteTokenizer()
    prefix = tmp_path_factory.mktemp("reversed") / "reversed"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for text in paragraphs:
            writer.add_document(np.append(tokenizer.encode(text), tokenizer.eod))
    return f"0.7 {corpus_prefix} 0.3 {prefix}"


def test_resumed_blended_run_is_bitwise_uninterrupted(tmp_path, blend):
    def losses(name, *overrides):
        _, rows = run_pretrain(tmp_path / name, [*COMMON, f"data.path={blend}", *overrides])
        return {r["step"]: r["loss"] for r in rows}

    ckpt = [f"checkpoint.save_dir={tmp_path / 'ckpt'}"]
    reference = losses("ref", "train.train_iters=8")
    first = losses("a", "train.train_iters=4", *ckpt, "checkpoint.save_interval=4")
    state = json.loads((tmp_path / "ckpt" / "iter_0000004" / "trainer_state.json").read_text())["sampler"]
    assert state["weights"] == [0.7, 0.3] and state["source_consumed"] == [22, 10]  # 32 samples, to within one
    second = losses("b", "train.train_iters=8", *ckpt, "checkpoint.resume=latest")
    assert sorted(second) == [5, 6, 7, 8]
    assert {**first, **second} == reference


@pytest.mark.parametrize("spec, message", [
    ("0.7 {p} 0.3", "data.path='0.7 {p} 0.3' has 3 entries"),
    ("0 {p} 1 {p}", "data.path: the weight of {p} is 0; weights must be positive"),
    ("0.5 {p} 0.5 {p}-missing", "data path '{p}-missing' not found"),
])
def test_bad_blends_are_one_clear_line(tmp_path, corpus_prefix, spec, message):
    proc = run_cli(["-m", "hetpipe.pretrain", *COMMON, f"data.path={spec.format(p=corpus_prefix)}",
                    f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert message.format(p=corpus_prefix) in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
