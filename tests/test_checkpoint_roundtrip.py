"""Checkpoints as a training run uses them: save, resume, reshard, keep the last K.

Several pipeline ranks are played in one process: each "rank" holds a unit
slice of the model and its own AdamW, microbatches flow through the slices in
order, and ``save_checkpoint`` is called for rank 1 ... then rank 0 with a
no-op barrier (rank 0 commits after the others wrote). The reference is the
same training without interruption, so resumed losses must match it exactly
on the same plan and within 1e-6 relative on another.
"""
import json
import os
import random
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

from hetpipe.checkpoint import (CheckpointConfig, latest_checkpoint, load_checkpoint, restore,
                                save_checkpoint, should_save)
from hetpipe.schema.pretrain_config import OptimizerConfig
from hetpipe.data import IndexedDatasetWriter, MicrobatchLoader
from hetpipe.training.gradients import GradNormClipper
from hetpipe.models import build_model, model_preset
from hetpipe.training.determinism import seed_everything
from hetpipe.training.rank_setup import build_optimizer
from hetpipe.training.trainer import lr_at

CPU = torch.device("cpu")
STEPS = 6
OPT = OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=2, clip_grad=0.5)
LLAMA = model_preset("tiny_llama", hidden_size=64, ffn_hidden_size=160)       # 4 layers, untied
QWEN2 = model_preset("tiny_qwen2", hidden_size=64, ffn_hidden_size=160)       # 4 layers, tied


def unit_ranges(layers: list[int]) -> list[tuple[int, int]]:
    """[start, stop) units per stage: the embedding joins the first, the head the last."""
    out, start = [], 0
    for i, n in enumerate(layers):
        stop = start + n + (i == 0) + (i == len(layers) - 1)
        out.append((start, stop))
        start = stop
    return out


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("data") / "random"
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(300):
            writer.add_document(rng.integers(0, 256, size=int(rng.integers(20, 200))))
    return str(prefix)


class Job:
    """One run under one split: per-rank slices and optimizers, one shared data order."""

    def __init__(self, cfg, layers, data_prefix, seed=1234):
        seed_everything(seed)
        self.cfg = cfg
        self.chunks = [build_model(cfg, seed=seed, units=r) for r in unit_ranges(layers)]
        self.optimizers = [build_optimizer([c], OPT, CPU) for c in self.chunks]
        self.loader = MicrobatchLoader(data_prefix, "byte", seq_length=32, global_batch_size=8,
                                       micro_batch_size=2, vocab_size=cfg.vocab_size, seed=1234)
        self.clipper = GradNormClipper(cfg, self.chunks, None)

    def step(self, step: int) -> float:
        lr = lr_at(step, OPT, STEPS)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
        microbatches = self.loader.next_step()
        total = 0.0
        for tokens, labels in microbatches:
            x = tokens
            for chunk in self.chunks[:-1]:
                x = chunk(x)
            loss = self.chunks[-1](x, labels)
            (loss / len(microbatches)).backward()
            total += loss.item()
        first, last = self.chunks[0], self.chunks[-1]
        if self.cfg.share_embeddings_and_output_weights and last.head.output is not None:
            # What sync_tied_embedding_grads does between the first and last rank.
            summed = first.embedding.weight.grad + last.head.output.weight.grad
            first.embedding.weight.grad.copy_(summed)
            last.head.output.weight.grad.copy_(summed)
        self.clipper.clip(OPT.clip_grad)
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return total / len(microbatches)

    def train(self, start: int, stop: int) -> list[float]:
        return [self.step(s) for s in range(start, stop)]

    def save(self, ckpt: CheckpointConfig, step: int):
        world = len(self.chunks)
        for rank in reversed(range(world)):  # rank 0 last: it commits
            path = save_checkpoint(ckpt, "unused-run-dir", step, [self.chunks[rank]], self.optimizers[rank],
                                   self.loader.state_dict(), rank, world, self.cfg, barrier=lambda: None)
        return path

    def restore(self, ckpt: CheckpointConfig) -> int:
        world = len(self.chunks)
        starts = {restore(ckpt, "unused-run-dir", [self.chunks[r]], self.optimizers[r], self.loader, r, world,
                          self.cfg) for r in range(world)}
        assert len(starts) == 1
        return starts.pop()


def test_resume_on_the_same_plan_is_bitwise(tmp_path, data_prefix):
    reference = Job(LLAMA, [2, 2], data_prefix).train(0, STEPS)
    ckpt = CheckpointConfig(save_dir=str(tmp_path / "ckpt"), save_interval=3, resume="latest")
    first = Job(LLAMA, [2, 2], data_prefix)
    losses = first.train(0, 3)
    first.save(ckpt, 3)
    # A fresh process: other init, fresh data order; everything must come from the checkpoint.
    resumed = Job(LLAMA, [2, 2], data_prefix, seed=99)
    start = resumed.restore(ckpt)
    assert start == 3
    losses += resumed.train(start, STEPS)
    assert losses == reference


@pytest.mark.parametrize("cfg", [LLAMA, QWEN2], ids=["untied", "tied"])
def test_reshard_2_2_to_3_1_continues_like_an_uninterrupted_run(tmp_path, data_prefix, cfg):
    reference = Job(cfg, [4], data_prefix).train(0, STEPS)
    ckpt = CheckpointConfig(save_dir=str(tmp_path / "ckpt"), resume="latest")
    first = Job(cfg, [2, 2], data_prefix)
    losses = first.train(0, 3)
    first.save(ckpt, 3)
    resumed = Job(cfg, [3, 1], data_prefix, seed=99)
    assert resumed.restore(ckpt) == 3
    losses += resumed.train(3, STEPS)
    assert losses == pytest.approx(reference, rel=1e-6)


def _state_by_name(chunks, optimizers):
    """Canonical name -> (weight, optimizer state) across the given ranks."""
    out = {}
    for chunk, opt in zip(chunks, optimizers):
        for name, p in chunk.named_parameters():
            if name == "head.output.weight" and chunk.cfg.share_embeddings_and_output_weights:
                name = "head.output.weight(tied copy)"
            out[name] = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
    return out


def test_model_and_optimizer_round_trip_bit_exact_into_any_split(tmp_path, data_prefix):
    job = Job(LLAMA, [2, 2], data_prefix)
    job.train(0, 2)  # real AdamW state: step, exp_avg, exp_avg_sq
    path = job.save(CheckpointConfig(save_dir=str(tmp_path)), 2)
    saved = _state_by_name(job.chunks, job.optimizers)
    for layers in ([2, 2], [3, 1], [4]):
        other = Job(LLAMA, layers, data_prefix, seed=7)
        for rank, (chunk, opt) in enumerate(zip(other.chunks, other.optimizers)):
            loaded = load_checkpoint(path, [chunk], opt, rank=rank, world_size=len(other.chunks))
            assert loaded.step == 2
        got = _state_by_name(other.chunks, other.optimizers)
        assert got.keys() == saved.keys()
        for name, (weight, state) in saved.items():
            assert torch.equal(got[name][0], weight), name
            assert state.keys() == got[name][1].keys() == {"step", "exp_avg", "exp_avg_sq"}
            for key in state:
                assert torch.equal(got[name][1][key], state[key]), (name, key)


def test_tied_embedding_is_saved_once_and_loaded_into_both_copies(tmp_path, data_prefix):
    job = Job(QWEN2, [2, 2], data_prefix)
    job.train(0, 2)
    path = job.save(CheckpointConfig(save_dir=str(tmp_path)), 2)
    with safe_open(str(path / "model-rank00000.safetensors"), "pt") as f:
        assert "embedding.weight" in f.keys()
    with safe_open(str(path / "model-rank00001.safetensors"), "pt") as f:
        assert not any(k.startswith("embedding") or k.startswith("head.output") for k in f.keys())
        assert "head.norm.weight" in f.keys()
    manifest = json.loads((path / "manifest.json").read_text())
    assert "head.output.weight" not in manifest["tensors"]
    assert "exp_avg/embedding.weight" in manifest["tensors"]

    embedding = job.chunks[0].embedding.weight
    state = job.optimizers[0].state[embedding]
    other = Job(QWEN2, [1, 3], data_prefix, seed=7)
    for rank, (chunk, opt) in enumerate(zip(other.chunks, other.optimizers)):
        load_checkpoint(path, [chunk], opt, rank=rank, world_size=2)
    copy = other.chunks[1].head.output.weight
    assert torch.equal(other.chunks[0].embedding.weight, embedding)
    assert torch.equal(copy, embedding)
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(other.optimizers[1].state[copy][key], state[key])
    whole = Job(QWEN2, [4], data_prefix, seed=7)
    load_checkpoint(path, whole.chunks, whole.optimizers[0])
    assert torch.equal(whole.chunks[0].embedding.weight, embedding)


def test_rng_restored_on_the_same_plan_only(tmp_path, data_prefix):
    job = Job(LLAMA, [4], data_prefix)
    job.train(0, 1)
    path = job.save(CheckpointConfig(save_dir=str(tmp_path)), 1)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    seed_everything(5)
    assert load_checkpoint(path, job.chunks, rank=0, world_size=1).rng_restored
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(3), expected[2])
    other = Job(LLAMA, [3, 1], data_prefix)
    assert not load_checkpoint(path, [other.chunks[0]], rank=0, world_size=2).rng_restored


def test_keep_last_and_latest(tmp_path, data_prefix):
    ckpt = CheckpointConfig(save_dir=str(tmp_path), save_interval=1, keep_last=2)
    job = Job(LLAMA, [2, 2], data_prefix)
    for step in range(1, 5):
        job.train(step - 1, step)
        job.save(ckpt, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "iter_0000004", "latest"]
    assert (tmp_path / "latest").read_text().strip() == "iter_0000004"
    assert latest_checkpoint(tmp_path) == tmp_path / "iter_0000004"
    assert sorted(p.name for p in (tmp_path / "iter_0000004").iterdir()) == [
        "manifest.json", "model-rank00000.safetensors", "model-rank00001.safetensors",
        "optim-rank00000.safetensors", "optim-rank00001.safetensors", "rng-rank00000.safetensors",
        "rng-rank00001.safetensors", "trainer_state.json"]
    state = json.loads((tmp_path / "iter_0000004" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["sampler"]["consumed_samples"] == 4 * 8


def test_restarting_from_an_older_checkpoint_keeps_abandoned_newer_ones_out_of_latest(tmp_path, data_prefix):
    ckpt = CheckpointConfig(save_dir=str(tmp_path), keep_last=1)
    job = Job(LLAMA, [4], data_prefix)
    job.train(0, 2)
    job.save(CheckpointConfig(save_dir=str(tmp_path / "old")), 2)
    job.train(2, 4)
    job.save(ckpt, 4)
    restarted = Job(LLAMA, [4], data_prefix)
    assert restarted.restore(CheckpointConfig(resume=str(tmp_path / "old"))) == 2
    restarted.train(2, 3)
    restarted.save(ckpt, 3)
    assert latest_checkpoint(tmp_path) == tmp_path / "iter_0000003"
    assert (tmp_path / "iter_0000004").is_dir()  # not this timeline's to delete


def test_should_save_and_fresh_start(tmp_path, data_prefix, capsys):
    every = CheckpointConfig(save_interval=4)
    assert [s for s in range(1, 11) if should_save(every, s, train_iters=10)] == [4, 8, 10]
    assert not any(should_save(CheckpointConfig(), s, 10) for s in range(1, 11))
    # A save_dir asks for checkpoints: the last step is saved without an
    # interval (as Megatron saves at the end whenever --save is set), and once
    # when the interval already lands on it.
    assert [s for s in range(1, 11) if should_save(CheckpointConfig(save_dir="c"), s, 10)] == [10]
    assert [s for s in range(1, 11) if should_save(CheckpointConfig(save_dir="c", save_interval=5), s, 10)] \
        == [5, 10]
    job = Job(LLAMA, [4], data_prefix)
    assert job.restore(CheckpointConfig(save_dir=str(tmp_path / "none"), resume="latest")) == 0
    assert "starting from scratch" in capsys.readouterr().out
    # save_dir defaults to <run_dir>/checkpoints
    save_checkpoint(CheckpointConfig(), tmp_path / "run", 1, job.chunks, job.optimizers[0],
                    job.loader.state_dict(), 0, 1, LLAMA)
    assert (tmp_path / "run" / "checkpoints" / "iter_0000001" / "manifest.json").is_file()


RANK_SCRIPT = """
import sys, torch, torch.distributed as dist
from hetpipe.checkpoint import CheckpointConfig, save_checkpoint
from hetpipe.schema.pretrain_config import OptimizerConfig
from hetpipe.models import build_model, model_preset
from hetpipe.training.rank_setup import build_optimizer
dist.init_process_group("gloo")
rank = dist.get_rank()
cfg = model_preset("tiny_llama", hidden_size=64, ffn_hidden_size=160)
chunk = build_model(cfg, seed=1234, units=[(0, 3), (3, 6)][rank])
opt = build_optimizer([chunk], OptimizerConfig(), torch.device("cpu"))
for step in (1, 2):
    save_checkpoint(CheckpointConfig(save_dir=sys.argv[1], keep_last=1), "run", step, [chunk], opt,
                    {"consumed_samples": 0}, rank, 2, cfg)
dist.destroy_process_group()
"""


def test_two_gloo_processes_save_one_checkpoint(tmp_path):
    """The real collective: two processes, the default world-group barrier, rank 0 commits."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(tmp_path)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), OMP_NUM_THREADS="1"))
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "latest"]
    whole = build_model(LLAMA, seed=1234)
    other = build_model(LLAMA, seed=5)
    load_checkpoint(tmp_path, [other])
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), other.state_dict().values()))
