"""Bad checkpoints fail loudly, by name, before anything is loaded.

Corrupted, truncated or missing shards, interrupted saves and checkpoints of
another model each end in one :class:`CheckpointError` sentence naming the
file (or tensor and shapes); the model is left as it was, and nothing is ever
unpickled.
"""
import json
import pickle

import pytest
import torch

import hetpipe.checkpoint.commit as commit_module
from hetpipe.checkpoint import (CheckpointConfig, CheckpointError, latest_checkpoint, load_checkpoint,
                                restore, save_checkpoint)
from hetpipe.schema.pretrain_config import OptimizerConfig
from hetpipe.models import build_model, model_preset
from hetpipe.training.rank_setup import build_optimizer

CPU = torch.device("cpu")
LLAMA = model_preset("tiny_llama", hidden_size=64, ffn_hidden_size=160)
SPLIT = [(0, 3), (3, 6)]  # [2, 2] layers
LOADER_STATE = {"consumed_samples": 8, "seed": 1234, "num_samples": 100, "global_batch_size": 8}


pytestmark = pytest.mark.usefixtures("one_thread")


def _ranks(cfg=LLAMA, split=SPLIT, seed=1234):
    chunks = [build_model(cfg, seed=seed, units=r) for r in split]
    return chunks, [build_optimizer([c], OptimizerConfig(), CPU) for c in chunks]


def _save(save_dir, step=1, cfg=LLAMA, ranks=None, only_ranks=None):
    """Save a [2, 2] pipeline after one AdamW step; ``only_ranks`` plays a crash of the others."""
    chunks, optimizers = ranks or _ranks(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
    chunks[1](chunks[0](tokens), tokens).backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad()
    ckpt = CheckpointConfig(save_dir=str(save_dir))
    for rank in only_ranks if only_ranks is not None else (1, 0):
        path = save_checkpoint(ckpt, "run", step, [chunks[rank]], optimizers[rank], LOADER_STATE, rank, 2, cfg,
                               barrier=lambda: None)
    return path


def _whole(cfg=LLAMA):
    model = build_model(cfg, seed=99)
    return model, build_optimizer([model], OptimizerConfig(), CPU)


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, before):
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_corrupted_shard_is_named_and_nothing_is_loaded(tmp_path):
    path = _save(tmp_path)
    shard = path / "model-rank00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    model, opt = _whole()
    before = _snapshot(model)
    with pytest.raises(CheckpointError, match=f"{shard} is corrupted: its sha256 differs"):
        load_checkpoint(path, [model], opt)
    assert _unchanged(model, before) and not opt.state
    # The rank that does not need the damaged shard is not stopped by it; the one that does is.
    chunks, optimizers = _ranks()
    load_checkpoint(path, [chunks[0]], optimizers[0], rank=0, world_size=2)
    with pytest.raises(CheckpointError, match="model-rank00001.safetensors is corrupted"):
        load_checkpoint(path, [chunks[1]], optimizers[1], rank=1, world_size=2)


def test_missing_and_truncated_shards_are_named(tmp_path):
    path = _save(tmp_path)
    (path / "optim-rank00000.safetensors").unlink()
    model, opt = _whole()
    load_checkpoint(path, [model])  # weights alone do not need the optimizer shard
    with pytest.raises(CheckpointError, match=r"checkpoint file .*optim-rank00000\.safetensors is missing"):
        load_checkpoint(path, [model], opt)
    shard = path / "model-rank00000.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError, match=rf"model-rank00000\.safetensors has {size - 100} bytes but "
                                              rf"manifest\.json records {size}"):
        load_checkpoint(path, [model])


def test_interrupted_save_is_never_latest_and_is_refused_by_name(tmp_path, capsys):
    good = _save(tmp_path, step=1)
    # Step 2: rank 1 wrote its files, rank 0 died before the manifest.
    _save(tmp_path, step=2, only_ranks=[1])
    tmp = tmp_path / "iter_0000002.tmp"
    assert tmp.is_dir() and not (tmp_path / "iter_0000002").exists()
    assert latest_checkpoint(tmp_path) == good
    model, _ = _whole()
    with pytest.raises(CheckpointError, match=f"{tmp} is an incomplete checkpoint"):
        load_checkpoint(tmp, [model])
    # Step 3: rank 0 died during the commit, after writing the manifest.
    def crash(*args):
        raise OSError("killed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(commit_module, "commit", crash)
        with pytest.raises(CheckpointError, match="the checkpoint of step 3 was not committed: .*killed"):
            _save(tmp_path, step=3)
    assert (tmp_path / "iter_0000003.tmp" / "manifest.json").is_file()
    assert latest_checkpoint(tmp_path) == good
    chunks, optimizers = _ranks()
    assert restore(CheckpointConfig(save_dir=str(tmp_path), resume="latest"), "run", [chunks[0]],
                   optimizers[0], None, 0, 2, LLAMA) == 1
    with pytest.raises(CheckpointError, match="iter_0000003.tmp is an incomplete checkpoint"):
        restore(CheckpointConfig(resume=str(tmp_path / "iter_0000003.tmp")), "run", [chunks[0]],
                optimizers[0], None, 0, 2, LLAMA)
    # The next successful save overwrites its own leftover and clears the others.
    _save(tmp_path, step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "iter_0000002", "latest"]
    # A directory whose manifest was removed is incomplete too.
    (good / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=f"{good} is an incomplete checkpoint: it has no manifest.json"):
        load_checkpoint(good, [model])


def test_different_model_shape_names_the_tensor_and_both_shapes(tmp_path):
    path = _save(tmp_path)
    wider = model_preset("tiny_llama", hidden_size=128, ffn_hidden_size=160)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, [build_model(wider, seed=0)])
    message = str(err.value)
    assert f"checkpoint {path} was written for a different model shape" in message
    assert "tensor embedding.weight has shape [512, 64] there but [512, 128] in this model" in message
    assert "model.hidden_size=64 there but 128 here" in message

    deeper = model_preset("tiny_llama", hidden_size=64, ffn_hidden_size=160, num_layers=5)
    with pytest.raises(CheckpointError, match=r"has no tensor layers\.4\.\S+, which this model needs "
                                              r"\(model\.num_layers=4 there but 5 here\)"):
        load_checkpoint(path, [build_model(deeper, seed=0, units=(5, 7))])
    other_rope = model_preset("tiny_llama", hidden_size=64, ffn_hidden_size=160, rotary_base=5e5)
    with pytest.raises(CheckpointError, match=r"written for a different model: model\.rotary_base=10000\.0 "
                                              r"there but 500000\.0 here"):
        load_checkpoint(path, [build_model(other_rope, seed=0)])


def test_unreadable_manifest_and_dangling_latest(tmp_path):
    path = _save(tmp_path)
    model, _ = _whole()
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{path / 'manifest.json'} is unreadable"):
        load_checkpoint(path, [model])
    (path / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="is not a hetpipe checkpoint manifest"):
        load_checkpoint(path, [model])
    (tmp_path / "latest").write_text("iter_0000009\n")
    with pytest.raises(CheckpointError, match=r"latest names 'iter_0000009', which is not a complete checkpoint"):
        load_checkpoint(tmp_path, [model])
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere", [model])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="neither a checkpoint nor a save directory"):
        load_checkpoint(empty, [model])


def test_nothing_is_unpickled(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    path = _save(tmp_path)
    model, opt = _whole()
    load_checkpoint(path, [model], opt)
    assert opt.state


def test_a_latest_pointer_of_random_bytes_is_refused_by_name(tmp_path):
    _save(tmp_path, step=1)
    (tmp_path / "latest").write_bytes(bytes(range(200, 256)) * 4)
    with pytest.raises(CheckpointError, match=r"latest holds 224 bytes that are not a checkpoint name "
                                              r"\(iter_NNNNNNN\): remove it"):
        latest_checkpoint(tmp_path)
