"""Conversion between hetpipe models and Hugging Face transformers.

Maps configs and state dicts in both directions for ``LlamaForCausalLM`` and
``Qwen2ForCausalLM``. Our layers fuse q/k/v and gate/up into single matrices;
HF keeps them apart, so the converter concatenates and splits along the output
dimension. Both sides use the same rotate-half RoPE layout, so no permutation
of the q/k rows is needed. Conversion is exact: export then import returns the
same tensors bit for bit. Of the RoPE variants, plain RoPE and the "llama3"
scaling of Llama 3.1 / 3.2 convert; any other rope_type is refused.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from hetpipe.errors import ConfigError
from hetpipe.models.model_config import ModelConfig

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# HF's keys of a "llama3" rope_scaling -> our ModelConfig fields.
_LLAMA3_FIELDS = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
                  "high_freq_factor": "rope_high_freq_factor",
                  "original_max_position_embeddings": "rope_original_max_position_embeddings"}


def _rope_fields(hf_config: Any) -> dict[str, Any]:
    """ModelConfig's RoPE fields from an HF config's RoPE settings."""
    # transformers >= 5 keeps every RoPE setting in rope_parameters (rope_scaling
    # is an alias of it); 4.x keeps rope_theta apart and any scaling in
    # rope_scaling, whose type key older configs spell "type".
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    fields: dict[str, Any] = {
        "rotary_base": float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))}
    if rope_type == "default":
        return fields
    if rope_type != "llama3":
        raise ConfigError(f"HF config uses RoPE scaling {rope_type!r}, which hetpipe does not implement (only 'llama3')")
    missing = [key for key in _LLAMA3_FIELDS if key not in params]
    if missing:
        raise ConfigError(f"HF config's llama3 RoPE scaling lacks {', '.join(missing)}")
    fields["rope_scaling"] = "llama3"
    for key, field in _LLAMA3_FIELDS.items():
        fields[field] = int(params[key]) if key == "original_max_position_embeddings" else float(params[key])
    return fields


def _hf_rope_scaling(cfg: ModelConfig) -> dict[str, Any]:
    """HF's rope_scaling dict for ``cfg``'s scaled RoPE."""
    return {"rope_type": cfg.rope_scaling, **{key: getattr(cfg, field) for key, field in _LLAMA3_FIELDS.items()}}


def to_hf_config(cfg: ModelConfig):
    """A transformers config (LlamaConfig or Qwen2Config) describing ``cfg``."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_epsilon,
        rope_theta=cfg.rotary_base,
        tie_word_embeddings=cfg.share_embeddings_and_output_weights,
        initializer_range=cfg.init_method_std,
        hidden_act="silu",
        architectures=[_ARCHITECTURES[cfg.family]],
    )
    if cfg.rope_scaling is not None:
        # Both transformers 4.x and 5.x take rope_scaling (with rope_theta beside
        # it); 5.x files it, theta included, under rope_parameters.
        common["rope_scaling"] = _hf_rope_scaling(cfg)
    if cfg.family == "llama":
        return LlamaConfig(**common, head_dim=cfg.head_dim, attention_bias=cfg.add_qkv_bias,
                           mlp_bias=False)
    if cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads or not cfg.add_qkv_bias:
        raise ConfigError("Qwen2 in transformers needs qkv biases and head size = hidden / heads")
    return Qwen2Config(**common, use_sliding_window=False)


def from_hf_config(hf_config: Any, name: str = "hf") -> ModelConfig:
    """The ModelConfig of a transformers LlamaConfig / Qwen2Config."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _ARCHITECTURES:
        raise ConfigError(f"HF model_type {model_type!r} is not supported (llama or qwen2)")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ConfigError(f"HF hidden_act {hf_config.hidden_act!r} is not supported (silu only)")
    if model_type == "qwen2" and getattr(hf_config, "use_sliding_window", False):
        raise ConfigError("HF Qwen2 config enables sliding-window attention, which hetpipe does not implement")
    if getattr(hf_config, "mlp_bias", False):
        raise ConfigError("HF config has MLP biases, which hetpipe does not implement")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return ModelConfig(
        name=name,
        family=model_type,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        kv_channels=None if head_dim == hf_config.hidden_size // heads else head_dim,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        **_rope_fields(hf_config),
        norm_epsilon=hf_config.rms_norm_eps,
        add_qkv_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
    )


def _qkv_sizes(cfg: ModelConfig) -> list[int]:
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_query_groups * cfg.head_dim
    return [q, kv, kv]


def to_hf_state_dict(cfg: ModelConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict (whole model, unit-keyed) -> transformers' key layout."""
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": state["embedding.weight"],
                                    "model.norm.weight": state["head.norm.weight"]}
    if not cfg.share_embeddings_and_output_weights:
        out["lm_head.weight"] = state["head.output.weight"]
    for i in range(cfg.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = state[src + "input_norm.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[src + "post_attention_norm.weight"]
        for kind in ("weight", "bias") if cfg.add_qkv_bias else ("weight",):
            q, k, v = state[src + f"attention.qkv.{kind}"].split(_qkv_sizes(cfg), dim=0)
            for proj, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[dst + f"self_attn.{proj}.{kind}"] = t.clone()
        out[dst + "self_attn.o_proj.weight"] = state[src + "attention.out.weight"]
        gate, up = state[src + "mlp.gate_up.weight"].chunk(2, dim=0)
        out[dst + "mlp.gate_proj.weight"] = gate.clone()
        out[dst + "mlp.up_proj.weight"] = up.clone()
        out[dst + "mlp.down_proj.weight"] = state[src + "mlp.down.weight"]
    return out


def from_hf_state_dict(cfg: ModelConfig, hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers Llama/Qwen2 state dict -> our unit-keyed state dict."""
    def take(key: str) -> torch.Tensor:
        if key not in hf_state:
            raise ConfigError(f"HF checkpoint lacks tensor {key!r}; is it a {cfg.family} model "
                              f"with {cfg.num_layers} layers?")
        return hf_state[key]

    out = {"embedding.weight": take("model.embed_tokens.weight"),
           "head.norm.weight": take("model.norm.weight")}
    if not cfg.share_embeddings_and_output_weights:
        out["head.output.weight"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        out[dst + "input_norm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "post_attention_norm.weight"] = take(src + "post_attention_layernorm.weight")
        for kind in ("weight", "bias") if cfg.add_qkv_bias else ("weight",):
            out[dst + f"attention.qkv.{kind}"] = torch.cat(
                [take(src + f"self_attn.{p}.{kind}") for p in ("q_proj", "k_proj", "v_proj")], dim=0)
        out[dst + "attention.out.weight"] = take(src + "self_attn.o_proj.weight")
        out[dst + "mlp.gate_up.weight"] = torch.cat(
            [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")], dim=0)
        out[dst + "mlp.down.weight"] = take(src + "mlp.down_proj.weight")
    return out
