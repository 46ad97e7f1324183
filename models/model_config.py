"""Model shape: one dataclass for every supported decoder-only family.

Field names follow Megatron-LM where the concept exists (``num_layers``,
``ffn_hidden_size``, ``num_query_groups``, ``rotary_base`` ...), so users can
carry their numbers over. The same dataclass is the hydra structured-config
schema for the ``model`` group, so a typo'd field or a string where an int
belongs is refused when the config is composed.

Presets (``llama8b``, ``qwen2_7b``, ``qwen3_8b``, ``tiny_llama`` ...) live as
YAML in ``configs/model/`` so that hydra and plain Python read the same file.
What a ``family`` adds to these numbers (optional parts, HF names, the
arithmetic) is its spec's (:mod:`hetpipe.models.families`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import resources
from typing import Optional

import yaml

import hetpipe.errors.value_checks as value_checks
from hetpipe.errors import ConfigError
from hetpipe.models.families import family_spec


@dataclass
class ModelConfig:
    # Which preset this is; names the run directory and the HF architecture.
    name: str = "custom"
    # A key of hetpipe.models.families.FAMILIES: "llama" (LLaMA-2/3 layout),
    # "qwen2" (adds q/k/v biases) or "qwen3" (QK-norm, no biases).
    family: str = "llama"
    # Decoder layers.
    num_layers: int = 2
    # Width of the residual stream.
    hidden_size: int = 64
    # SwiGLU intermediate size (the size of one of the two gate/up halves).
    ffn_hidden_size: int = 172
    # Query heads per layer.
    num_attention_heads: int = 4
    # Key/value heads (grouped-query attention); equal to heads means MHA.
    num_query_groups: int = 4
    # Per-head size; None means hidden_size // num_attention_heads.
    kv_channels: Optional[int] = None
    # Rows of the embedding and the head; every id of the tokenizer must be below it.
    vocab_size: int = 512
    # Longest sequence the model is built for; seq_length may not exceed it.
    max_position_embeddings: int = 256
    # RoPE base (HF's rope_theta).
    rotary_base: float = 10000.0
    # RoPE frequency scaling (the rope_type of HF's rope_scaling, called
    # rope_parameters since transformers 5): None for plain RoPE, or "llama3",
    # the rule of Meta's Llama 3.1 release that stretched an 8K-trained model
    # to a 128K context. It slows only the rotations too slow to have turned
    # fully within the original context, so the fast ones that resolve nearby
    # positions stay as trained. The four fields below are read only under
    # "llama3"; their defaults are Llama 3.1's, as in Megatron-LM (Llama 3.2
    # uses factor 32).
    rope_scaling: Optional[str] = None
    # How many times slower the long-wavelength rotations turn (HF's factor).
    rope_scaling_factor: float = 8.0
    # Wavelengths longer than original context / low factor are slowed by the
    # full factor, those shorter than original context / high factor are left
    # alone, and the band between is interpolated smoothly (HF's
    # low_freq_factor and high_freq_factor).
    rope_low_freq_factor: float = 1.0
    # The band's other end: see rope_low_freq_factor (HF's high_freq_factor).
    rope_high_freq_factor: float = 4.0
    # The context the model was pretrained at before scaling (HF's
    # original_max_position_embeddings).
    rope_original_max_position_embeddings: int = 8192
    # RMSNorm's epsilon (HF's rms_norm_eps).
    norm_epsilon: float = 1e-5
    # Biases on the q/k/v projections (Qwen2; refused where the family has none).
    add_qkv_bias: bool = False
    # Tie the output head to the input embedding (Megatron's default is tied;
    # LLaMA-3-8B and Qwen2-7B are untied, small Qwen2 models are tied).
    share_embeddings_and_output_weights: bool = False
    # Std of the normal init; output projections are scaled by 1/sqrt(2L).
    init_method_std: float = 0.02

    def __post_init__(self) -> None:
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def num_units(self) -> int:
        """Partitionable units: embedding, each decoder layer, head."""
        return self.num_layers + 2

    def validate(self) -> None:
        spec = family_spec(self.family)
        for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                      "num_query_groups", "vocab_size", "max_position_embeddings"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"model.{field}={getattr(self, field)} must be positive")
        for field in ("rotary_base", "norm_epsilon"):
            value_checks.positive(f"model.{field}", getattr(self, field))
        value_checks.in_range("model.init_method_std", self.init_method_std, 0)
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}; set model.kv_channels")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"model.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"model.num_query_groups={self.num_query_groups}")
        if self.head_dim % 2:
            raise ConfigError(f"head size {self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling not in (None, "llama3"):
            raise ConfigError(f"model.rope_scaling={self.rope_scaling!r} is not supported (null or 'llama3')")
        if self.rope_scaling == "llama3":
            for field in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
                value_checks.finite(f"model.{field}", getattr(self, field))
            if self.rope_scaling_factor < 1:
                raise ConfigError(f"model.rope_scaling_factor={self.rope_scaling_factor} must be at least 1")
            if self.rope_original_max_position_embeddings <= 0:
                raise ConfigError("model.rope_original_max_position_embeddings="
                                  f"{self.rope_original_max_position_embeddings} must be positive")
            # The interpolation divides by high - low, and the fully scaled band
            # starts at wavelength original context / low.
            if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ConfigError(f"model.rope_low_freq_factor={self.rope_low_freq_factor} and "
                                  f"model.rope_high_freq_factor={self.rope_high_freq_factor} "
                                  "must satisfy 0 < low < high")
        spec.check_config(self)

    def num_parameters(self) -> int:
        """Exact parameter count of the full model (shared weights counted once)."""
        return family_spec(self.family).num_parameters(self)

    @classmethod
    def of_family(cls, family: str, **fields) -> "ModelConfig":
        """A config of ``family`` with its released models' defaults (the
        spec's ``config_defaults``) under ``fields``."""
        return cls(family=family, **{**family_spec(family).config_defaults, **fields})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def preset_names() -> list[str]:
    """Names of the model presets shipped in configs/model/."""
    root = resources.files("hetpipe.configs") / "model"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def model_preset(name: str, **overrides) -> ModelConfig:
    """Load a preset from configs/model/<name>.yaml, applying keyword overrides."""
    path = resources.files("hetpipe.configs") / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown model {name!r} (available: {', '.join(preset_names())})")
    values = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k != "defaults"}
    values.update(overrides)
    unknown = set(values) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ConfigError(f"model {name!r}: unknown fields {sorted(unknown)}")
    return ModelConfig(**values)
