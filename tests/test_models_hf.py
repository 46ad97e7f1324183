"""Our LLaMA / Qwen2 / Qwen3 implementations against transformers' reference models."""
import dataclasses
import json
import math
import re

import pytest
import torch

from conftest import run_cli
from hetpipe.errors import ConfigError
from hetpipe.models import CausalLM, ModelConfig, build_model, model_preset
from hetpipe.models.layers import rope_inverse_frequencies
from hetpipe.models.hf import from_hf_config, from_hf_state_dict, to_hf_config, to_hf_state_dict

transformers = pytest.importorskip("transformers")

CASES = {
    # GQA: 4 query heads share 2 KV heads.
    "llama_gqa": ModelConfig(name="t", family="llama", num_layers=3, hidden_size=64,
                             ffn_hidden_size=160, num_attention_heads=4, num_query_groups=2,
                             vocab_size=300, max_position_embeddings=64, rotary_base=500000.0),
    # Multi-head attention with tied embeddings.
    "llama_tied_mha": ModelConfig(name="t", family="llama", num_layers=2, hidden_size=48,
                                  ffn_hidden_size=96, num_attention_heads=4, num_query_groups=4,
                                  vocab_size=257, max_position_embeddings=64,
                                  share_embeddings_and_output_weights=True),
    "qwen2_gqa": ModelConfig(name="t", family="qwen2", num_layers=3, hidden_size=64,
                             ffn_hidden_size=176, num_attention_heads=8, num_query_groups=2,
                             vocab_size=320, max_position_embeddings=64, rotary_base=1e6,
                             norm_epsilon=1e-6, add_qkv_bias=True),
    "qwen2_tied": model_preset("tiny_qwen2"),
    # QK-norm, untied, head size = hidden / heads (as Qwen3-8B).
    "qwen3_gqa": ModelConfig(name="t", family="qwen3", num_layers=3, hidden_size=64,
                             ffn_hidden_size=176, num_attention_heads=8, num_query_groups=2,
                             vocab_size=320, max_position_embeddings=64, rotary_base=1e6,
                             norm_epsilon=1e-6),
    # Tied, and a head size of its own (48, not 128 / 4), as the small Qwen3 models.
    "qwen3_tied_head_dim": model_preset("tiny_qwen3"),
    # Llama 3.1's "llama3" RoPE scaling, with an original context of 64 so
    # that head size 16's eight wavelengths (6.3 .. 19869 positions) fall in
    # all three bands: kept (< 64/4), blended (16 .. 64), slowed 8x (> 64/1).
    "llama3_scaled": ModelConfig(name="t", family="llama", num_layers=2, hidden_size=64,
                                 ffn_hidden_size=160, num_attention_heads=4, num_query_groups=2,
                                 vocab_size=300, max_position_embeddings=128, rope_scaling="llama3",
                                 rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                                 rope_high_freq_factor=4.0, rope_original_max_position_embeddings=64),
}


def _hf_model(cfg: ModelConfig, seed: int):
    torch.manual_seed(seed)
    hf_cfg = to_hf_config(cfg)
    hf_cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    # Random, non-trivial norms and biases so that every tensor is exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case):
    cfg = CASES[case]
    hf = _hf_model(cfg, seed=0)
    ours = CausalLM(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(cfg, hf.state_dict()), strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # The loss path agrees with transformers' own shifted cross-entropy too.
    labels = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(expected.flatten(0, 1), labels.flatten())
        assert abs(ours(tokens, labels).item() - ref.item()) < 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_then_import_is_exact(case):
    cfg = CASES[case]
    ours = build_model(cfg, seed=3)
    hf_state = to_hf_state_dict(cfg, ours.state_dict())
    # transformers accepts the exported tensors as a complete state dict.
    hf = transformers.AutoModelForCausalLM.from_config(to_hf_config(cfg))
    missing, unexpected = hf.load_state_dict(hf_state, strict=False)
    assert not unexpected
    assert [k for k in missing if k != "lm_head.weight"] == []
    back = from_hf_state_dict(cfg, hf_state)
    assert back.keys() == ours.state_dict().keys()
    for key, value in ours.state_dict().items():
        assert torch.equal(back[key], value), key


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_round_trip(case):
    cfg = CASES[case]
    back = from_hf_config(to_hf_config(cfg), name=cfg.name)
    assert back == cfg


def test_presets_have_published_sizes():
    # LLaMA-3-8B: 8.03B parameters; Qwen2-7B: 7.62B (their model cards).
    assert round(model_preset("llama8b").num_parameters() / 1e9, 2) == 8.03
    assert round(model_preset("qwen2_7b").num_parameters() / 1e9, 2) == 7.62
    # Qwen3-8B: 8.19B (its model card says 8.2B).
    assert round(model_preset("qwen3_8b").num_parameters() / 1e9, 2) == 8.19
    assert from_hf_config(to_hf_config(model_preset("llama8b")), "llama8b") == model_preset("llama8b")


def test_unsupported_hf_config_is_refused():
    hf_cfg = to_hf_config(model_preset("tiny_llama"))
    hf_cfg.hidden_act = "gelu"
    with pytest.raises(Exception, match="hidden_act"):
        from_hf_config(hf_cfg)


def test_llama3_rope_scaling_matches_transformers_beyond_the_original_context():
    cfg = CASES["llama3_scaled"]
    wavelengths = 2 * math.pi / rope_inverse_frequencies(cfg.head_dim, cfg.rotary_base)
    original = cfg.rope_original_max_position_embeddings
    kept = wavelengths < original / cfg.rope_high_freq_factor
    slowed = wavelengths > original / cfg.rope_low_freq_factor
    assert kept.any() and slowed.any() and (~kept & ~slowed).any()
    hf = _hf_model(cfg, seed=4)
    ours = CausalLM(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(cfg, hf.state_dict()), strict=True)
    assert torch.equal(ours.inv_freq, hf.model.rotary_emb.inv_freq)
    # Twice the original context: positions past it are what the scaling is for.
    tokens = torch.randint(0, cfg.vocab_size, (2, 2 * original), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
        plain = CausalLM(dataclasses.replace(cfg, rope_scaling=None)).eval()
        plain.load_state_dict(ours.state_dict())
        unscaled = plain(tokens)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # The scaling is not a no-op at this size, so the match above means something.
    assert (unscaled - expected).abs().max() > 1e-3


# config.json of meta-llama/Llama-3.1-8B, as its model card's repository ships it.
LLAMA31_8B_CONFIG_JSON = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}


def test_llama31_8b_config_imports_as_the_preset_and_exports_back(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_8B_CONFIG_JSON))
    preset = model_preset("llama31_8b")
    assert from_hf_config(transformers.AutoConfig.from_pretrained(str(tmp_path)), "llama31_8b") == preset
    assert round(preset.num_parameters() / 1e9, 2) == 8.03
    # What hetpipe.export writes reads back as the same model.
    exported = tmp_path / "exported"
    to_hf_config(preset).save_pretrained(str(exported))
    assert from_hf_config(transformers.AutoConfig.from_pretrained(str(exported)), "llama31_8b") == preset


def test_llama31_8b_preset_composes_through_hydra():
    proc = run_cli(["-m", "hetpipe.pretrain", "+model=llama31_8b", "--cfg", "job"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    for line in ("max_position_embeddings: 131072", "rotary_base: 500000.0", "rope_scaling: llama3",
                 "rope_scaling_factor: 8.0", "rope_low_freq_factor: 1.0", "rope_high_freq_factor: 4.0",
                 "rope_original_max_position_embeddings: 8192"):
        assert line in proc.stdout


@pytest.mark.parametrize("override, message", [
    ({"rope_scaling": "yarn"}, "model.rope_scaling='yarn' is not supported"),
    ({"rope_scaling_factor": 0.5}, "model.rope_scaling_factor=0.5 must be at least 1"),
    ({"rope_high_freq_factor": 1.0}, "must satisfy 0 < low < high"),
    ({"rope_low_freq_factor": 0.0}, "must satisfy 0 < low < high"),
    ({"rope_original_max_position_embeddings": 0}, "rope_original_max_position_embeddings=0 must be positive"),
])
def test_bad_rope_scaling_is_a_one_line_error(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        model_preset("llama31_8b", **override)
    assert "\n" not in str(info.value)


def test_other_hf_rope_scalings_are_refused():
    hf_cfg = to_hf_config(model_preset("tiny_llama"))
    hf_cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 128}
    with pytest.raises(ConfigError, match="RoPE scaling 'yarn', which hetpipe does not implement"):
        from_hf_config(hf_cfg)


# config.json of Qwen/Qwen3-8B, as its model card's repository ships it.
QWEN3_8B_CONFIG_JSON = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_qwen3_8b_config_imports_as_the_preset_and_exports_back(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B_CONFIG_JSON))
    preset = model_preset("qwen3_8b")
    assert from_hf_config(transformers.AutoConfig.from_pretrained(str(tmp_path)), "qwen3_8b") == preset
    exported = tmp_path / "exported"
    to_hf_config(preset).save_pretrained(str(exported))
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert from_hf_config(transformers.AutoConfig.from_pretrained(str(exported)), "qwen3_8b") == preset


@pytest.mark.parametrize("name", ["tiny_qwen3", "qwen3_8b", "qwen2_7b", "llama8b"])
def test_parameter_count_is_transformers_numel(name):
    cfg = model_preset(name)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(to_hf_config(cfg))
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "HF Qwen3 config has attention biases"),
    ({"use_sliding_window": True}, "HF Qwen3 config enables sliding-window attention"),
])
def test_unsupported_qwen3_features_are_refused(change, message):
    hf_cfg = to_hf_config(model_preset("tiny_qwen3"))
    for key, value in change.items():
        setattr(hf_cfg, key, value)
    with pytest.raises(ConfigError, match=message) as info:
        from_hf_config(hf_cfg)
    assert "\n" not in str(info.value)


def test_an_unknown_hf_model_type_names_the_supported_ones():
    hf_cfg = to_hf_config(model_preset("tiny_llama"))
    hf_cfg.model_type = "gemma"
    with pytest.raises(ConfigError, match="HF model_type 'gemma' is not supported \\(llama, qwen2 or qwen3\\)"):
        from_hf_config(hf_cfg)


def test_import_places_every_tensor_or_names_the_rest():
    cfg = CASES["llama_gqa"]
    state = to_hf_state_dict(cfg, build_model(cfg, seed=0).state_dict())
    # A RoPE buffer older checkpoints saved: recomputed from the config, nothing is lost.
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = rope_inverse_frequencies(cfg.head_dim, cfg.rotary_base)
    from_hf_state_dict(cfg, state)
    state["model.layers.2.self_attn.sinks"] = torch.ones(4)
    with pytest.raises(ConfigError, match=r"^HF checkpoint has tensors hetpipe cannot place: "
                                          r"model\.layers\.2\.self_attn\.sinks$"):
        from_hf_state_dict(cfg, state)


def test_llama_attention_bias_exports_zero_o_proj_biases_and_imports_only_zero_ones():
    # HF's attention_bias biases o_proj too; hetpipe's q/k/v-only biases are
    # exactly that with o_proj's zero, written out so transformers initialises nothing.
    cfg = dataclasses.replace(CASES["llama_gqa"], add_qkv_bias=True)
    state = to_hf_state_dict(cfg, build_model(cfg, seed=0).state_dict())
    o_bias = [key for key in state if key.endswith("o_proj.bias")]
    assert len(o_bias) == cfg.num_layers and not any(state[key].any() for key in o_bias)
    assert sorted(state) == sorted(transformers.AutoModelForCausalLM.from_config(to_hf_config(cfg)).state_dict())
    from_hf_state_dict(cfg, state)
    state[o_bias[1]] = torch.full_like(state[o_bias[1]], 0.5)
    with pytest.raises(ConfigError, match=r"cannot place: model\.layers\.1\.self_attn\.o_proj\.bias; "
                                          r"hetpipe's attention output projection has no bias"):
        from_hf_state_dict(cfg, state)


def test_tied_import_takes_lm_head_only_as_a_copy_of_the_embedding():
    cfg = CASES["llama_tied_mha"]
    state = to_hf_state_dict(cfg, build_model(cfg, seed=0).state_dict())
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # as transformers' state_dict() has it
    from_hf_state_dict(cfg, state)
    state["lm_head.weight"][0, 0] += 1.0  # a head of its own: tying would drop it
    with pytest.raises(ConfigError, match=r"cannot place: lm_head\.weight$"):
        from_hf_state_dict(cfg, state)
