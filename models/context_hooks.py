"""Context parallelism's hooks into the model: which modules learn their CP
shard, and the loss of a rank holding part of each sequence.

The split itself and the attention across it live in
:mod:`hetpipe.parallel.context`; the model code only carries the shard
(``CausalLM.context``, ``Attention.context``) and asks it for its slices.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from hetpipe.models.layers import Attention
from hetpipe.models.loss import IGNORE_INDEX
from hetpipe.parallel.context import ContextShard


def use_context_parallel(model: nn.Module, shard: Optional[ContextShard]) -> None:
    """Make every chunk and attention module of ``model`` run on ``shard``'s
    part of each sequence (None, or one rank: the whole sequence)."""
    shard = shard if shard is not None and shard.size > 1 else None
    for module in model.modules():  # CausalLM, Attention and their TP subclasses declare the slot
        if isinstance(module, Attention) or any("context" in vars(c) for c in type(module).__mro__):
            module.context = shard


def context_loss(head: nn.Module, x: torch.Tensor, labels: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """This rank's term of the whole sequence's mean loss, times the CP degree.

    The head averages over the rank's counted tokens; weighting that by their
    share of the whole microbatch's counted tokens (every rank has all the
    labels, so no message) and by C makes the mean over the CP group - which
    the gradient reduction over DP x CP takes - the whole sequence's mean,
    as Megatron scales its CP loss."""
    local = shard.shard(labels)
    counted = (local != IGNORE_INDEX).sum()
    total = (labels != IGNORE_INDEX).sum().clamp(min=1)
    loss = head(x, local)
    return torch.where(counted > 0, loss, torch.zeros_like(loss)) * (counted * shard.size / total)
