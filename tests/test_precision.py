"""bf16 mode (train.precision=bf16): bf16 working copies of fp32 main weights.

What a user would check: the weights that the optimizer and checkpoints see
stay fp32; gradients accumulate over microbatches in fp32; the forward really
runs in bf16 (activations crossing a stage boundary are bf16); a pipelined
bf16 run equals the single-process bf16 run bit for bit; and bf16 training
follows the fp32 loss curve closely.
"""

import pytest
import torch

from conftest import run_pretrain
from hetpipe.errors import ConfigError
from hetpipe.models import build_model
from hetpipe.models.model_config import ModelConfig
from hetpipe.models.precision import Bf16Weights, cast_parameters, fuse_linear_grads, resolve_precision

pytestmark = pytest.mark.timeout(300)

CFG = ModelConfig(name="t", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                  num_query_groups=2, vocab_size=64, max_position_embeddings=64)


def _batch(seed, n=3):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 64, (2, 16), generator=gen), torch.randint(0, 64, (2, 16), generator=gen))
            for _ in range(n)]


def test_modes_resolve_per_device_and_bad_names_are_refused():
    assert resolve_precision("auto", "cuda") == "bf16"
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("bf16-autocast", "cuda") == "bf16-autocast"
    with pytest.raises(ConfigError, match="train.precision='fp16'"):
        resolve_precision("fp16", "cuda")


def test_forward_runs_on_bf16_copies_and_grads_accumulate_in_fp32(one_thread):
    model = build_model(CFG, seed=1)
    names = [n for n, _ in model.named_parameters()]
    weights = Bf16Weights([model])
    seen = []
    hook = model.layers["1"].register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
    expected = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for tokens, labels in _batch(0):
        with weights.swap(0):
            loss = model(tokens, labels)
        loss.backward()
        # The same microbatch through an explicit bf16 replica gives the bf16
        # gradient that must have been added (as fp32) to the main weights.
        replica = build_model(CFG, seed=1)
        replica.load_state_dict(model.state_dict())
        for q in replica.parameters():  # parameters only: the RoPE buffer stays fp32
            q.data = q.data.to(torch.bfloat16)
        replica(tokens, labels).backward()
        for n, p in replica.named_parameters():
            expected[n] += p.grad.float()
    hook.remove()
    assert seen and all(d == (torch.bfloat16, torch.bfloat16) for d in seen)
    # Outside the swap the model holds its fp32 parameters, by the same names.
    assert [n for n, _ in model.named_parameters()] == names
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=0, atol=0, msg=n)
    # refresh() recasts the copies from updated main weights.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    weights.refresh()
    for p, w in zip(model.parameters(), weights.copies()):
        assert torch.equal(w, p.detach().to(torch.bfloat16))


def test_bf16_pure_fused_weight_gradients_add_into_bf16_grads_and_fire_hooks(one_thread):
    """bf16-pure's fusion: each decoder linear's weight gradient is one GEMM adding
    into the bf16 .grad (one rounding per microbatch, not two), hooks once per
    microbatch, the parameters untouched in name, type and dtype."""
    fused, plain = build_model(CFG, seed=1), build_model(CFG, seed=1)
    cast_parameters([fused, plain], torch.bfloat16)
    names = [n for n, _ in fused.named_parameters()]
    fuse_linear_grads([fused])
    linear = fused.layers["0"].mlp.down.weight
    calls = []
    linear.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
    reference = build_model(CFG, seed=1)  # fp32, from the bf16 weights: what both approximate
    with torch.no_grad():
        for a, b in zip(reference.parameters(), plain.parameters()):
            a.copy_(b.float())
    for tokens, labels in _batch(3):
        for model in (fused, plain, reference):
            model(tokens, labels).backward()
    assert len(calls) == 3 and torch.equal(calls[-1], linear.grad)
    assert [n for n, _ in fused.named_parameters()] == names
    assert all(isinstance(p, torch.nn.Parameter) and p.dtype == p.grad.dtype == torch.bfloat16
               for p in fused.parameters())
    for (n, a), (_, b) in zip(fused.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=1e-3, msg=n)
    # One rounding per microbatch instead of two: every linear's gradient nearer the fp32 one.
    errors = {}
    for (n, a), (_, b), (_, r) in zip(fused.named_parameters(), plain.named_parameters(), reference.named_parameters()):
        if "layers" in n and n.endswith(".weight") and a.dim() == 2:
            errors[n] = ((a.grad.float() - r.grad).norm().item(), (b.grad.float() - r.grad).norm().item())
    assert len(errors) == 8 and all(fused_error < plain_error for fused_error, plain_error in errors.values())


def test_fused_weight_gradients_land_in_fp32_grads_and_fire_hooks(one_thread):
    fused, plain = build_model(CFG, seed=1), build_model(CFG, seed=1)
    fused_w, plain_w = Bf16Weights([fused], fuse_linear_grads=True), Bf16Weights([plain])
    linear = fused.layers["0"].mlp.down.weight
    calls = []
    linear.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
    for tokens, labels in _batch(2):
        for model, weights in ((fused, fused_w), (plain, plain_w)):
            with weights.swap(0):
                loss = model(tokens, labels)
            loss.backward()
    # The hook ran once per microbatch, after that microbatch's accumulation.
    assert len(calls) == 3 and torch.equal(calls[-1], linear.grad)
    assert not torch.equal(calls[0], calls[1])
    # Outside swap() the linear layers are plain nn.Linear again.
    assert "forward" not in vars(fused.layers["0"].mlp.down)
    for (n, a), (_, b) in zip(fused.named_parameters(), plain.named_parameters()):
        assert a.grad.dtype == torch.float32
        # fp32 accumulation versus bf16-rounded per-microbatch gradients.
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=1e-4, msg=n)


STEPS = 12
COMMON = ["+model=tiny_llama", "model.hidden_size=64", "model.ffn_hidden_size=160", "model.num_layers=4",
          "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=8", "train.log_interval=6",
          "optimizer.lr=3e-3", "optimizer.lr_warmup_iters=2", f"optimizer.lr_decay_iters={STEPS}",
          "logging.progress=false", "cluster.groups.0.device_type=CPU"]


def _train(tmp_path, name, data, *overrides):
    proc, rows = run_pretrain(tmp_path / name, [*COMMON, f"data.path={data}", *overrides])
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows}, proc.stdout


def _split_resumed_run_equals_single(tmp_path, data, precision, steps):
    """A single-process run, and the same run pipelined across the vendor
    boundary in two halves with a checkpoint between (the resume must rebuild
    whatever the mode derives from the loaded weights): their per-step losses
    and gradient norms must be equal. Returns the single run's metrics and
    output, and the checkpoint written halfway."""
    single, out = _train(tmp_path, "single", data, f"train.precision={precision}", f"train.train_iters={steps}")
    ckpt = tmp_path / "ckpt"
    mixed = [f"train.precision={precision}", "cluster=cpu_mixed", "cluster.transport.kind=tcp",
             "partition.layers=[1,3]", f"checkpoint.save_dir={ckpt}"]
    first, _ = _train(tmp_path, "mixed_a", data, *mixed, f"train.train_iters={steps // 2}",
                      f"checkpoint.save_interval={steps // 2}")
    second, resumed = _train(tmp_path, "mixed_b", data, *mixed, f"train.train_iters={steps}",
                             "checkpoint.resume=latest")
    assert "resumed from" in resumed
    assert {**first, **second} == single
    return single, out, ckpt / f"iter_{steps // 2:07d}"


def test_bf16_pipeline_across_vendors_equals_single_process_resumes_and_tracks_fp32(
        tmp_path, corpus_prefix):
    single, out, saved = _split_resumed_run_equals_single(tmp_path, corpus_prefix, "bf16", STEPS)
    assert ", bf16," in out  # the banner names the mode the ranks run
    # The checkpoint holds the fp32 main weights.
    from safetensors.torch import load_file
    shards = list(saved.glob("model-*.safetensors"))
    assert shards and all(t.dtype == torch.float32 for s in shards for t in load_file(s).values())

    # Data parallel with ZeRO-1: the fused gradients reach the DP reducer's hooks.
    dp, _ = _train(tmp_path, "dp", corpus_prefix, "train.precision=bf16", f"train.train_iters={STEPS}",
                   "cluster=cpu_homogeneous", "partition.dp=2", "optimizer.distributed=true")
    for step, (loss, _) in single.items():
        assert dp[step][0] == pytest.approx(loss, rel=2e-3), step

    fp32, _ = _train(tmp_path, "fp32", corpus_prefix, "train.precision=fp32", f"train.train_iters={STEPS}")
    assert fp32 != single  # bf16 really changed the arithmetic
    for step, (loss, _) in single.items():
        assert abs(loss - fp32[step][0]) / fp32[step][0] < 0.03, step
    assert single[STEPS][0] < single[1][0] - 1.0  # and it learns


def test_cast_parameters_keeps_buffers_and_tied_weights():
    tied = ModelConfig(name="t", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                       num_query_groups=2, vocab_size=64, max_position_embeddings=64,
                       share_embeddings_and_output_weights=True)
    model = build_model(tied, seed=1)
    reference = build_model(tied, seed=1)
    cast_parameters([model], torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.inv_freq.dtype == torch.float32  # RoPE frequencies stay fp32
    assert model.head.output_weight is model.embedding.weight
    for (n, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b.to(torch.bfloat16)), n


def test_bf16_pure_pipeline_equals_single_process_resumes_and_holds_bf16_state(tmp_path, corpus_prefix):
    """train.precision=bf16-pure (the pipelining peer's precision): bf16
    parameters, gradients, AdamW moments and checkpoints, the same bitwise
    parity across the vendor boundary and through a resume, and a loss curve
    near bf16 mode's over a short run."""
    steps = STEPS // 2
    single, out, saved = _split_resumed_run_equals_single(tmp_path, corpus_prefix, "bf16-pure", steps)
    assert ", bf16-pure," in out and "keeps no fp32 main weights" in out
    from safetensors.torch import load_file
    model = [t for s in saved.glob("model-*.safetensors") for t in load_file(s).values()]
    assert model and all(t.dtype == torch.bfloat16 for t in model)
    moments = [t for s in saved.glob("optim-*.safetensors") for n, t in load_file(s).items() if "exp_avg" in n]
    assert moments and all(t.dtype == torch.bfloat16 for t in moments)

    # Data parallel: the fused weight gradients land in the DP reducer's bf16 buffers; DP2 tracks one process.
    dp, _ = _train(tmp_path, "dp", corpus_prefix, "train.precision=bf16-pure", f"train.train_iters={steps}",
                   "cluster=cpu_homogeneous", "partition.dp=2")
    for step, (loss, _) in single.items():
        assert dp[step][0] == pytest.approx(loss, rel=5e-3), step

    bf16, _ = _train(tmp_path, "bf16", corpus_prefix, "train.precision=bf16", f"train.train_iters={steps}")
    assert bf16 != single  # no fp32 main weights really changed the arithmetic
    for step, (loss, _) in single.items():
        assert abs(loss - bf16[step][0]) / bf16[step][0] < 0.03, step
