"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): LLaMA's layer with biases on the
q/k/v projections. transformers' Qwen2 always has them and derives the head
size from hidden / heads, so an export needs both; sliding-window attention
(off in the released dense models) is not implemented."""
from hetpipe.errors import ConfigError
from hetpipe.models.families.spec import FamilySpec, HFNames


def _hf_extra(cfg) -> dict:
    if cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads or not cfg.add_qkv_bias:
        raise ConfigError("Qwen2 in transformers needs qkv biases and head size = hidden / heads")
    return dict(use_sliding_window=False)


def _hf_check(hf_config) -> None:
    if getattr(hf_config, "use_sliding_window", False):
        raise ConfigError("HF Qwen2 config enables sliding-window attention, which hetpipe does not implement")


SPEC = FamilySpec(
    name="qwen2",
    description="Qwen2: LLaMA's layer with q/k/v biases",
    hf=HFNames(model_type="qwen2", architecture="Qwen2ForCausalLM", config_class="Qwen2Config"),
    qkv_bias="hf_requires",
    # Qwen2-7B's config.json.
    config_defaults={"rotary_base": 1000000.0, "norm_epsilon": 1e-6, "add_qkv_bias": True},
    hf_config_extra=_hf_extra,
    hf_config_check=_hf_check,
)
