"""Fused elementwise kernels (train.fuse_elementwise; models/layers.py) on CPU:
the compiled path computes what the eager one does, keeps the activations the
cost model says, is chosen by the documented rule, and trains pipelined with
the same bitwise parity as the eager path."""
from __future__ import annotations

import pytest
import torch

from conftest import run_cli, run_pretrain
from hetpipe.errors import ConfigError
from hetpipe.models import build_model
from hetpipe.models import layers as layers_mod, train_modes
from hetpipe.models.model_config import model_preset
from hetpipe.schema.pretrain_config import TrainConfig
from hetpipe.models.layers import (Attention, DecoderLayer, RMSNorm, SwiGLU, fuse_elementwise, fuses_elementwise,
                                   sdpa_preference, set_attention_backend)
from hetpipe.devices.catalog import CATALOG
from hetpipe.partitioner.cost import Precision, layer_activation_bytes
from hetpipe.partitioner.profile import measure_units


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_fused_model_matches_eager_loss_and_gradients(name, one_thread):
    cfg = model_preset(name)
    eager, fused = build_model(cfg, seed=3), build_model(cfg, seed=3)
    fuse_elementwise(fused)
    switched = [m for m in fused.modules() if isinstance(m, (RMSNorm, Attention, SwiGLU, DecoderLayer))]
    assert switched and all(m.fused for m in switched)
    assert not any(getattr(m, "fused", False) for m in eager.modules())
    gen = torch.Generator().manual_seed(0)
    # The shape test_cost_model_counts_the_activations_a_layer_keeps profiles: its layers reuse these compiles.
    tokens = torch.randint(0, cfg.vocab_size, (2, 128), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (2, 128), generator=gen)
    for model in (eager, fused):
        model(tokens, labels).backward()
    torch.testing.assert_close(fused(tokens, labels), eager(tokens, labels), rtol=1e-5, atol=1e-6)
    for (n, a), (_, b) in zip(fused.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=n)
    fuse_elementwise(fused, False)
    assert not any(m.fused for m in switched)


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen3"])
@pytest.mark.parametrize("fused", [False, True])
def test_cost_model_counts_the_activations_a_layer_keeps(fused, name, one_thread):
    """The profiler counts every tensor autograd saves; the cost model's formula
    (eager or fused) must agree within the RoPE tables all layers share."""
    cfg = model_preset(name)
    _, entry = measure_units(cfg, 128, 2, "fp32", repeats=1, warmup=1, fuse_elementwise=fused)
    measured = entry["units"]["layer"]["activation_bytes"]
    predicted = layer_activation_bytes(cfg, 2, 128, 1, Precision(4, fused_elementwise=fused))
    assert entry["shape"]["fused_elementwise"] is fused
    assert predicted <= measured <= predicted * 1.03
    if fused:  # and fusion keeps markedly less (tiny_qwen3: 0.76 of eager, its
        # QK-norm kernel keeping the qkv output it normalises)
        ratio = 0.75 if name == "tiny_llama" else 0.8
        assert predicted < ratio * layer_activation_bytes(cfg, 2, 128, 1, Precision(4))


def test_when_layers_fuse(monkeypatch):
    monkeypatch.setattr(train_modes, "_has_triton", lambda: True)
    assert fuses_elementwise(None, "cuda", compiled=False)
    assert not fuses_elementwise(None, "cuda", compiled=True)  # whole layers are compiled instead
    assert not fuses_elementwise(None, "cpu", compiled=False)
    assert fuses_elementwise(True, "cpu", compiled=False) and not fuses_elementwise(False, "cuda", False)
    monkeypatch.setattr(train_modes, "_has_triton", lambda: False)
    assert not fuses_elementwise(None, "cuda", compiled=False)
    with pytest.raises(ConfigError, match="train.fuse_elementwise=true .*Triton"):
        fuses_elementwise(True, "cuda", compiled=False)
    # The planner reasons about a cluster's GPUs, not this machine's.
    assert Precision.for_device(CATALOG["H200"]).fused_elementwise
    assert not Precision.for_device(CATALOG["H200"], compiled=True).fused_elementwise
    assert not Precision.for_device(CATALOG["CPU"]).fused_elementwise


def test_fused_kernels_are_chosen_per_device_compile_until_liger_is_measured(monkeypatch):
    """train.fuse_elementwise=auto|compile|liger|none (null, true, false as before):
    auto takes liger only on the device kinds LIGER_AUTO_DEVICES lists (none yet)."""
    monkeypatch.setattr(train_modes, "_has_triton", lambda: True)
    monkeypatch.setattr(train_modes, "_liger_installed", lambda: True)
    kernels = train_modes.elementwise_kernels
    assert train_modes.LIGER_AUTO_DEVICES == frozenset()
    assert kernels(None, "cuda", False, device_kind="H200") == kernels("auto", "cuda", False) == "compile"
    assert kernels("auto", "cpu", False) == "none" and kernels("auto", "cuda", True) == "none"
    assert kernels(True, "cuda", False) == "compile" and kernels(False, "cuda", False) == "none"
    assert kernels("liger", "cuda", False) == "liger" and kernels("none", "cuda", False) == "none"
    monkeypatch.setattr(train_modes, "LIGER_AUTO_DEVICES", frozenset({"H200"}))
    assert kernels(None, "cuda", False, device_kind="H200") == "liger"
    assert kernels(None, "cuda", False, device_kind="A100") == "compile"
    monkeypatch.setattr(train_modes, "_liger_installed", lambda: False)
    assert kernels(None, "cuda", False, device_kind="H200") == "compile"  # auto never needs it
    assert kernels("liger", "cuda", False, local=False) == "liger"  # the planner assumes the cluster's
    with pytest.raises(ConfigError, match=r"=liger: liger-kernel is not installed on this rank's machine: "
                                          r"pip install liger-kernel \(or the hetpipe\[kernels\] extra\)"):
        kernels("liger", "cuda", False)
    with pytest.raises(ConfigError, match="train.fuse_elementwise='triton' must be one of auto, compile, liger, none"):
        TrainConfig(fuse_elementwise="triton")


def test_liger_on_a_cpu_stops_before_step_one(tmp_path, corpus_prefix):
    proc = run_cli(["-m", "hetpipe.pretrain", *COMMON, f"data.path={corpus_prefix}", "train.fuse_elementwise=liger",
                    f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 2, proc.stderr
    assert [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("hetpipe: error:")] == [
        "hetpipe: error: train.fuse_elementwise=liger: liger-kernel's Triton kernels run on CUDA and ROCm GPUs, "
        "not on this rank's CPU; use compile or none"]
    assert "Traceback" not in proc.stderr and not (tmp_path / "metrics.jsonl").exists()


class ReferenceLiger:
    """liger_kernel.transformers.functional's three functions hetpipe calls, in plain ops."""

    def __init__(self):
        self.called = set()

    def liger_rms_norm(self, x, w, eps, offset=0.0, casting_mode="llama", in_place=True):
        assert casting_mode == "llama" and not in_place and offset == 0.0
        self.called.add("rms_norm")
        return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def liger_swiglu(self, a, b):
        self.called.add("swiglu")
        return torch.nn.functional.silu(a) * b

    def liger_fused_linear_cross_entropy(self, input, weight, target, bias=None, ce_weight=None,
                                         ignore_index=-100, reduction="mean", accum_dtype=None, **rest):
        assert reduction == "mean" and accum_dtype == torch.float32 and not rest
        self.called.add("cross_entropy")
        return torch.nn.functional.cross_entropy(input @ weight.t(), target, ignore_index=ignore_index)


def test_liger_runs_norms_swiglu_and_loss_through_its_functions(one_thread, monkeypatch):
    from hetpipe.models import liger

    reference = ReferenceLiger()
    monkeypatch.setattr(liger, "_functional", lambda: reference)
    cfg = model_preset("tiny_llama")
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    eager, ligered = build_model(cfg, seed=3), build_model(cfg, seed=3)
    layers_mod.use_liger(ligered)
    losses = [model(tokens, tokens.roll(-1, dims=1)) for model in (eager, ligered)]
    for loss in losses:
        loss.backward()
    assert reference.called == {"rms_norm", "swiglu", "cross_entropy"}
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-6)
    for (name, a), (_, b) in zip(eager.named_parameters(), ligered.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_attention_backend_is_preferred_and_falls_back(one_thread):
    """train.attention_backend puts one SDPA backend first; a rank that cannot
    run it (no cuDNN on a CPU, as on a ROCm GPU) runs the next one and trains
    the same model."""
    from torch.nn.attention import SDPBackend

    assert sdpa_preference("auto") is None
    cudnn = sdpa_preference("cudnn")
    assert cudnn[0] == SDPBackend.CUDNN_ATTENTION and len(set(cudnn)) == 4 and SDPBackend.MATH in cudnn
    with pytest.raises(ConfigError, match="train.attention_backend='fa3' must be one of auto, fa4, cudnn"):
        sdpa_preference("fa3")
    with pytest.raises(ConfigError, match="train.attention_backend='fa3'"):
        TrainConfig(attention_backend="fa3")
    cfg = model_preset("tiny_llama")
    gen = torch.Generator().manual_seed(0)
    # The shape test_cost_model_counts_the_activations_a_layer_keeps profiles: its layers reuse these compiles.
    tokens = torch.randint(0, cfg.vocab_size, (2, 128), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (2, 128), generator=gen)
    losses = {}
    for backend in ("auto", "cudnn", "math"):
        model = build_model(cfg, seed=3)
        set_attention_backend(model, backend)
        attention = [m for m in model.modules() if isinstance(m, Attention)]
        assert attention and all(m.sdpa_backends == sdpa_preference(backend) for m in attention)
        losses[backend] = model(tokens, labels)
    assert losses["cudnn"].item() == losses["auto"].item()
    torch.testing.assert_close(losses["math"], losses["auto"], rtol=1e-5, atol=1e-6)


STEPS = 4
COMMON = ["+model=tiny_llama", "model.hidden_size=64", "model.ffn_hidden_size=160", "model.num_layers=4",
          "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=8", "train.log_interval=1",
          f"train.train_iters={STEPS}", "optimizer.lr=3e-3", "optimizer.lr_warmup_iters=2",
          "logging.progress=false", "cluster.groups.0.device_type=CPU"]


def test_fused_pipeline_equals_fused_single_process_and_tracks_eager(tmp_path, corpus_prefix):
    data = f"data.path={corpus_prefix}"

    def train(name, *overrides):
        proc, rows = run_pretrain(tmp_path / name, [*COMMON, data, *overrides], timeout=300)
        return [r["loss"] for r in rows], proc.stdout

    eager, out = train("eager")
    assert "fused elementwise" not in out  # CPUs do not fuse unless asked
    single, out = train("single", "train.fuse_elementwise=true")
    assert ", fp32 (fused elementwise)," in out
    pipelined, _ = train("mixed", "train.fuse_elementwise=true", "cluster=cpu_mixed", "cluster.transport.kind=tcp",
                         "partition.layers=[1,3]")
    assert len(single) == STEPS and pipelined == single
    assert single == pytest.approx(eager, rel=1e-4) and single[-1] < single[0]
