"""Conversion between hetpipe models and Hugging Face transformers.

Maps configs and state dicts in both directions for every family of
:mod:`hetpipe.models.families` (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``). What differs between families (the HF names, extra
config arguments, unsupported features, per-layer tensors beyond the dense
decoder's) is read from the family's spec; this module holds what they
share: the config fields, RoPE settings and the tensor layout below. Our
layers fuse q/k/v and gate/up into single matrices;
HF keeps them apart, so the converter concatenates and splits along the output
dimension. Both sides use the same rotate-half RoPE layout, so no permutation
of the q/k rows is needed. Conversion is exact: export then import returns the
same tensors bit for bit. Import takes every tensor of the checkpoint or
refuses it, naming those it cannot place (an o_proj bias that is not zero,
an unknown tensor), so nothing is dropped silently. Of the RoPE variants,
plain RoPE and the "llama3" scaling of Llama 3.1 / 3.2 convert; any other
rope_type is refused.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from hetpipe.errors import ConfigError
from hetpipe.models.families import family_for_hf_model_type, spec_of
from hetpipe.models.model_config import ModelConfig

# ModelConfig field -> the HF config attribute every family's config has;
# the key/value heads, tying and init scale, which older configs may lack,
# are read with their defaults below.
_CONFIG_FIELDS = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
                  "ffn_hidden_size": "intermediate_size", "num_attention_heads": "num_attention_heads",
                  "vocab_size": "vocab_size", "max_position_embeddings": "max_position_embeddings",
                  "norm_epsilon": "rms_norm_eps"}
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
    """A transformers config (the family's config class) describing ``cfg``."""
    import transformers

    spec = spec_of(cfg)
    common = {hf: getattr(cfg, ours) for ours, hf in _CONFIG_FIELDS.items()}
    common.update(num_key_value_heads=cfg.num_query_groups, rope_theta=cfg.rotary_base,
                  tie_word_embeddings=cfg.share_embeddings_and_output_weights,
                  initializer_range=cfg.init_method_std, hidden_act="silu", architectures=[spec.hf.architecture])
    if cfg.rope_scaling is not None:
        # Both transformers 4.x and 5.x take rope_scaling (with rope_theta beside
        # it); 5.x files it, theta included, under rope_parameters.
        common["rope_scaling"] = _hf_rope_scaling(cfg)
    return getattr(transformers, spec.hf.config_class)(**common, **spec.hf_config_extra(cfg))


def from_hf_config(hf_config: Any, name: str = "hf") -> ModelConfig:
    """The ModelConfig of a transformers config of a supported family."""
    spec = family_for_hf_model_type(getattr(hf_config, "model_type", None))
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ConfigError(f"HF hidden_act {hf_config.hidden_act!r} is not supported (silu only)")
    spec.hf_config_check(hf_config)
    if getattr(hf_config, "mlp_bias", False):
        raise ConfigError("HF config has MLP biases, which hetpipe does not implement")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    fields = {ours: getattr(hf_config, hf) for ours, hf in _CONFIG_FIELDS.items()}
    fields.update(
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        kv_channels=None if head_dim == hf_config.hidden_size // heads else head_dim,
        **_rope_fields(hf_config),
        add_qkv_bias=spec.qkv_bias == "hf_requires" or bool(getattr(hf_config, "attention_bias", False)),
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
    )
    return ModelConfig(name=name, family=spec.name, **fields)


# -- tensors -------------------------------------------------------------------------
# One decoder layer: our tensor (under layers.<i>.) <- HF's (under
# model.layers.<i>.), several HF tensors being concatenated along dim 0 into
# one fused matrix of ours; "{kind}" is weight, and bias where the q/k/v
# projections have one. A family's own tensors follow (spec.hf_layer_keys).
_LAYER_KEYS = (("input_norm.weight", ("input_layernorm.weight",)),
               ("post_attention_norm.weight", ("post_attention_layernorm.weight",)),
               ("attention.qkv.{kind}", ("self_attn.q_proj.{kind}", "self_attn.k_proj.{kind}",
                                         "self_attn.v_proj.{kind}")),
               ("attention.out.weight", ("self_attn.o_proj.weight",)),
               ("mlp.gate_up.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
               ("mlp.down.weight", ("mlp.down_proj.weight",)))


def _layer_keys(cfg: ModelConfig) -> list[tuple[str, tuple[str, ...]]]:
    """(ours, HF parts) of one layer's tensors, in the order they are written."""
    keys = []
    for ours, hf in _LAYER_KEYS:
        kinds = ("weight", "bias") if "{kind}" in ours and cfg.add_qkv_bias else ("weight",)
        keys += [(ours.format(kind=k), tuple(p.format(kind=k) for p in hf)) for k in kinds]
    return keys + [(ours, (hf,)) for ours, hf in spec_of(cfg).hf_layer_keys]


def _split_sizes(cfg: ModelConfig, parts: int) -> list[int]:
    """Rows of each HF part of a fused matrix: q, k, v, or gate and up."""
    if parts == 3:
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_query_groups * cfg.head_dim
        return [q, kv, kv]
    return [cfg.ffn_hidden_size] * parts


def hf_key_units(cfg: ModelConfig, key: str) -> set[int]:
    """The model units an HF tensor feeds (empty: not one of ours)."""
    last = cfg.num_units - 1
    if key == "model.embed_tokens.weight":
        return {0, last} if cfg.share_embeddings_and_output_weights else {0}
    if key.startswith("model.layers."):
        return {int(key.split(".")[2]) + 1}
    if key in ("model.norm.weight", "lm_head.weight"):
        return {last}
    return set()


def to_hf_state_dict(cfg: ModelConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict (whole model, unit-keyed) -> transformers' key layout."""
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": state["embedding.weight"],
                                    "model.norm.weight": state["head.norm.weight"]}
    if not cfg.share_embeddings_and_output_weights:
        out["lm_head.weight"] = state["head.output.weight"]
    keys = _layer_keys(cfg)
    for i in range(cfg.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        for ours, hf in keys:
            if len(hf) == 1:
                out[dst + hf[0]] = state[src + ours]
                continue
            for part, t in zip(hf, state[src + ours].split(_split_sizes(cfg, len(hf)), dim=0)):
                out[dst + part] = t.clone()
    for key in _zero_out_bias_keys(cfg):
        out[key] = state["embedding.weight"].new_zeros(cfg.hidden_size)
    return out


def from_hf_state_dict(cfg: ModelConfig, hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers state dict of ``cfg``'s family -> our unit-keyed state dict."""
    consumed: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in hf_state:
            raise ConfigError(f"HF checkpoint lacks tensor {key!r}; is it a {cfg.family} model "
                              f"with {cfg.num_layers} layers?")
        consumed.add(key)
        return hf_state[key]

    out = {"embedding.weight": take("model.embed_tokens.weight"),
           "head.norm.weight": take("model.norm.weight")}
    if not cfg.share_embeddings_and_output_weights:
        out["head.output.weight"] = take("lm_head.weight")
    keys = _layer_keys(cfg)
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for ours, hf in keys:
            parts = [take(src + p) for p in hf]
            out[dst + ours] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    consumed.update(key for key in _zero_out_bias_keys(cfg) if key in hf_state and _is_zero(hf_state[key]))
    if _is_tied_copy(cfg, hf_state, out["embedding.weight"]):
        consumed.add("lm_head.weight")
    _refuse_unplaced(hf_state, consumed)
    return out


# -- tensors no layer of ours holds ------------------------------------------------------
# Buffers some older HF checkpoints saved beside the weights; transformers
# ignores them on load and recomputes them from the config, as hetpipe does
# (layers.model_rope_frequencies), so they carry nothing to drop.
_DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)
# How many of the tensors an import cannot place its one-line error names.
_NAMED = 4


def _zero_out_bias_keys(cfg: ModelConfig) -> list[str]:
    """HF's o_proj biases that ``cfg``'s model computes as zeros: those its
    HF form has although our output projection has no bias
    (FamilySpec.hf_out_bias_with_qkv)."""
    if not (cfg.add_qkv_bias and spec_of(cfg).hf_out_bias_with_qkv):
        return []
    return [f"model.layers.{i}.self_attn.o_proj.bias" for i in range(cfg.num_layers)]


def _is_zero(t: torch.Tensor) -> bool:
    # A meta tensor belongs to a unit another rank holds; that rank checks it.
    return t.is_meta or not bool(t.any())


def _is_tied_copy(cfg: ModelConfig, hf_state: Mapping[str, torch.Tensor], embedding: torch.Tensor) -> bool:
    """Whether the checkpoint's lm_head.weight is the tied embedding written
    out again (a transformers state dict holds both names): nothing to place."""
    if not cfg.share_embeddings_and_output_weights or "lm_head.weight" not in hf_state:
        return False
    head = hf_state["lm_head.weight"]
    return head.is_meta or embedding.is_meta or torch.equal(head, embedding)


def _refuse_unplaced(hf_state: Mapping[str, torch.Tensor], consumed: set[str]) -> None:
    """One ConfigError naming the HF tensors the conversion did not take:
    loading without them would say "initialised from the checkpoint" while
    computing another function."""
    left = [key for key in hf_state if key not in consumed and not key.endswith(_DERIVED_SUFFIXES)]
    if not left:
        return
    more = f" and {len(left) - _NAMED} more" if len(left) > _NAMED else ""
    why = ("; hetpipe's attention output projection has no bias, so only all-zero o_proj biases import"
           if any(key.endswith("o_proj.bias") for key in left) else "")
    raise ConfigError(f"HF checkpoint has tensors hetpipe cannot place: {', '.join(left[:_NAMED])}{more}{why}")
