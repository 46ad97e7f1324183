"""Model definitions (installed as ``hetpipe.models``): LLaMA-3 and Qwen2
decoder-only LMs as ordered lists of partitionable units, their FLOP counts,
and conversion to and from Hugging Face transformers.

The torch-built names (``CausalLM``, ``build_model``) load on first use, so
that a config or the planner, which read only ``model_config``, never import
torch (``python -m hetpipe.plan`` plans without it)."""
from hetpipe.models.model_config import ModelConfig, model_preset, preset_names

__all__ = ["ModelConfig", "model_preset", "preset_names", "CausalLM", "build_model"]


def __getattr__(name: str):
    """``CausalLM`` and ``build_model`` from ``transformer`` (torch) when first asked for."""
    if name in ("CausalLM", "build_model"):
        from hetpipe.models import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module 'hetpipe.models' has no attribute {name!r}")
