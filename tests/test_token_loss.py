"""data.eod_mask_loss and the loss it makes: the mean over every counted token
of the global batch (Megatron's per-token loss), not the mean of the
microbatches' means, through the pipeline engine, the trainer and DP."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import run_pretrain
from hetpipe.data import IndexedDatasetWriter, MicrobatchLoader
from hetpipe.data.tokenizer import ByteTokenizer
from hetpipe.models import build_model, model_preset
from hetpipe.models.loss import IGNORE_INDEX
from hetpipe.models.split_backward import allow_retained_graphs
from hetpipe.training.engine import PipelineEngine
from hetpipe.pipeline.schedules import build_schedule
from hetpipe.schema.pretrain_config import resolve
from hetpipe.training.token_loss import counted_tokens, token_weights
from hetpipe.training.trainer import train

pytestmark = pytest.mark.timeout(300)

MICRO, SEQ = 2, 16
# Counted labels per microbatch: many, all, one, none (an all-masked microbatch has a NaN mean).
MASKED = [20, 0, MICRO * SEQ - 1, MICRO * SEQ]


def _model_cfg():
    cfg = model_preset("tiny_llama")
    cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size = 2, 64, 160
    return cfg


def _microbatches(cfg):
    gen = torch.Generator().manual_seed(5)
    batches = []
    for masked in MASKED:
        tokens, labels = (torch.randint(0, cfg.vocab_size, (MICRO, SEQ), generator=gen) for _ in range(2))
        where = torch.randperm(MICRO * SEQ, generator=gen)[:masked]
        labels.view(-1)[where] = IGNORE_INDEX
        batches.append((tokens, labels))
    return batches


def _reference(cfg, batches):
    """One process, no pipeline: sum of every counted token's loss over the batch / their count."""
    model = build_model(cfg, seed=3)
    total = sum(F.cross_entropy(model(t).flatten(0, 1), y.flatten(), reduction="sum") for t, y in batches)
    loss = total / sum(counted_tokens(batches))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _engine_step(cfg, batches, schedule, weighted):
    """One step of this rank's engine; (the step's loss, every gradient by name)."""
    if schedule == "zb_v":  # one rank, two chunks: the V's turn is handed over in-process, backwards split
        allow_retained_graphs()
        chunks = [build_model(cfg, seed=3, units=(0, 2)), build_model(cfg, seed=3, units=(2, cfg.num_units))]
    else:
        chunks = [build_model(cfg, seed=3)]
    actions = build_schedule(schedule, 1, len(batches), len(chunks))[0]
    engine = PipelineEngine(chunks, actions, {}, rank=0, pipeline_size=1, activation_shape=(MICRO, SEQ, 64),
                            activation_dtype=torch.float32, device=torch.device("cpu"))
    counts = counted_tokens(batches)
    loss_sum = engine.run_step(batches, token_weights(counts, sum(counts)) if weighted else None)
    return loss_sum / len(batches), {n: p.grad for c in chunks for n, p in c.named_parameters()}


@pytest.mark.parametrize("schedule", ["1f1b", "zb_v"])
def test_masked_tokens_weigh_the_same_in_every_microbatch(one_thread, schedule):
    cfg = _model_cfg()
    batches = _microbatches(cfg)
    ref_loss, ref_grads = _reference(cfg, batches)
    loss, grads = _engine_step(cfg, batches, schedule, weighted=True)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7, msg=name)
    # The mean of the microbatch means (the step's loss before the weights) is another number,
    # the one-token microbatch weighing as much as the full ones (the empty one left out: its
    # mean, and so theirs, would be NaN).
    old_loss, old_grads = _engine_step(cfg, batches[:3], schedule, weighted=False)
    assert abs(old_loss.item() - ref_loss.item()) > 1e-3
    assert not torch.allclose(old_grads["head.output.weight"], ref_grads["head.output.weight"], rtol=1e-3)


# A wide init: per-token losses far apart, so how the microbatches are weighted shows.
CFG = {"model": {"name": "tiny_llama", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
                 "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 512, "max_position_embeddings": 128,
                 "init_method_std": 0.5},
       "train": {"micro_batch_size": 2, "global_batch_size": 8, "seq_length": 32, "log_interval": 1, "seed": 9},
       "logging": {"progress": False}}


def _by_hand(cfg, part):
    """The token mean and the mean of microbatch means of the first global batch of ``part``,
    under the initial weights."""
    t = cfg.train
    loader = MicrobatchLoader(cfg.data.path, "byte", t.seq_length, t.global_batch_size, t.micro_batch_size,
                              cfg.model.vocab_size, seed=t.seed, split=cfg.data.split, part=part, eod_mask_loss=True)
    model = build_model(cfg.model, seed=t.seed)
    batches = loader.next_step()
    with torch.no_grad():
        sums = [F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum") for x, y in batches]
    counts = counted_tokens(batches)
    assert min(counts) < t.micro_batch_size * t.seq_length  # some labels were masked
    means = [s / c for s, c in zip(sums, counts)]
    return (sum(sums) / sum(counts)).item(), (sum(means) / len(means)).item()


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> str:
    """Byte-token documents of 1 to 12 tokens, each ending in EOD: a few to a dozen
    masked labels per 64-token microbatch."""
    rng = np.random.default_rng(0)
    prefix = tmp_path_factory.mktemp("short") / "short"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(3000):
            writer.add_document(np.append(rng.integers(0, 256, int(rng.integers(0, 12))), ByteTokenizer().eod))
    return str(prefix)


def test_the_logged_training_and_validation_losses_are_token_means(tmp_path, short_documents, one_thread):
    # lr 0: step 1 and the validation after it both see the initial weights.
    cfg = resolve({**CFG, "train": {**CFG["train"], "train_iters": 1, "eval_interval": 1, "eval_iters": 1},
                   "optimizer": {"lr": 0.0, "min_lr": 0.0},
                   "data": {"path": short_documents, "split": "90,10,0", "eod_mask_loss": True}})
    losses = train(cfg, tmp_path / "run")
    val = [r for r in _rows(tmp_path / "run") if "val_loss" in r][0]["val_loss"]
    for logged, part in ((losses[0], "train"), (val, "valid")):
        token_mean, mean_of_means = _by_hand(cfg, part)
        assert logged == pytest.approx(token_mean, rel=1e-6)
        assert abs(mean_of_means - token_mean) > 2e-4 * token_mean  # what was logged before: far off


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_data_parallel_replicas_add_their_counts(tmp_path, short_documents, one_thread):
    # Each replica's microbatches hold other counts: without the count summed over DP the two
    # replicas would divide by their own and the step would weigh their tokens unequally.
    cfg = resolve({**CFG, "train": {**CFG["train"], "train_iters": 3},
                   "data": {"path": short_documents, "eod_mask_loss": True}})
    single = train(cfg, tmp_path / "single")
    args = ["+model=tiny_llama", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
            "model.num_attention_heads=4", "model.num_query_groups=2", "model.vocab_size=512",
            "model.init_method_std=0.5",
            "train.micro_batch_size=2", "train.global_batch_size=8", "train.seq_length=32", "train.seed=9",
            "train.train_iters=3", "logging.progress=false", f"data.path={short_documents}", "data.eod_mask_loss=true",
            "cluster=cpu_homogeneous", "partition.dp=2"]
    _, rows = run_pretrain(tmp_path / "dp2", args)
    assert [r["loss"] for r in rows] == pytest.approx(single, rel=1e-5)
