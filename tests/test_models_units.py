"""The model as partitionable units: slices compose to the whole, FLOPs formula."""
import pytest
import torch

from hetpipe.errors import ConfigError
from hetpipe.models import build_model, model_preset
from hetpipe.models.flops import megatron_model_flops


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2"])
def test_slices_compose_to_the_whole_model(name):
    cfg = model_preset(name)
    whole = build_model(cfg, seed=11)
    splits = [(0, 2), (2, 4), (4, cfg.num_units)]
    parts = [build_model(cfg, seed=11, units=s) for s in splits]
    # Same parameter names and values whatever the split (tied heads included).
    merged = {}
    for part in parts:
        merged.update(part.state_dict())
    full_state = whole.state_dict()
    for key, value in full_state.items():
        assert torch.equal(merged[key], value), key
    if cfg.share_embeddings_and_output_weights:
        assert torch.equal(merged["head.output.weight"], full_state["embedding.weight"])
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(tokens, -1, dims=1)
    x = tokens
    for part in parts[:-1]:
        x = part(x)
    assert torch.equal(parts[-1](x, labels), whole(tokens, labels))
    assert [u for p in parts for u, _ in p.units()] == list(range(cfg.num_units))


def test_bad_unit_range_is_refused():
    with pytest.raises(ConfigError, match="unit range"):
        build_model(model_preset("tiny_llama"), seed=0, units=(3, 3))


def test_bad_shapes_are_refused():
    with pytest.raises(ConfigError, match="num_query_groups"):
        model_preset("tiny_llama", num_query_groups=3)


def test_megatron_flops_formula_by_hand():
    cfg = model_preset("llama8b")
    b, s, h, L = 1, 8192, 4096, 32
    attention = (1 + 8 / 32 + s / h) * 1.0
    mlp = 14336 / h * 1.5
    logits = 128256 / (2 * L * h)
    expected = 12 * b * s * L * h * h * (attention + mlp + logits)
    assert megatron_model_flops(cfg, b, s) == pytest.approx(expected, rel=1e-12)
    # Roughly 6 * params * tokens plus attention: a sanity bound on the formula.
    six_nd = 6 * cfg.num_parameters() * s
    assert 1.0 < megatron_model_flops(cfg, b, s) / six_nd < 1.6
