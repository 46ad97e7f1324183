"""logging.sample_log: samples.bin records, for every step, the global batch it
trained on; the log alone gives back the tokens and labels the model saw, for
one corpus and a blend, across a crash and a resume, and for a skipped step."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hetpipe.data import IndexedDatasetWriter, MicrobatchLoader
from hetpipe.data.tokenizer import ByteTokenizer
from hetpipe.training.engine import PipelineEngine
from hetpipe.schema.pretrain_config import resolve
from hetpipe.errors import ConfigError
from hetpipe.observe.sample_log import RECORDS, SampleLog, read_sample_log, sample_tokens
from hetpipe.training.trainer import train

pytestmark = pytest.mark.timeout(300)

EOD = ByteTokenizer().eod
TRAIN = {"micro_batch_size": 2, "global_batch_size": 8, "seq_length": 16, "log_interval": 1}


def _corpus(prefix, low: int, high: int, seed: int) -> str:
    """Documents with token ids in [low, high), each ending in EOD: a sample's ids tell its source."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(80):
            writer.add_document(np.append(rng.integers(low, high, int(rng.integers(4, 30))), EOD))
    return str(prefix)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    return _corpus(root / "low", 0, 100, 1), _corpus(root / "high", 100, 200, 2)


def _cfg(path, checkpoint=None, **train):
    return resolve({"model": {"name": "tiny_llama", "num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64,
                              "num_attention_heads": 2, "num_query_groups": 1, "vocab_size": 512,
                              "max_position_embeddings": 64},
                    "train": {**TRAIN, **train}, "data": {"path": path, "eod_mask_loss": True},
                    "logging": {"progress": False}, "checkpoint": checkpoint or {}})


@pytest.fixture
def seen(monkeypatch):
    """Every step's microbatches as the engine got them."""
    steps = []
    run_step = PipelineEngine.run_step

    def recording(self, microbatches, loss_weights=None):
        steps.append([(x.clone(), y.clone()) for x, y in microbatches])
        return run_step(self, microbatches, loss_weights)
    monkeypatch.setattr(PipelineEngine, "run_step", recording)
    return steps


def _from_log(header, record):
    """The step's microbatches rebuilt from its record and the header alone."""
    tokens = torch.from_numpy(sample_tokens(header, record["sample"]))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if header["eod_mask_loss"]:
        labels = torch.where(inputs == header["eod"], -100, labels)
    size = header["micro_batch_size"]
    return list(zip(inputs.split(size), labels.split(size)))


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))


@pytest.mark.parametrize("blend", [False, True])
def test_the_log_alone_gives_back_every_batch_the_model_saw(tmp_path, corpora, seen, blend, one_thread):
    path = f"0.7 {corpora[0]} 0.3 {corpora[1]}" if blend else corpora[0]
    train(_cfg(path, train_iters=3), tmp_path / "run")
    header, records = read_sample_log(tmp_path / "run")
    assert records["step"].tolist() == [1, 2, 3] and records["applied"].tolist() == [1, 1, 1]
    for record, microbatches in zip(records, seen):
        assert _same(_from_log(header, record), microbatches)
    # The indices are the sampler's, in its global order.
    loader = MicrobatchLoader(path, "byte", 16, 8, 2, 512, seed=1234)
    for record in records:
        loader.next_step()
        assert record["sample"].tolist() == loader.sampler.last_batch[0].tolist()
    if blend:
        offsets = np.array([s["offset"] for s in header["sources"]])
        for record in records:
            source = record["source"]
            assert (source == np.searchsorted(offsets, record["sample"], side="right") - 1).all()
            tokens = sample_tokens(header, record["sample"])
            high = (tokens != EOD) & (tokens >= 100)
            assert (high.any(axis=1) == (source == 1)).all()  # a sample's ids tell its source
        assert {tuple(s["documents"]) for s in header["sources"]} == {(0, 80)}
    else:
        assert "source" not in records.dtype.names


def test_a_crash_keeps_the_finished_steps_and_a_resume_neither_repeats_nor_skips(tmp_path, corpora, seen,
                                                                                  monkeypatch, one_thread):
    run_dir, ckpt = tmp_path / "run", {"save_dir": str(tmp_path / "ckpt"), "save_interval": 2, "async_save": False}
    monkeypatch.setenv("HETPIPE_FAULT", "raise@step:step=4")
    with pytest.raises(RuntimeError, match="injected fault at step of step 4"):
        train(_cfg(corpora[0], train_iters=5, checkpoint=dict(ckpt)), run_dir)
    monkeypatch.delenv("HETPIPE_FAULT")
    header, crashed = read_sample_log(run_dir)
    assert crashed["step"].tolist() == [1, 2, 3]  # flushed as each step ended
    with (run_dir / RECORDS).open("ab") as f:
        f.write(b"\x05" * 7)  # a record cut short (the crash came mid-write)
    assert read_sample_log(run_dir)[1]["step"].tolist() == [1, 2, 3]

    train(_cfg(corpora[0], train_iters=5, checkpoint={**ckpt, "resume": "latest"}), run_dir)  # from step 2
    header, records = read_sample_log(run_dir)
    assert records["step"].tolist() == [1, 2, 3, 4, 5]
    assert records[:3].tobytes() == crashed.tobytes()  # step 3 again: the same batch, logged once
    resumed = seen[3:]  # the crashed run's steps 1-3 came first
    assert len(resumed) == 3
    for record, microbatches in zip(records[2:], resumed):
        assert _same(_from_log(header, record), microbatches)


def test_a_skipped_step_is_logged_with_its_batch_and_the_order_moves_on(tmp_path, corpora, monkeypatch,
                                                                        one_thread):
    monkeypatch.setenv("HETPIPE_FAULT", "nan@grads:step=2")
    train(_cfg(corpora[0], train_iters=3), tmp_path / "run")
    monkeypatch.delenv("HETPIPE_FAULT")
    _, records = read_sample_log(tmp_path / "run")
    assert records["applied"].tolist() == [1, 0, 1]
    loader = MicrobatchLoader(corpora[0], "byte", 16, 8, 2, 512, seed=1234)
    for record in records:
        loader.next_step()
        assert record["sample"].tolist() == loader.sampler.last_batch[0].tolist()


def test_a_run_dir_holding_another_layout_is_refused_on_resume(tmp_path, corpora):
    def write(global_batch_size, start, steps):
        loader = MicrobatchLoader(corpora[0], "byte", 16, global_batch_size, 2, 512)
        log = SampleLog(tmp_path, loader, seed=1234, start_step=start)
        for step in steps:
            loader.next_step()
            log.record(step, applied=True)
        log.close()

    write(8, 0, [1, 2, 3])
    with pytest.raises(ConfigError, match="holds records of another layout"):
        write(4, 2, [3])
    write(4, 0, [1])  # a fresh run starts the file anew, whatever it held
    assert read_sample_log(tmp_path)[1]["step"].tolist() == [1]
