"""Model families: one spec each (hetpipe.models.families), read by the model,
its arithmetic, the cost model, the TP plan and the HF converter."""
import dataclasses
import re

import pytest
import torch

from conftest import run_pretrain
from hetpipe.errors import ConfigError
from hetpipe.models import ModelConfig, model_preset, preset_names
from hetpipe.models.families import FAMILIES, family_for_hf_model_type, family_spec
from hetpipe.models.flops import megatron_model_flops
from hetpipe.models.layers import DecoderLayer, fuse_elementwise, model_rope_frequencies, rope_cos_sin
from hetpipe.models.split_backward import backward_input
from hetpipe.devices.catalog import CATALOG
from hetpipe.partitioner.cost import (NetworkConfig, Precision, StageShape, layer_activation_bytes, unit_costs,
                                      weight_pass_bytes)
from hetpipe.partitioner.profile import profile_shape


def test_every_family_is_found_by_name_and_by_hf_model_type():
    assert list(FAMILIES) == ["llama", "qwen2", "qwen3"]
    for name, spec in FAMILIES.items():
        assert family_spec(name) is spec and family_for_hf_model_type(spec.hf.model_type) is spec
    with pytest.raises(ConfigError, match=re.escape("model.family='gpt2' is not supported "
                                                    "(choose one of llama, qwen2, qwen3)")):
        ModelConfig(family="gpt2")


def test_presets_agree_with_their_familys_defaults():
    for name in preset_names():
        cfg = model_preset(name)
        defaults = family_spec(cfg.family).config_defaults
        if not name.startswith("tiny"):
            assert {k: getattr(cfg, k) for k in defaults} == dict(defaults), name
    made = ModelConfig.of_family("qwen3", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2)
    assert (made.rotary_base, made.norm_epsilon, made.add_qkv_bias) == (1e6, 1e-6, False)


def test_qwen3_has_no_qkv_bias():
    with pytest.raises(ConfigError, match="model.add_qkv_bias=true is not part of model.family=qwen3") as info:
        model_preset("tiny_qwen3", add_qkv_bias=True)
    assert "\n" not in str(info.value)


# Recorded from the code before the families had specs (commit 4dea6d1):
# parameters, Megatron FLOPs of one sequence of 8192, one layer's (split,
# replicated) parameters, and an H200 layer's and head's costs.
BEFORE = {
    "llama8b": dict(params=8030261248, flops=474422087516160.0, layer=(218103808, 8192),
                    act=285491200.0, head_act=1101021184.0, fwd=0.0017055114182112324, kept=176160768.0,
                    act_tp2=601915392.0, transient_tp2=125829120.0, net_tp2=155189248.0),
    "qwen2_7b": dict(params=7615616512, flops=428332793462784.0, layer=(233050624, 7168),
                     act=325304320.0, head_act=1289764864.0, fwd=0.0018101319103005788, kept=203423744.0,
                     act_tp2=618957312.0, transient_tp2=136314880.0, net_tp2=164893184.0),
}


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_llama_and_qwen2_numbers_are_those_before_the_spec(name):
    model, want, h200 = model_preset(name), BEFORE[name], CATALOG["H200"]
    assert model.num_parameters() == want["params"]
    assert megatron_model_flops(model, 1, 8192) == want["flops"]
    assert family_spec(model.family).layer_params(model) == want["layer"]
    uc = unit_costs(model, h200, StageShape(1, 2, 1024), Precision.for_device(h200), NetworkConfig())
    assert (uc.activation_bytes[1], uc.activation_bytes[-1]) == (want["act"], want["head_act"])
    assert (uc.forward_s[1], uc.weight_kept_bytes[1]) == (want["fwd"], want["kept"])
    autocast = Precision.for_device(h200, "bf16-autocast", fuse_elementwise=False)
    uc = unit_costs(model, h200, StageShape(2, 2, 1024, "selective"), autocast, NetworkConfig())
    assert (uc.activation_bytes[1], uc.transient_bytes[1], uc.weight_net_bytes[1]) == \
        (want["act_tp2"], want["transient_tp2"], want["net_tp2"])
    assert "qk_norm" not in profile_shape(model, 4096, "bf16", True)


def test_qwen3_counts_its_qk_norm():
    qwen3 = model_preset("qwen3_8b")
    plain = dataclasses.replace(qwen3, family="llama")
    # Two head_dim weights per layer, whole on every TP rank; no FLOPs (Megatron counts GEMMs).
    assert qwen3.num_parameters() - plain.num_parameters() == 36 * 2 * 128
    assert family_spec("qwen3").layer_params(qwen3)[1] == 2 * 4096 + 2 * 128
    assert megatron_model_flops(qwen3, 1, 4096) == megatron_model_flops(plain, 1, 4096)
    h200 = CATALOG["H200"]
    for prec in (Precision.for_device(h200), Precision.for_device(h200, "bf16-autocast", fuse_elementwise=False)):
        a = unit_costs(qwen3, h200, StageShape(1, 1, 4096), prec, NetworkConfig())
        b = unit_costs(plain, h200, StageShape(1, 1, 4096), prec, NetworkConfig())
        assert a.activation_bytes[1] > b.activation_bytes[1] and a.forward_s[1] == b.forward_s[1]
    # A profile measured for a LLaMA layer of the same shape does not price a Qwen3 layer.
    assert profile_shape(qwen3, 4096, "bf16", True) == {**profile_shape(plain, 4096, "bf16", True), "qk_norm": True}


def _saved_bytes(cfg: ModelConfig, batch: int, seq: int, autocast: bool, fused: bool) -> int:
    """Bytes one layer's forward saves for its backward (storages counted once,
    parameters, input and RoPE tables left out)."""
    torch.manual_seed(0)
    layer = DecoderLayer(cfg)
    fuse_elementwise(layer, fused)
    x = torch.randn(batch, seq, cfg.hidden_size, requires_grad=True)
    cos, sin = rope_cos_sin(model_rope_frequencies(cfg), seq, x.dtype)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            layer(x, cos, sin)
    inputs = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), x, cos, sin)}
    return sum(n for ptr, n in storages.items() if ptr not in inputs)


@pytest.mark.parametrize("autocast, fused", [(False, False), (True, False), (False, True)],
                         ids=["fp32", "bf16_autocast", "fp32_fused"])
def test_qk_norm_saved_bytes_are_the_cost_models(one_thread, autocast, fused):
    """What QK-norm adds to a layer's saved tensors, per token, measured
    against the same layer without it: the slope over two microbatch sizes,
    which drops the bf16 RoPE tables autocast keeps per layer (shared by a
    stage's layers; the cost model leaves them out for every family)."""
    qwen3 = model_preset("tiny_qwen3")
    plain = dataclasses.replace(qwen3, family="llama")
    prec = Precision(matmul_bytes=2 if autocast else 4, fused_elementwise=fused)
    seq = 32

    def extra(cfg_a, cfg_b, batch):
        return _saved_bytes(cfg_a, batch, seq, autocast, fused) - _saved_bytes(cfg_b, batch, seq, autocast, fused)
    measured = extra(qwen3, plain, 2) - extra(qwen3, plain, 1)
    predicted = layer_activation_bytes(qwen3, 1, seq, 1, prec) - layer_activation_bytes(plain, 1, seq, 1, prec)
    assert measured == predicted


def _w_pass_kept_bytes(cfg: ModelConfig, batch: int, seq: int) -> int:
    """Bytes a zero-bubble B keeps for one layer's W (storages counted once)."""
    torch.manual_seed(0)
    layer = DecoderLayer(cfg)
    x = torch.randn(batch, seq, cfg.hidden_size, requires_grad=True)
    h = x * 1.0  # a chunk's input is a non-leaf tensor received from the previous stage
    cos, sin = rope_cos_sin(model_rope_frequencies(cfg), seq, x.dtype)
    y = layer(h, cos, sin)
    _, pending = backward_input(y, torch.randn_like(y), h)
    kept = [g for _, grads, _ in pending.reruns for g in grads if g is not None] + [g for _, g in pending.edges]
    return sum({g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in kept}.values())


def test_qk_norm_w_pass_bytes_are_the_cost_models(one_thread):
    """Eager fp32: B keeps the gradients entering QK-norm's weight products."""
    qwen3 = model_preset("tiny_qwen3")
    plain = dataclasses.replace(qwen3, family="llama")
    measured = _w_pass_kept_bytes(qwen3, 2, 32) - _w_pass_kept_bytes(plain, 2, 32)
    predicted = weight_pass_bytes(qwen3, 2, 32, 1, Precision(4))[0][1] - \
        weight_pass_bytes(plain, 2, 32, 1, Precision(4))[0][1]
    assert measured == predicted == 2 * 32 * (4 + 2) * 48 * 4


def test_qwen3_pp2_across_vendors_trains_bitwise_like_one_process(tmp_path, corpus_prefix):
    """Through the user's entry point: two stages in two emulated vendor
    groups, QK-norm in every layer, fp32 losses and gradient norms equal to
    one process's bit for bit. Untied: with the tied embedding split over two
    stages the gradient norm differs from one process's in its last bit, for
    tiny_llama and tiny_qwen2 alike, before the family specs too (4dea6d1)."""
    common = ["+model=tiny_qwen3", "model.share_embeddings_and_output_weights=false",
              "model.hidden_size=64", "model.ffn_hidden_size=160", "train.train_iters=10",
              "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=8",
              "train.log_interval=5", "optimizer.lr=3e-3", "optimizer.clip_grad=0.5",
              "cluster.groups.0.device_type=CPU", f"data.path={corpus_prefix}"]
    _, single = run_pretrain(tmp_path / "single", common)
    _, pp2 = run_pretrain(tmp_path / "pp2", [*common, "cluster=cpu_mixed", "partition.layers=[1,3]"])
    assert [(r["loss"], r["grad_norm"]) for r in pp2] == [(r["loss"], r["grad_norm"]) for r in single]
    assert len(single) == 10 and single[-1]["loss"] < single[0]["loss"]


def test_the_specs_import_nothing_of_the_runtime():
    """models/families/ is read by the partitioner and the runtime alike, so it
    imports only itself and hetpipe.errors (parsed, not run)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "models" / "families"
    found = set()
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
    hetpipe = {m for m in found if m.startswith("hetpipe")}
    assert hetpipe - {"hetpipe.errors"} <= {m for m in hetpipe if m.startswith("hetpipe.models.families")} | {
        "hetpipe.models.model_config"}  # typing only, under TYPE_CHECKING
    assert not {m for m in found if m.split(".")[0] in ("torch", "numpy", "transformers")}
