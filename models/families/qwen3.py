"""Qwen3 dense (``Qwen3ForCausalLM``; Qwen3 technical report, arXiv:2505.09388):
Qwen2's layer without the q/k/v biases and with QK-norm, an RMSNorm over
head_dim applied to every query and key head before RoPE (transformers'
Qwen3Attention: q_norm(q_proj(x).view(..., head_dim))). The head size is a
field of its own (Qwen3-0.6B: hidden 1024, 16 heads of 128).

transformers' attention_bias would also put a bias on o_proj, which our
row-parallel output projection cannot hold, so it is refused;
sliding-window attention (off in the released models) is not implemented.
"""
from hetpipe.errors import ConfigError
from hetpipe.models.families.spec import FamilySpec, HFNames, TPPlan


def _hf_extra(cfg) -> dict:
    return dict(head_dim=cfg.head_dim, attention_bias=False, use_sliding_window=False)


def _hf_check(hf_config) -> None:
    if getattr(hf_config, "use_sliding_window", False):
        raise ConfigError("HF Qwen3 config enables sliding-window attention, which hetpipe does not implement")
    if getattr(hf_config, "attention_bias", False):
        raise ConfigError("HF Qwen3 config has attention biases (q/k/v and o_proj), which hetpipe's Qwen3 does not")


SPEC = FamilySpec(
    name="qwen3",
    description="Qwen3: GQA with QK-norm, no q/k/v biases",
    hf=HFNames(model_type="qwen3", architecture="Qwen3ForCausalLM", config_class="Qwen3Config"),
    qkv_bias="never",
    qk_norm=True,
    # Qwen3-8B's config.json.
    config_defaults={"rotary_base": 1000000.0, "norm_epsilon": 1e-6, "add_qkv_bias": False},
    # One weight of head_dim per projection, shared by all its heads: whole on
    # every rank, which norms only its own heads.
    tp=TPPlan(per_head_norms=("q_norm", "k_norm")),
    hf_config_extra=_hf_extra,
    hf_config_check=_hf_check,
    hf_layer_keys=(("attention.q_norm.weight", "self_attn.q_norm.weight"),
                   ("attention.k_norm.weight", "self_attn.k_norm.weight")),
)
