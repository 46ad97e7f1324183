"""Tensor (and sequence) parallelism over two real gloo processes matches the single-process model.

One pair of spawned ranks runs every scenario once (a module fixture); the
tests below check its numbers. Each rank builds the unsharded chunk as the
reference and the TP=2 shard of the same chunk from the same seed, so every
comparison is between one process's single-rank math and the two ranks'
sharded math.
"""
from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
from multiproc import CTX, collect

from hetpipe.errors import ConfigError
from hetpipe.models import build_model, model_preset
from hetpipe.models.layers import fuse_elementwise
from hetpipe.models.parallelize import gate_up_rule, parallelize_tensor, qkv_rule
from hetpipe.checkpoint.tp_slices import full_tensor, gather_full_state_dict, shard_full_state_dict, shard_tensor
from hetpipe.parallel.tp_shards import finalize_tensor_parallel_grads, tp_param_spec, tp_sq_norm_share

TP = 2
SMALL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, vocab_size=128)
CONFIGS = {
    "llama_gqa": ("tiny_llama", dict(SMALL, num_query_groups=2)),
    "llama_kv_replicated": ("tiny_llama", dict(SMALL, num_query_groups=1)),
    "qwen2_bias_tied": ("tiny_qwen2", dict(SMALL, num_query_groups=2)),
    "qwen2_kv_replicated": ("tiny_qwen2", dict(SMALL, num_query_groups=1)),
    # QK-norm (whole on every rank, partial gradients summed) with a head size
    # of its own (48, not 64 / 4), and with its key head replicated.
    "qwen3_qk_norm": ("tiny_qwen3", dict(SMALL, num_query_groups=2)),
    "qwen3_kv_replicated": ("tiny_qwen3", dict(SMALL, num_query_groups=1)),
}
# (config, unit range or None for the whole model) - num_units is 4 here.
CHUNKS = {
    "llama_gqa/whole": ("llama_gqa", None),
    "llama_kv_replicated/whole": ("llama_kv_replicated", None),
    "qwen2_bias_tied/whole": ("qwen2_bias_tied", None),
    "llama_gqa/first": ("llama_gqa", (0, 2)),
    "llama_gqa/middle": ("llama_gqa", (1, 3)),
    "qwen2_bias_tied/last": ("qwen2_bias_tied", (2, 4)),
    "llama_gqa/head_only": ("llama_gqa", (3, 4)),
    "qwen2_kv_replicated/middle": ("qwen2_kv_replicated", (1, 3)),
    "qwen3_qk_norm/whole": ("qwen3_qk_norm", None),
    "qwen3_kv_replicated/middle": ("qwen3_kv_replicated", (1, 3)),
}
SP_CHUNKS = list(CHUNKS)
# Also run with train.fuse_elementwise's compiled kernels in the TP shards.
FUSED_CHUNKS = ["llama_gqa/whole", "qwen2_kv_replicated/middle", "qwen3_qk_norm/whole"]
BATCH, SEQ = 2, 16

# Tolerances follow from float32 rounding. TP adds up the same products as one
# process, only in another order (each rank's partial sum, then the
# all-reduce); SP and the fused kernels move more sums around the same way.
# Reordering a float32 sum of n terms moves it by at most about n * eps
# relative to the terms' magnitudes (Higham, "Accuracy and Stability of
# Numerical Algorithms", 2nd ed., sec. 4.2), so a case's tolerance is n * eps
# for the longest sum TP splits in its model (longest_split_sum: 192 terms
# here, 2.3e-5). Measured on an x86 CPU the largest error is 1.0e-6 (8 eps:
# llama_gqa/whole, a norm weight's gradient, a 32-token sum with
# cancellation); leaving out any one TP reduction is off by 0.9 or more.
EPS = torch.finfo(torch.float32).eps


def config(name: str):
    preset, overrides = CONFIGS[name]
    return model_preset(preset, **overrides)


def longest_split_sum(cfg) -> int:
    """The most terms of one sum TP splits over its ranks: the input gradient
    of a fused projection (over its q/k/v or gate/up output features) or the
    loss's normaliser (over the vocabulary)."""
    return max((cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim,
               2 * cfg.ffn_hidden_size, cfg.vocab_size)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise error relative to the reference's largest magnitude."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------
# Work done inside each rank
# ---------------------------------------------------------------------------

def _inputs(cfg, units):
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    labels[0, :3] = -100  # skipped by the loss, as F.cross_entropy does
    hidden = torch.randn(BATCH, SEQ, cfg.hidden_size, generator=gen)
    out_grad = torch.randn(BATCH, SEQ, cfg.hidden_size, generator=gen)
    first = units is None or units[0] == 0
    return (tokens if first else hidden), labels, out_grad


def _step(chunk, cfg, units, finalize):
    """One forward + backward; (loss or output, input gradient or None, logits or None)."""
    inputs, labels, out_grad = _inputs(cfg, units)
    if inputs.is_floating_point():
        inputs = inputs.clone().requires_grad_(True)
    last = units is None or units[1] == cfg.num_units
    if last:
        result = chunk(inputs, labels)
        result.backward()
    else:
        result = chunk(inputs)
        result.backward(out_grad)
    finalize(chunk)
    logits = None
    if last:
        with torch.no_grad():
            logits = chunk(inputs.detach())
    return result.detach(), (inputs.grad if inputs.is_floating_point() else None), logits


def job_grads(rank: int) -> dict:
    out = {}
    runs = [(case, sp, False) for sp in (False, True) for case in (SP_CHUNKS if sp else CHUNKS)]
    runs += [(case, sp, True) for sp in (False, True) for case in FUSED_CHUNKS]
    for case, sp, fused in runs:
        cfg_name, units = CHUNKS[case]
        cfg = config(cfg_name)
        ref = build_model(cfg, seed=5, units=units)
        tp = parallelize_tensor(build_model(cfg, seed=5, units=units), None, TP, rank, sequence_parallel=sp)
        if fused:  # the TP shards with fused elementwise kernels, against the eager reference
            fuse_elementwise(tp)
        r_out, r_in, r_logits = _step(ref, cfg, units, lambda c: None)
        t_out, t_in, t_logits = _step(tp, cfg, units, finalize_tensor_parallel_grads)
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        grads = {n: rel(full_tensor(p, p.grad), ref_grads[n]) for n, p in tp.named_parameters()}
        out[(case + ("+fused" if fused else ""), sp)] = {
            "output": rel(t_out, r_out),
            "input_grad": None if r_in is None else rel(t_in, r_in),
            "logits": None if r_logits is None else rel(t_logits, r_logits),
            "grads": grads,
            "names_match": sorted(grads) == sorted(ref_grads),
            "sharded": sorted(n for n, p in tp.named_parameters() if tp_param_spec(p) is not None),
        }
    # With SP the sequence must split evenly; refused before any collective.
    cfg = config("llama_gqa")
    tp = parallelize_tensor(build_model(cfg, seed=5), None, TP, rank, sequence_parallel=True)
    try:
        tp(torch.zeros(1, SEQ - 1, dtype=torch.int64))
        out["odd_sequence"] = "accepted"
    except ConfigError as exc:
        out["odd_sequence"] = str(exc)
    return out


def job_train(rank: int) -> dict:
    out = {}
    for cfg_name, sp in (("llama_gqa", False), ("qwen2_kv_replicated", False), ("qwen2_bias_tied", True),
                         ("qwen3_qk_norm", True)):
        cfg = config(cfg_name)
        gen = torch.Generator().manual_seed(7)
        batches = [torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=gen) for _ in range(10)]
        losses = {}
        for mode in ("single", "tp"):
            model = build_model(cfg, seed=3)
            if mode == "tp":
                model = parallelize_tensor(model, None, TP, rank, sequence_parallel=sp)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
            losses[mode] = []
            for batch in batches:
                loss = model(batch[:, :-1], batch[:, 1:])
                loss.backward()
                if mode == "tp":
                    finalize_tensor_parallel_grads(model)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses[mode].append(loss.item())
        out[(cfg_name, sp)] = losses
    return out


def job_checkpoint(rank: int) -> dict:
    out = {}
    for case in ("llama_gqa/whole", "llama_kv_replicated/whole", "qwen2_bias_tied/whole",
                 "qwen2_bias_tied/last", "qwen2_kv_replicated/middle", "qwen3_qk_norm/whole"):
        cfg_name, units = CHUNKS[case]
        cfg = config(cfg_name)
        full = build_model(cfg, seed=9, units=units).state_dict()
        tp = parallelize_tensor(build_model(cfg, seed=9, units=units), None, TP, rank)
        local = tp.state_dict()
        gathered = gather_full_state_dict(tp)
        sharded = shard_full_state_dict(tp, full)
        # Load a full checkpoint into a TP chunk initialised differently.
        other = parallelize_tensor(build_model(cfg, seed=99, units=units), None, TP, rank)
        other.load_state_dict(shard_full_state_dict(other, full))
        reloaded = gather_full_state_dict(other)
        # An optimizer-state-like tensor: shard then gather is the identity,
        # and the TP norm shares add up to the full tensor's squared norm.
        gen = torch.Generator().manual_seed(1)
        moments = {n: torch.randn(v.shape, generator=gen) for n, v in full.items()}
        params = dict(tp.named_parameters())
        round_trip = {n: full_tensor(params[n], shard_tensor(params[n], m)) for n, m in moments.items()}
        shares = {n: tp_sq_norm_share(params[n], shard_tensor(params[n], m)).reshape(1) for n, m in moments.items()}
        for s in shares.values():
            dist.all_reduce(s)
        out[case] = {
            "keys": sorted(gathered) == sorted(full),
            "gather_exact": all(torch.equal(gathered[n], full[n]) for n in full),
            "shard_exact": sorted(sharded) == sorted(local) and all(torch.equal(sharded[n], local[n]) for n in local),
            "reload_exact": all(torch.equal(reloaded[n], full[n]) for n in full),
            "moments_exact": all(torch.equal(round_trip[n], moments[n]) for n in moments),
            # Relative error per summed square (see test_checkpoint_helpers_round_trip_exactly).
            "norm_share": max(abs(float(shares[n]) / float(moments[n].double().pow(2).sum()) - 1) / moments[n].numel()
                              for n in moments),
            "local_shapes": {n: tuple(v.shape) for n, v in local.items()},
        }
    return out


JOBS = {"grads": job_grads, "train": job_train, "checkpoint": job_checkpoint}


def _rank_main(rank: int, world: int, init_file: str, queue) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        try:
            result = {name: job(rank) for name, job in JOBS.items()}
        finally:
            dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Rank 0's and rank 1's results of every job, from one spawned pair."""
    init_file = str(tmp_path_factory.mktemp("tp") / "store")
    queue = CTX.Queue()
    procs = [CTX.Process(target=_rank_main, args=(r, TP, init_file, queue), daemon=True) for r in range(TP)]
    return collect(procs, queue, timeout=240)


# ---------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("case", list(CHUNKS) + [c + "+fused" for c in FUSED_CHUNKS])
def test_loss_and_every_gradient_match_single_process(results, case, sp):
    if sp and case.removesuffix("+fused") not in SP_CHUNKS:
        pytest.skip("not run with sequence parallelism")
    tol = longest_split_sum(config(CHUNKS[case.removesuffix("+fused")][0])) * EPS
    for rank in range(TP):
        r = results[rank]["grads"][(case, sp)]
        assert r["names_match"]
        assert r["output"] <= tol, f"rank {rank}: output off by {r['output']:.2e}"
        if r["input_grad"] is not None:
            assert r["input_grad"] <= tol, f"rank {rank}: input gradient off by {r['input_grad']:.2e}"
        if r["logits"] is not None:
            assert r["logits"] <= tol, f"rank {rank}: gathered logits off by {r['logits']:.2e}"
        bad = {n: e for n, e in r["grads"].items() if not e <= tol}
        assert not bad, f"rank {rank}: gradients off: {bad}"
    # The big matrices are really split (and the norms are not).
    sharded = results[0]["grads"][(case, sp)]["sharded"]
    assert sharded and not any("norm" in n for n in sharded)


def test_sequence_parallel_refuses_an_uneven_sequence(results):
    assert "sequence length 15 is not divisible by the tensor-parallel size 2" in results[0]["grads"]["odd_sequence"]


@pytest.mark.parametrize("key", [("llama_gqa", False), ("qwen2_kv_replicated", False), ("qwen2_bias_tied", True),
                                 ("qwen3_qk_norm", True)],
                         ids=["llama_gqa", "qwen2_kv_replicated", "qwen2_tied_sp", "qwen3_qk_norm_sp"])
def test_ten_adamw_steps_match_single_process_losses(results, key):
    # The bound of one step's sums (see EPS); measured: 2.5 eps after ten steps.
    tol = longest_split_sum(config(key[0])) * EPS
    for rank in range(TP):
        losses = results[rank]["train"][key]
        assert len(losses["tp"]) == 10
        errors = [abs(a - b) / abs(b) for a, b in zip(losses["tp"], losses["single"])]
        assert max(errors) <= tol, (losses, errors)
    # It trained, and both TP ranks report the same loss.
    assert results[0]["train"][key]["tp"][-1] < results[0]["train"][key]["tp"][0]
    assert results[0]["train"][key]["tp"] == results[1]["train"][key]["tp"]


@pytest.mark.parametrize("case", ["llama_gqa/whole", "llama_kv_replicated/whole", "qwen2_bias_tied/whole",
                                  "qwen2_bias_tied/last", "qwen2_kv_replicated/middle", "qwen3_qk_norm/whole"])
def test_checkpoint_helpers_round_trip_exactly(results, case):
    for rank in range(TP):
        r = results[rank]["checkpoint"][case]
        assert r["keys"] and r["gather_exact"] and r["shard_exact"] and r["reload_exact"] and r["moments_exact"], r
        # The shares are float32 sums of n positive squares (no cancellation),
        # so each differs from the float64 total by at most n * eps relative.
        assert r["norm_share"] <= EPS
    cfg = config(CHUNKS[case][0])
    shapes = results[0]["checkpoint"][case]["local_shapes"]
    d, h = cfg.head_dim, cfg.hidden_size
    for name, shape in shapes.items():
        if name.endswith("qkv.weight"):
            kv = max(cfg.num_query_groups // TP, 1)
            assert shape == ((cfg.num_attention_heads // TP + 2 * kv) * d, h)
        elif name.endswith("gate_up.weight"):
            assert shape == (2 * cfg.ffn_hidden_size // TP, h)
        elif name in ("embedding.weight", "head.output.weight"):
            assert shape == (cfg.vocab_size // TP, h)


def test_gate_up_shard_keeps_gate_and_up_halves():
    """Each rank's fused gate_up holds its gate rows then its up rows."""
    cfg = config("llama_gqa")
    rule = gate_up_rule(cfg, TP)
    f, per = cfg.ffn_hidden_size, cfg.ffn_hidden_size // TP
    assert rule.index(1).tolist() == list(range(per, 2 * per)) + list(range(f + per, f + 2 * per))
    qkv = qkv_rule(config("llama_kv_replicated"), TP)
    d = cfg.head_dim
    # 4 query heads, 1 KV head: rank 1 has query heads 2-3 and the (replicated) KV head 0.
    assert qkv.index(1).tolist() == list(range(2 * d, 4 * d)) + list(range(4 * d, 6 * d))
    assert qkv.kv_replicas == 2


@pytest.mark.parametrize("overrides, tp, problem", [
    (dict(num_attention_heads=4, num_query_groups=2), 3, "num_attention_heads=4 is not divisible"),
    (dict(num_attention_heads=12, num_query_groups=4, hidden_size=96), 3, "num_query_groups=4"),
    (dict(num_attention_heads=4, num_query_groups=2, vocab_size=129), 2, "vocab_size=129 is not divisible"),
    (dict(num_attention_heads=4, num_query_groups=2, ffn_hidden_size=97), 2, "ffn_hidden_size=97"),
])
def test_bad_tensor_parallel_sizes_are_refused(overrides, tp, problem):
    cfg = model_preset("tiny_llama", **dict(SMALL, **overrides))
    chunk = build_model(cfg, seed=0)
    with pytest.raises(ConfigError, match=problem):
        parallelize_tensor(chunk, None, tp, 0)
    assert not hasattr(chunk, "tp_size")


def test_tp_size_one_is_the_unchanged_model():
    cfg = config("qwen2_bias_tied")
    ref = build_model(cfg, seed=2)
    chunk = parallelize_tensor(build_model(cfg, seed=2), None, 1, 0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(chunk(tokens, tokens), ref(tokens, tokens))
    finalize_tensor_parallel_grads(chunk)
    assert (chunk.tp_size, chunk.tp_rank, chunk.tp_group) == (1, 0, None)
    assert all(torch.equal(v, ref.state_dict()[n]) for n, v in gather_full_state_dict(chunk).items())
