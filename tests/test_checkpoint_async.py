"""Asynchronous saves: the step waits for a snapshot only, a failed background
write is one error on the main thread, and a rank killed mid-save leaves the
previous checkpoint loadable.
"""
import errno
import os
import threading

import pytest
import torch
from safetensors.torch import load_file

import hetpipe.checkpoint.saver as saver_module
from conftest import run_cli, run_pretrain
from hetpipe.checkpoint import CheckpointConfig, CheckpointError, CheckpointSaver, latest_checkpoint, load_checkpoint
from hetpipe.checkpoint.st_io import write_safetensors
from hetpipe.models import build_model, model_preset
from hetpipe.schema.pretrain_config import OptimizerConfig
from hetpipe.training.rank_setup import build_optimizer

pytestmark = [pytest.mark.timeout(400), pytest.mark.usefixtures("one_thread")]

CPU = torch.device("cpu")
LLAMA = model_preset("tiny_llama", hidden_size=64, ffn_hidden_size=160)


def _trained():
    model = build_model(LLAMA, seed=1234)
    opt = build_optimizer([model], OptimizerConfig(), CPU)
    tokens = torch.randint(0, LLAMA.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _saver(save_dir, **kwargs):
    return CheckpointSaver(CheckpointConfig(save_dir=str(save_dir), **kwargs), "run", model_cfg=LLAMA)


def test_save_returns_before_the_write_and_the_checkpoint_holds_the_snapshot(tmp_path, monkeypatch):
    release = threading.Event()
    real = saver_module.write_safetensors

    def held_write(*args, **kwargs):
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(saver_module, "write_safetensors", held_write)
    model, opt = _trained()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saver = _saver(tmp_path)
    saver.save(1, [model], opt, {"consumed_samples": 8})  # returns with the write held back
    assert not (tmp_path / "iter_0000001").exists()
    with torch.no_grad():  # training goes on and changes the weights
        for p in model.parameters():
            p.add_(1.0)
    release.set()
    assert saver.wait() == tmp_path / "iter_0000001"
    saver.close()
    other = build_model(LLAMA, seed=5)
    load_checkpoint(tmp_path, [other])
    assert all(torch.equal(t, saved[k]) for k, t in other.state_dict().items())


def test_a_synchronous_save_is_committed_when_save_returns(tmp_path):
    model, opt = _trained()
    saver = _saver(tmp_path, async_save=False)
    saver.save(1, [model], opt, {"consumed_samples": 8})
    assert (tmp_path / "iter_0000001" / "manifest.json").is_file()
    saver.close()


def test_a_failed_background_write_is_one_error_at_the_next_save_wait_or_close(tmp_path, monkeypatch):
    model, opt = _trained()
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    saver = _saver(not_a_dir)
    saver.save(1, [model], opt, {})
    with pytest.raises(CheckpointError) as err:
        saver.wait()
    assert str(err.value) == (f"checkpoint of step 1 could not be written to {not_a_dir / 'iter_0000001.tmp'}: "
                              f"Not a directory: {not_a_dir / 'iter_0000001.tmp'}")

    def disk_full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(saver_module, "write_safetensors", disk_full)
    saver = _saver(tmp_path / "ckpt")
    saver.save(1, [model], opt, {})
    with pytest.raises(CheckpointError, match=r"checkpoint of step 1 could not be written to .*: "
                                              r"No space left on device: .*model-rank00000\.safetensors$"):
        saver.save(2, [model], opt, {})  # the next save reports the last one's failure
    saver.save(3, [model], opt, {})
    with pytest.raises(CheckpointError, match="checkpoint of step 3 could not be written"):
        saver.close()  # the end of training too
    assert latest_checkpoint(tmp_path / "ckpt") is None


def test_the_writer_writes_safetensors_that_safetensors_reads(tmp_path):
    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).bfloat16(), "i64": torch.arange(4),
               "scalar": torch.tensor(2.0), "empty": torch.zeros(0, 3), "u8": torch.arange(3, dtype=torch.uint8)}
    record = write_safetensors(tmp_path / "x.safetensors", tensors, {"note": "hi"})
    assert record["size"] == (tmp_path / "x.safetensors").stat().st_size
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())


# -- a rank killed in the middle of an asynchronous save ------------------------------

COMMON = ["+model=tiny_llama", "model.hidden_size=64", "model.ffn_hidden_size=160", "train.seq_length=32",
          "train.micro_batch_size=2", "train.global_batch_size=8", "logging.progress=false",
          "cluster=cpu_mixed", "partition.layers=[2,2]", "train.train_iters=6", "checkpoint.save_interval=2",
          "checkpoint.keep_last=0"]


def test_a_rank_killed_during_an_async_save_leaves_the_previous_checkpoint(tmp_path, corpus_prefix):
    save_dir = tmp_path / "ckpt"
    args = [*COMMON, f"data.path={corpus_prefix}", f"checkpoint.save_dir={save_dir}"]
    proc = run_cli(["-m", "hetpipe.pretrain", *args, f"hydra.run.dir={tmp_path / 'a'}"], timeout=300,
                   env={"HETPIPE_FAULT": "kill@save:rank=1:step=4"})
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert sorted(p.name for p in save_dir.iterdir()) == ["iter_0000002", "iter_0000004.tmp", "latest"]
    assert latest_checkpoint(save_dir) == save_dir / "iter_0000002"

    proc, rows = run_pretrain(tmp_path / "b", [*args, "checkpoint.resume=latest"], timeout=300)
    assert f"resumed from {save_dir / 'iter_0000002'} after step 2" in proc.stdout
    assert [r["step"] for r in rows] == [3, 4, 5, 6]
    # The leftover was ignored on resume and replaced by this run's own save of step 4.
    assert sorted(p.name for p in save_dir.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000006", "latest"]
