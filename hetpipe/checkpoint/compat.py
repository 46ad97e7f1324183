"""Whether saved weights fit this run's model, said in terms a user can act on.

A checkpoint or HF directory written for another model must fail before any
tensor is copied, naming the first tensor whose shape differs (and both
shapes) or the config field that differs; loading weights into a model with,
say, a different RoPE base would otherwise "work" and train garbage.
"""
from __future__ import annotations

from typing import Any, Mapping

from hetpipe.checkpoint.manifest import CheckpointError
from hetpipe.models import ModelConfig

# Fields that do not change what the weights compute: the preset's name, the
# init scale (irrelevant once weights are loaded), and the longest sequence
# (continued pretraining at a longer context is legitimate).
IGNORED_FIELDS = ("name", "init_method_std", "max_position_embeddings")


def config_differences(saved: Mapping[str, Any], cfg: ModelConfig) -> list[str]:
    """``field=saved vs here`` for each meaningful model field that differs."""
    now = cfg.to_dict()
    return [f"model.{key}={saved[key]!r} there but {now[key]!r} here" for key in now
            if key not in IGNORED_FIELDS and key in saved and saved[key] != now[key]]


def check_model_fits(source: str, saved_cfg: Mapping[str, Any], saved_shapes: Mapping[str, tuple[int, ...]],
                     expected_shapes: Mapping[str, tuple[int, ...]], cfg: ModelConfig) -> None:
    """Raise if tensors saved in ``source`` cannot be this model's, naming the first culprit."""
    differences = config_differences(saved_cfg, cfg)
    why = f" ({'; '.join(differences)})" if differences else ""
    for name, shape in expected_shapes.items():
        if name in saved_shapes and tuple(saved_shapes[name]) != tuple(shape):
            raise CheckpointError(f"{source} was written for a different model shape: tensor {name} has shape "
                                  f"{list(saved_shapes[name])} there but {list(shape)} in this model{why}")
    for name in expected_shapes:
        if name not in saved_shapes:
            raise CheckpointError(f"{source} has no tensor {name}, which this model needs{why}")
    extra = sorted(set(saved_shapes) - set(expected_shapes))
    if extra:
        raise CheckpointError(f"{source} holds tensor {extra[0]}, which this model lacks{why}")
    if differences:
        raise CheckpointError(f"{source} was written for a different model: {'; '.join(differences)}")
