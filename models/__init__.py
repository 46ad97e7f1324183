"""Model definitions (installed as ``hetpipe.models``): LLaMA-3 and Qwen2
decoder-only LMs as ordered lists of partitionable units, their FLOP counts,
and conversion to and from Hugging Face transformers."""
from hetpipe.models.model_config import ModelConfig, model_preset, preset_names
from hetpipe.models.transformer import CausalLM, build_model

__all__ = ["ModelConfig", "model_preset", "preset_names", "CausalLM", "build_model"]
