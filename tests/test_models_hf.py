"""Our LLaMA / Qwen2 implementations against transformers' reference models."""
import pytest
import torch

from hetpipe.models import CausalLM, ModelConfig, build_model, model_preset
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
    assert from_hf_config(to_hf_config(model_preset("llama8b")), "llama8b") == model_preset("llama8b")


def test_unsupported_hf_config_is_refused():
    hf_cfg = to_hf_config(model_preset("tiny_llama"))
    hf_cfg.hidden_act = "gelu"
    with pytest.raises(Exception, match="hidden_act"):
        from_hf_config(hf_cfg)
