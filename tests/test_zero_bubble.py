"""Zero-bubble pipeline parallelism (Qi et al., ICLR 2024): a backward split
into B (input gradient) and W (weight gradients, deferred) gives the same
losses and gradients as 1F1B, bit for bit in fp32, whatever the split,
transport or TP/DP layout inside the vendor groups."""
from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import run_pretrain
from hetpipe.errors import ConfigError
from hetpipe.models import build_model, model_preset
from hetpipe.models.recompute import set_recompute
from hetpipe.models.split_backward import backward_input, capture_output
from hetpipe.partitioner.plan_data import Plan, StagePlan
from hetpipe.models.precision import Bf16Weights, cast_parameters, fuse_linear_grads

pytestmark = pytest.mark.timeout(300)


def _grads_of(preset: str, precision: str, recompute: str, split: bool, **overrides):
    """One chunk holding the whole model, two microbatches; returns (loss per
    microbatch, every .grad, whether B left every weight untouched, hook count)."""
    cfg = model_preset(preset)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    chunk = build_model(cfg, seed=1)
    set_recompute(chunk, recompute)
    weights = Bf16Weights([chunk], fuse_linear_grads=True) if precision == "bf16" else None
    if precision == "bf16-pure":
        cast_parameters([chunk], torch.bfloat16)
        fuse_linear_grads([chunk])
    hooks = []
    for p in chunk.parameters():
        p.register_post_accumulate_grad_hook(hooks.append)
    gen = torch.Generator().manual_seed(3)
    losses, untouched = [], True
    for _ in range(2):
        tokens, labels = (torch.randint(0, cfg.vocab_size, (2, 16), generator=gen) for _ in range(2))
        with weights.swap(0) if weights else contextlib.nullcontext(), capture_output(chunk.embedding) as emb:
            loss = chunk(tokens, labels)
        losses.append(loss.detach())
        if not split:
            loss.backward()
            continue
        before = ([None if p.grad is None else p.grad.clone() for p in chunk.parameters()], len(hooks))
        _, weight_backward = backward_input(loss, None, emb[0])
        after = [p.grad for p in chunk.parameters()]
        untouched &= len(hooks) == before[1] and all(
            (a is None and b is None) or torch.equal(a, b) for a, b in zip(before[0], after))
        weight_backward.run()
    return losses, {n: p.grad for n, p in chunk.named_parameters()}, untouched, len(hooks)


@pytest.mark.parametrize("preset, precision, recompute, tied", [
    ("tiny_llama", "fp32", "none", False),
    ("tiny_qwen2", "fp32", "selective", False),  # qkv bias
    ("tiny_llama", "fp32", "none", True),        # embedding and head share a weight on one chunk
    ("tiny_llama", "bf16", "none", False),       # fused linears: W runs their queued GEMMs
    ("tiny_qwen2", "bf16", "selective", False),
    ("tiny_qwen3", "fp32", "none", False),       # QK-norm's weight products split between B and W
    ("tiny_qwen3", "bf16", "selective", True),
    ("tiny_llama", "bf16-pure", "none", False),  # fused linears adding into bf16 .grad
    ("tiny_qwen2", "bf16-pure", "selective", False),
])
def test_split_backward_is_bitwise_the_whole_backward(one_thread, preset, precision, recompute, tied):
    tie = {"share_embeddings_and_output_weights": tied}
    ref_losses, ref_grads, _, ref_hooks = _grads_of(preset, precision, recompute, split=False, **tie)
    losses, grads, untouched, hooks = _grads_of(preset, precision, recompute, split=True, **tie)
    assert untouched  # B computed no weight gradient and ran no gradient hook
    assert hooks == ref_hooks  # W ran each parameter's post-accumulate hooks as often as backward does
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert [n for n in ref_grads if not torch.equal(ref_grads[n], grads[n])] == []
    # No gradient carries autograd history: one that did (W's GEMMs recorded
    # under grad mode) held its microbatch's graph, +11 GiB per step on an H100.
    assert [n for n, g in grads.items() if g is not None and g.requires_grad] == []


def test_zb_h1_refuses_full_recompute():
    stages = [StagePlan(group="g", ranks=[0], layers=2, recompute="full")]
    with pytest.raises(ConfigError, match="recompute=full cannot run under schedule zb_h1"):
        Plan(stages=stages, schedule="zb_h1")


STEPS = 2
COMMON = ["+model=tiny_llama", "model.hidden_size=64", "model.ffn_hidden_size=160",
          f"train.train_iters={STEPS}", "train.seq_length=32", "train.micro_batch_size=2",
          "train.global_batch_size=8", "train.log_interval=1", "optimizer.lr=3e-3",
          "optimizer.clip_grad=0.5", "cluster.groups.0.device_type=CPU", "logging.progress=false"]


def _train(run_dir, data, *overrides):
    _, rows = run_pretrain(run_dir, [*COMMON, f"data.path={data}", *overrides], timeout=240)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return [(r["loss"], r["grad_norm"]) for r in rows]


# 1F1B runs several cases compare against, by (data, overrides): each runs once.
_PLAIN: dict[tuple[str, ...], list] = {}


def _plain(tmp_path_factory, data, *overrides):
    key = (str(data), *overrides)
    if key not in _PLAIN:
        _PLAIN[key] = _train(tmp_path_factory.mktemp("1f1b"), data, *overrides)
    return _PLAIN[key]


ZB_V = ["partition.schedule=zb_v", "partition.num_chunks=2"]
MIXED_2X2 = ["cluster=cpu_mixed", "cluster.groups.0.ranks_per_node=2", "cluster.groups.1.ranks_per_node=2"]


CASES = [  # (name, both runs' overrides, 1F1B's split, the zero-bubble run's schedule and split)
    # TP2 on one vendor group, TP1 on the other, over the tcp channel.
    ("pp2_tp2_tcp", ["cluster=cpu_mixed", "cluster.transport.kind=tcp", "cluster.groups.0.ranks_per_node=2",
                     "partition.tp_per_group=[2,1]"], ["partition.layers=[1,3]"],
     ["partition.schedule=zb_h1", "partition.layers=[1,3]"]),
    # Small buckets: the DP all-reduces launch from W's gradient hooks.
    ("pp2_dp2", [*MIXED_2X2, "partition.dp=2", "partition.grad_bucket_mb=0.01"], ["partition.layers=[1,3]"],
     ["partition.schedule=zb_h1", "partition.layers=[1,3]"]),
    # ZB-V against 1F1B with its own split: rank 1's chunks (virtual stages 1
    # and 2) hand over in-process, rank 0 holds the embedding and the loss. A
    # layer's TP degree changes its sums, so TP is the same on both groups.
    ("v_pp2_tcp", ["cluster=cpu_mixed", "cluster.transport.kind=tcp"], ["partition.layers=[1,3]"],
     [*ZB_V, "partition.layers=[1,1,1,1]"]),
    ("v_pp2_tp2", [*MIXED_2X2, "cluster.transport.kind=tcp", "partition.tp=2"], ["partition.layers=[1,3]"],
     [*ZB_V, "partition.layers=[1,1,1,1]"]),
    ("v_pp2_dp2", [*MIXED_2X2, "partition.dp=2", "partition.grad_bucket_mb=0.01"], ["partition.layers=[1,3]"],
     [*ZB_V, "partition.layers=[1,1,1,1]"]),
    # Four ranks, eight virtual stages, the vendor line crossed both ways; a
    # tied head on rank 0 beside its embedding: their gradients add locally.
    ("v_pp4_tied", [*MIXED_2X2, "model.num_layers=6", "model.share_embeddings_and_output_weights=true"],
     ["partition.layers=[1,2,2,1]"], [*ZB_V, "partition.layers=[0,1,1,1,1,1,1,0]"]),
]


@pytest.mark.parametrize("name, overrides, plain_split, zero_bubble", CASES, ids=[case[0] for case in CASES])
def test_zb_h1_is_bitwise_1f1b_across_vendor_groups(tmp_path, tmp_path_factory, corpus_prefix, name, overrides,
                                                    plain_split, zero_bubble):
    plain = _plain(tmp_path_factory, corpus_prefix, *overrides, *plain_split)
    assert _train(tmp_path / "zb", corpus_prefix, *overrides, *zero_bubble) == plain


def test_zb_v_needs_two_chunks_and_refuses_full_recompute():
    stages = [StagePlan(group="g", ranks=[0], layers=1) for _ in range(2)]
    with pytest.raises(ConfigError, match="zb_v places exactly two chunks per rank \\(a V\\), got num_chunks=1"):
        Plan(stages=stages, schedule="zb_v")
    with pytest.raises(ConfigError, match="recompute=full cannot run under schedule zb_v"):
        Plan(stages=[StagePlan(group="g", ranks=[0], layers=1, recompute="full")] * 2, schedule="zb_v", num_chunks=2)
    # The V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2.
    plan = Plan(stages=[StagePlan(group="g", ranks=[0], layers=1) for _ in range(4)], schedule="zb_v", num_chunks=2)
    assert [plan.placement.stage(r, c) for r in range(2) for c in range(2)] == [0, 3, 1, 2]


def test_zb_v_checkpoint_resumes_bitwise(tmp_path, corpus_prefix):
    # The manifest records each rank's chunks' units (stages r and 2P-1-r in a
    # V) and a resume checks them against the plan's placement.
    v = ["cluster=cpu_mixed", *ZB_V, "partition.layers=[1,1,1,1]", "model.share_embeddings_and_output_weights=true"]
    whole = [(r["loss"], r["grad_norm"]) for r in
             run_pretrain(tmp_path / "whole", [*COMMON, f"data.path={corpus_prefix}", *v, "train.train_iters=4"],
                          timeout=240)[1]]
    first = [*COMMON, f"data.path={corpus_prefix}", *v, "checkpoint.save_interval=2"]
    run_pretrain(tmp_path / "cut", first, timeout=240)
    _, rows = run_pretrain(tmp_path / "cut", [*first, "train.train_iters=4", "checkpoint.resume=latest"], timeout=240)
    assert [(r["loss"], r["grad_norm"]) for r in rows if r["step"] > STEPS] == whole[STEPS:]


def test_planner_chooses_a_v_that_runs_bitwise(tmp_path, tmp_path_factory, corpus_prefix):
    # plan=auto with planner.schedule=zb_v: the planner's V split (two chunks
    # per rank, rank 0 holding the embedding and the loss) runs as written and
    # equals 1F1B's losses and gradient norms bit for bit.
    mixed = ["cluster=cpu_mixed", "cluster.transport.kind=tcp"]
    plain = _plain(tmp_path_factory, corpus_prefix, *mixed, "partition.layers=[1,3]")
    assert _train(tmp_path / "v", corpus_prefix, *mixed, "plan=auto", "planner.schedule=zb_v") == plain
    plan = Plan.load(tmp_path / "v" / "plan.yaml")
    assert (plan.schedule, plan.num_chunks, len(plan.stages)) == ("zb_v", 2, 4)
    assert sum(s.layers for s in plan.stages) == 4 and plan.notes["predicted_step_s"] > 0
    assert plan.stages[0].ranks == plan.stages[3].ranks and plan.stages[1].ranks == plan.stages[2].ranks
