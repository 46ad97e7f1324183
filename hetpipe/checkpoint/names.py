"""Plan-neutral names for a rank's model tensors and optimizer state.

A :class:`~hetpipe.models.CausalLM` slice already names its parameters by
model unit (``layers.17.mlp.down.weight``), whatever stage holds it. The one
exception is a tied output head on a stage without the embedding: it keeps a
copy named ``head.output.weight`` that is, by construction and by the tied
gradient sync, the same tensor as ``embedding.weight``. A checkpoint stores
that tensor once, as ``embedding.weight`` (with the embedding owner's
optimizer state), and loads it into both copies.
"""
from __future__ import annotations

from typing import Sequence

import torch

from hetpipe.models import CausalLM, ModelConfig

EMBEDDING = "embedding.weight"
TIED_HEAD_COPY = "head.output.weight"


def canonical_name(cfg: ModelConfig, name: str) -> str:
    if name == TIED_HEAD_COPY and cfg.share_embeddings_and_output_weights:
        return EMBEDDING
    return name


def load_targets(chunks: Sequence[CausalLM]) -> list[tuple[str, torch.Tensor]]:
    """(canonical name, tensor to fill) for every tensor the chunks hold, tied copies included."""
    return [(canonical_name(chunk.cfg, name), tensor)
            for chunk in chunks for name, tensor in chunk.state_dict(keep_vars=True).items()]


def parameter_names(chunks: Sequence[CausalLM]) -> dict[int, tuple[str, bool]]:
    """id(parameter) -> (canonical name, whether it is a tied copy)."""
    return {id(p): (canonical_name(chunk.cfg, name), canonical_name(chunk.cfg, name) != name)
            for chunk in chunks for name, p in chunk.named_parameters()}


def whole_model_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the whole model (built on the meta device)."""
    with torch.device("meta"):
        whole = CausalLM(cfg)
    return {name: tuple(t.shape) for name, t in whole.state_dict().items()}


def chunk_units(chunks: Sequence[CausalLM]) -> list[list[int]]:
    """The [start, stop) unit range of each chunk, in chunk order."""
    return [list(chunk.unit_range) for chunk in chunks]
