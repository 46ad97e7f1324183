"""Model families: one :class:`~hetpipe.models.families.spec.FamilySpec` per
family, found by name (``model.family``) or by Hugging Face ``model_type``.

Adding a dense family: a module here declaring its spec, its line in
``_MODULES`` below, presets in ``configs/model/``, and its cases in the HF
and TP tests (docs/architecture.md, "Adding a model family").
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hetpipe.errors import ConfigError
from hetpipe.models.families import llama, qwen2, qwen3
from hetpipe.models.families.spec import FamilySpec, HFNames, TPPlan

if TYPE_CHECKING:
    from hetpipe.models.model_config import ModelConfig

_MODULES = (llama, qwen2, qwen3)
FAMILIES: dict[str, FamilySpec] = {m.SPEC.name: m.SPEC for m in _MODULES}


def family_names() -> tuple[str, ...]:
    return tuple(FAMILIES)


def family_spec(name: str) -> FamilySpec:
    """The spec of family ``name``; a one-line ConfigError naming the known ones otherwise."""
    spec = FAMILIES.get(name)
    if spec is None:
        raise ConfigError(f"model.family={name!r} is not supported (choose one of {', '.join(FAMILIES)})")
    return spec


def spec_of(cfg: "ModelConfig") -> FamilySpec:
    return family_spec(cfg.family)


def family_for_hf_model_type(model_type) -> FamilySpec:
    """The family whose HF config has ``model_type``."""
    for spec in FAMILIES.values():
        if spec.hf.model_type == model_type:
            return spec
    known = [s.hf.model_type for s in FAMILIES.values()]
    raise ConfigError(f"HF model_type {model_type!r} is not supported ({', '.join(known[:-1])} or {known[-1]})")


__all__ = ["FAMILIES", "FamilySpec", "HFNames", "TPPlan", "family_names", "family_spec", "spec_of",
           "family_for_hf_model_type"]
