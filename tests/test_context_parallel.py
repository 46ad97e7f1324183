"""Context parallelism over real gloo processes gives CP1's gradients.

One spawn of CP ranks per degree (2 and 4) runs every case: each rank builds
the whole tiny model twice from one seed, runs the CP1 reference on the whole
sequence in its own process, and the CP-sharded forward and backward with
the other ranks (hetpipe.parallel.context); the CP gradients are summed over
the group and divided by C, as the DP x CP gradient reduction does. Cases:
both attention exchanges (ring, all-gather), several sequence lengths, with
and without document masking (reset_attention_mask + reset_position_ids), the
model whole and cut into two pipeline chunks.

Tolerance: 1e-5 of each parameter's largest gradient entry, the issue's
bound. CP changes only the order of fp32 sums (the softmax merged block by
block, K/V gradients summed over ranks), so the error is a few eps times
the sum lengths (64 keys here): measured below 1e-6.
"""
from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
from multiproc import CTX, collect

from hetpipe.errors import ConfigError
from hetpipe.models import build_model, model_preset
from hetpipe.models.context_hooks import use_context_parallel
from hetpipe.models.documents import DocumentRule
from hetpipe.models.transformer import set_document_masking
from hetpipe.parallel.context import ContextShard, block_forward, block_mask, chunk_length, merge

CFG = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
           vocab_size=64)
EOD = 3
SEQS = {2: (8, 20, 64), 4: (16, 64)}
RTOL = 1e-5


def _batch(seq: int, docs: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seq)
    tokens = torch.randint(4, CFG["vocab_size"], (2, seq + 1), generator=gen)
    if docs:  # documents of uneven lengths, one crossing every chunk boundary
        tokens[0, [seq // 3, seq // 2 + 1]] = EOD
        tokens[1, [1, seq - 3]] = EOD
    return tokens


def _model(docs: bool, units=None):
    model = build_model(model_preset("tiny_llama", **CFG), seed=7, units=units)
    if docs:
        set_document_masking(model, DocumentRule(EOD, True, True))
    return model


def _loss(chunks, tokens):
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    x = inputs
    for chunk in chunks[:-1]:
        x = chunk(x, tokens=inputs)
    return chunks[-1](x, labels, tokens=inputs)


def _grads(chunks) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.grad.clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()}


def _case(shard: ContextShard, seq: int, docs: bool, split: bool) -> dict:
    """Largest relative gradient error of CP against CP1, and the two losses."""
    units = [(0, 2), (2, 4)] if split else [None]
    tokens = _batch(seq, docs)
    reference = [_model(docs, u) for u in units]
    ref_loss = _loss(reference, tokens)
    ref_loss.backward()
    cp = [_model(docs, u) for u in units]
    for chunk in cp:
        use_context_parallel(chunk, shard)
    loss = _loss(cp, tokens)
    loss.backward()
    grads = _grads(cp)
    for g in grads.values():
        dist.all_reduce(g, group=shard.group)
        g /= shard.size
    summed = loss.detach().clone()
    dist.all_reduce(summed, group=shard.group)
    errors = {n: float((g - r).abs().max() / r.abs().max()) for (n, g), r in zip(grads.items(), _grads(reference).values())}
    return {"error": max(errors.values()), "worst": max(errors, key=errors.get),
            "loss": float(summed / shard.size), "ref_loss": float(ref_loss)}


def _cases(world: int):
    for method in ("allgather", "ring"):
        for seq in SEQS[world]:
            for docs in (False, True):
                yield method, seq, docs, seq == 64


def _rank_main(rank: int, world: int, init_file: str, queue) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        try:
            out = {case: _case(ContextShard(world, rank, dist.group.WORLD, case[0]), *case[1:])
                   for case in _cases(world)}
        finally:
            dist.destroy_process_group()
        queue.put((rank, "ok", out))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def _spawn(world: int, tmp_path_factory) -> dict:
    init_file = str(tmp_path_factory.mktemp(f"cp{world}") / "store")
    queue = CTX.Queue()
    procs = [CTX.Process(target=_rank_main, args=(r, world, init_file, queue), daemon=True) for r in range(world)]
    return collect(procs, queue, timeout=300)


@pytest.fixture(scope="module")
def cp2(tmp_path_factory) -> dict:
    return _spawn(2, tmp_path_factory)


@pytest.fixture(scope="module")
def cp4(tmp_path_factory) -> dict:
    return _spawn(4, tmp_path_factory)


def _check(results: dict, world: int) -> None:
    for case in _cases(world):
        for rank in range(world):
            got = results[rank][case]
            assert got["error"] <= RTOL, f"CP{world} {case} rank {rank}: {got['worst']} off by {got['error']:.2e}"
            assert got["loss"] == pytest.approx(got["ref_loss"], rel=RTOL), (case, got)


def test_cp2_gradients_equal_cp1(cp2):
    _check(cp2, 2)


def test_cp4_gradients_equal_cp1(cp4):
    _check(cp4, 4)


# -- single-process pieces ----------------------------------------------------------

def test_load_balanced_chunks():
    """Rank i of C holds chunks i and 2C-1-i; together the ranks hold every position once."""
    shards = [ContextShard(4, r) for r in range(4)]
    assert shards[0].indices(16).tolist() == [0, 1, 14, 15]
    assert shards[3].indices(16).tolist() == [6, 7, 8, 9]
    assert sorted(torch.cat([s.indices(16) for s in shards]).tolist()) == list(range(16))
    x = torch.arange(16).view(1, 16)
    assert shards[1].shard(x).tolist() == [[2, 3, 12, 13]]


def test_sequence_must_split_into_two_chunks_per_rank():
    with pytest.raises(ConfigError, match="multiple of 2 x partition.cp"):
        chunk_length(12, 4)
    with pytest.raises(ConfigError, match="cp_method"):
        ContextShard(2, 0, method="ulysses")


def test_lse_merge_is_exact():
    """Attention over all keys equals two blocks of keys merged by log-sum-exp."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=gen) for _ in range(3))
    index = torch.arange(6)
    mask = block_mask(index, index, None)
    whole, lse = block_forward(q, k, v, mask, 0.5)
    a = block_forward(q, k[:, :, :3], v[:, :, :3], mask[:, :3], 0.5)
    b = block_forward(q, k[:, :, 3:], v[:, :, 3:], mask[:, 3:], 0.5)
    merged, merged_lse = merge(*a, *b)
    torch.testing.assert_close(merged, whole)
    torch.testing.assert_close(merged_lse, lse)


def test_a_cp_slice_with_no_counted_tokens_adds_zero_not_nan():
    """EOD masking can leave a CP rank's slice without a counted label; its
    term is 0 (the microbatch's loss is the other slices' sum over the whole
    count) and its gradients finite."""
    from hetpipe.models.context_hooks import context_loss
    from hetpipe.models.loss import IGNORE_INDEX
    model = _model(False)
    labels = torch.randint(0, CFG["vocab_size"], (2, 8))
    shard = ContextShard(2, 0)
    labels[:, shard.indices(8)] = IGNORE_INDEX
    hidden = torch.randn(2, 4, CFG["hidden_size"], requires_grad=True)
    loss = context_loss(model.head, hidden, labels, shard)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(hidden.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in model.head.parameters() if p.grad is not None)
