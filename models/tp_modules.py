"""Tensor-parallel counterparts of the decoder's modules: the dense module's
math on this rank's part of the weights, with the TP communication around it.

The TP plan (:mod:`hetpipe.models.parallelize`) builds one of these for each
module it splits and puts it where the dense one was. Each one:

* subclasses the dense module, so everything that finds modules by type
  (``set_attention_backend``, ``fuse_elementwise``, ``Bf16Weights``) treats
  it the same, and its forward reuses the dense forward;
* is made by the dense class's own constructor on the meta device (no memory,
  no draw from the RNG), then handed this rank's parts, which the plan cut
  from the dense module's weights;
* keeps its projections plain ``nn.Linear``s and does the communication in
  its own forward, around them: ``Bf16Weights`` replaces a decoder linear's
  forward with its fused-gradient one, which would drop anything inside it.

Inputs and outputs keep the single-process shapes - full sequence, full
hidden size, the same on every TP rank - so the pipeline engine does not
change. With sequence parallelism the activations *inside* a chunk are this
rank's sequence slice (see :class:`TensorParallelCausalLM`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetpipe.errors import ConfigError
from hetpipe.models.layers import Attention, RMSNorm, SwiGLU
from hetpipe.models.loss import IGNORE_INDEX
from hetpipe.models.model_config import ModelConfig
from hetpipe.models.transformer import CausalLM, Embedding, Head
from hetpipe.parallel.tp_collectives import (SEQ_DIM, TPGroup, enter_column_parallel, gather_replicated,
                                             leave_row_parallel, scatter_to_sequence_parallel,
                                             vocab_parallel_cross_entropy)


class TensorParallelAttention(Attention):
    """Attention over this rank's heads: ``qkv`` column-parallel (this rank's
    query heads and the KV heads they read), ``out`` row-parallel."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, qkv: nn.Linear, out: nn.Linear,
                 num_heads: int, num_groups: int, whole: Optional[dict[str, nn.Module]] = None) -> None:
        with torch.device("meta"):
            super().__init__(cfg)
        self.tp = tp
        self.num_heads, self.num_groups = num_heads, num_groups
        kv_size = num_groups * self.head_dim
        self.split_sizes = (num_heads * self.head_dim, kv_size, kv_size)
        self.qkv, self.out = qkv, out
        # Submodules kept whole on every rank (QK-norm's per-head norms).
        for name, module in (whole or {}).items():
            setattr(self, name, module)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs=None) -> torch.Tensor:
        x = enter_column_parallel(x, self.tp)
        return leave_row_parallel(super().forward(x, cos, sin, docs), self.tp)


class TensorParallelSwiGLU(SwiGLU):
    """SwiGLU over this rank's slice of the intermediate size: ``gate_up``
    column-parallel (still stored as [gate | up]), ``down`` row-parallel."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, gate_up: nn.Linear, down: nn.Linear) -> None:
        with torch.device("meta"):
            super().__init__(cfg)
        self.tp = tp
        self.gate_up, self.down = gate_up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_column_parallel(x, self.tp)
        return leave_row_parallel(super().forward(x), self.tp)


class VocabParallelEmbedding(Embedding):
    """Embedding rows [vocab_start, vocab_end) of the vocabulary on this rank.

    Tokens outside the range look up row 0 and are zeroed; the sum over the
    group is then the full lookup (scattered along the sequence with SP).
    """

    def __init__(self, cfg: ModelConfig, tp: TPGroup, weight: nn.Parameter, vocab_start: int) -> None:
        with torch.device("meta"):
            super().__init__(cfg)
        self.tp = tp
        self.weight = weight
        self.vocab_start, self.vocab_end = vocab_start, vocab_start + weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        not_mine = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(not_mine, 0)
        out = F.embedding(local, self.weight).masked_fill(not_mine.unsqueeze(-1), 0.0)
        return leave_row_parallel(out, self.tp)


class VocabParallelHead(Head):
    """Final norm, output projection onto this rank's vocab rows, and the
    vocab-parallel loss.

    ``x`` is in the chunk's activation layout: [b, s, h] without sequence
    parallelism, this rank's [b, s/tp, h] slice with it (the norm runs on the
    slice, then the sequence is gathered in front of the projection). A tied
    head reads the vocab-parallel embedding's weight, whose rows are its own.
    """

    def __init__(self, cfg: ModelConfig, tp: TPGroup, norm: RMSNorm, output: Optional[nn.Linear],
                 tied: Optional[VocabParallelEmbedding], vocab_start: int) -> None:
        with torch.device("meta"):
            super().__init__(cfg, tied)
        self.tp = tp
        self.norm = norm
        if output is not None:
            self.output = output
        self.vocab_start = vocab_start

    def _local_logits(self, x: torch.Tensor) -> torch.Tensor:
        h = enter_column_parallel(self.norm(x), self.tp)
        return F.linear(h, self.output_weight)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The full [b, s, vocab] logits on every rank (for evaluation)."""
        return gather_replicated(self._local_logits(x), -1, self.tp)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over all positions, computed in fp32."""
        logits = self._local_logits(x)
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), self.vocab_start, self.tp,
                                            ignore_index=IGNORE_INDEX)


class TensorParallelCausalLM(CausalLM):
    """A chunk whose units run tensor-parallel; same inputs and outputs as the dense one.

    With sequence parallelism the activations inside the chunk are this
    rank's sequence slice: the embedding reduce-scatters into it, a chunk
    without the embedding scatters its input, and a chunk without the head
    gathers the sequence again before returning, so stage boundaries carry
    full [b, s, h]. The units keep their names, so checkpoints stay keyed by
    model unit.
    """

    def __init__(self, dense: CausalLM, tp: TPGroup, embedding: Optional[Embedding], layers: nn.ModuleDict,
                 head: Optional[Head]) -> None:
        with torch.device("meta"):
            super().__init__(dense.cfg, dense.unit_range)
        self.tp = tp
        self.inv_freq = dense.inv_freq
        self.embedding, self.layers, self.head = embedding, layers, head

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def tp_group(self) -> Optional[dist.ProcessGroup]:
        return self.tp.group

    @property
    def tp_sequence_parallel(self) -> bool:
        return self.tp.sequence_parallel

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        tp = self.tp
        if self.context is not None:  # CP: this rank's share of the sequence (sequence parallel refused)
            return self._forward_context(inputs, labels, tokens)
        seq_length = inputs.shape[1]
        if tp.sequence_parallel and seq_length % tp.size:
            raise ConfigError(f"sequence length {seq_length} is not divisible by the tensor-parallel size "
                              f"{tp.size}; sequence parallelism splits the sequence evenly over the TP ranks")
        if self.embedding is not None:
            x = self.embedding(inputs)
        elif tp.sequence_parallel:
            x = scatter_to_sequence_parallel(inputs, tp)
        else:
            x = inputs
        if self.layers:
            # RoPE tables and documents cover the whole sequence: attention sees it gathered.
            cos, sin, docs = self.rope_and_documents(x, inputs, tokens)
            for layer in self.layers.values():
                x = layer(x, cos, sin, docs)
        if self.head is None:
            if tp.sequence_parallel:
                # The next stage's gradient is full and identical on every TP rank.
                x = gather_replicated(x, SEQ_DIM, tp)
            return x
        return self.head(x, labels) if labels is not None else self.head.logits(x)
