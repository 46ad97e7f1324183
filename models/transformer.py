"""A decoder-only causal LM built as an ordered list of partitionable units.

Unit 0 is the token embedding, units 1..L are the decoder layers and unit L+1
is the final norm + output head + loss. A pipeline stage is a contiguous slice
of units, and :class:`CausalLM` builds either the whole model or one slice with
the *same* parameter names (``embedding.weight``, ``layers.17.mlp.down.weight``,
``head.norm.weight``), so checkpoints are keyed by model unit, never by rank.

Weights are initialised per unit from a generator seeded by (seed, unit), so
any split of the model across stages starts from identical weights - the
precondition for bit-exact pipeline-vs-single-process parity.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hetpipe.errors import ConfigError
from hetpipe.models.model_config import ModelConfig
from hetpipe.models.documents import DocumentRule, Documents, find_documents
from hetpipe.models.layers import DecoderLayer, RMSNorm, model_rope_frequencies, rope_cos_sin, rope_cos_sin_at
from hetpipe.models.liger import linear_cross_entropy as liger_linear_cross_entropy
from hetpipe.models.loss import IGNORE_INDEX, fused_linear_cross_entropy


def unit_generator(seed: int, unit: int, device: torch.device) -> torch.Generator:
    """The RNG that initialises one unit, independent of where the unit lives."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + unit)
    return gen


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class Head(nn.Module):
    """Final RMSNorm, output projection to the vocabulary, and the LM loss.

    With tied embeddings and the embedding in the same module, the projection
    reuses the embedding's weight (and the state dict holds it once). On a
    pipeline stage without the embedding it keeps its own copy, initialised
    identically; the pipeline keeps the two copies' gradients in sync.
    """

    # Set per instance by fuse_elementwise(): the loss's chunk math compiled.
    fused = False
    # Set per instance by use_liger(): liger's fused linear cross-entropy instead.
    liger = False
    # Tokens per loss chunk; None: hetpipe.models.loss picks them (benchmarks set it).
    chunk_tokens: Optional[int] = None

    def __init__(self, cfg: ModelConfig, tied_embedding: Optional[Embedding] = None) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        # A plain list hides the embedding from module registration, so its
        # weight is not saved a second time under head.*.
        self._tied = [tied_embedding] if tied_embedding is not None else []
        self.output = None if self._tied else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def output_weight(self) -> torch.Tensor:
        return self._tied[0].weight if self._tied else self.output.weight

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.output_weight)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over all positions (labels of -100 are
        skipped), computed in fp32 without materialising the whole microbatch's
        logits (see :mod:`hetpipe.models.loss`).

        A custom autograd Function gets no autocast, so the projection's dtype
        is decided here: autocast's dtype when it is on (bf16 on GPU), else the
        activations' dtype.
        """
        h = self.norm(x)
        device_type = h.device.type
        if torch.is_autocast_enabled(device_type):
            compute_dtype = torch.get_autocast_dtype(device_type)
        else:
            compute_dtype = h.dtype
        if self.liger:
            return liger_linear_cross_entropy(h.flatten(0, -2), self.output_weight, labels.flatten(),
                                              compute_dtype, IGNORE_INDEX)
        return fused_linear_cross_entropy(h.flatten(0, -2), self.output_weight, labels.flatten(),
                                          chunk_tokens=self.chunk_tokens, compute_dtype=compute_dtype,
                                          fused=self.fused)


class CausalLM(nn.Module):
    """The whole model, or the contiguous slice of units [start, stop)."""

    # Set per instance by set_document_masking(); None: every row is one causal sequence.
    document_rule: Optional[DocumentRule] = None
    # Set per instance by hetpipe.models.context_hooks.use_context_parallel: this
    # rank's share of each sequence (hetpipe.parallel.context); None: all of it.
    context = None

    def __init__(self, cfg: ModelConfig, units: Optional[tuple[int, int]] = None) -> None:
        super().__init__()
        start, stop = units if units is not None else (0, cfg.num_units)
        if not 0 <= start < stop <= cfg.num_units:
            raise ConfigError(
                f"unit range [{start}, {stop}) is not a non-empty slice of the "
                f"{cfg.num_units} units of model {cfg.name!r}")
        self.cfg = cfg
        self.unit_range = (start, stop)
        self.register_buffer(
            "inv_freq", model_rope_frequencies(cfg), persistent=False)
        self.embedding = Embedding(cfg) if start == 0 else None
        last_layer_unit = cfg.num_layers  # layer i is unit i + 1
        self.layers = nn.ModuleDict({
            str(unit - 1): DecoderLayer(cfg)
            for unit in range(max(start, 1), min(stop, last_layer_unit + 1))
        })
        tied = self.embedding if cfg.share_embeddings_and_output_weights else None
        self.head = Head(cfg, tied) if stop == cfg.num_units else None

    @property
    def is_first(self) -> bool:
        return self.embedding is not None

    @property
    def is_last(self) -> bool:
        return self.head is not None

    def forward(self, inputs: torch.Tensor, labels: Optional[torch.Tensor] = None,
                tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; loss, logits or hidden states out.

        The last slice returns the scalar loss when ``labels`` is given and the
        logits otherwise; any other slice returns hidden states [b, s, h].
        ``tokens``: the microbatch's input ids, which a chunk with document
        masking reads its documents from (best on the CPU; the first slice's
        inputs serve when they are not given).
        """
        if self.context is not None:
            return self._forward_context(inputs, labels, tokens)
        x = self.embedding(inputs) if self.embedding is not None else inputs
        if self.layers:
            cos, sin, docs = self.rope_and_documents(x, inputs, tokens)
            for layer in self.layers.values():
                x = layer(x, cos, sin, docs)
        if self.head is None:
            return x
        return self.head(x, labels) if labels is not None else self.head.logits(x)

    def _forward_context(self, inputs: torch.Tensor, labels: Optional[torch.Tensor],
                         tokens: Optional[torch.Tensor]) -> torch.Tensor:
        """forward on this CP rank's share of the sequence: the engine hands every
        rank the whole microbatch's tokens and labels, the boundary its share of
        the hidden states (hetpipe.models.context_hooks)."""
        from hetpipe.models.context_hooks import context_loss
        shard = self.context
        tokens = tokens if tokens is not None else (inputs if self.embedding is not None else None)
        if tokens is None:
            raise ValueError("context parallelism: a chunk without the embedding needs the microbatch's tokens")
        x = self.embedding(shard.shard(inputs)) if self.embedding is not None else inputs
        if self.layers:
            cos, sin, docs = self.rope_and_documents(x, tokens, tokens)
            cos, sin = shard.shard(cos, cos.dim() - 2), shard.shard(sin, sin.dim() - 2)
            for layer in self.layers.values():
                x = layer(x, cos, sin, docs)
        if self.head is None:
            return x
        return context_loss(self.head, x, labels, shard) if labels is not None else self.head.logits(x)

    def rope_and_documents(self, x: torch.Tensor, inputs: torch.Tensor, tokens: Optional[torch.Tensor]):
        """The RoPE tables and the documents (None without masking) of one microbatch."""
        docs = self._documents(inputs, tokens)
        if docs is None or docs.positions is None:
            return (*rope_cos_sin(self.inv_freq, inputs.shape[1], x.dtype), docs)
        return (*rope_cos_sin_at(self.inv_freq, docs.positions, x.dtype), docs)

    def _documents(self, inputs: torch.Tensor, tokens: Optional[torch.Tensor]) -> Optional[Documents]:
        if self.document_rule is None:
            return None
        if tokens is None:
            if self.embedding is None:
                raise ValueError("document masking: a chunk without the embedding needs the microbatch's tokens")
            tokens = inputs
        return find_documents(tokens, self.document_rule).to(self.inv_freq.device)

    def units(self) -> Iterator[tuple[int, nn.Module]]:
        """(unit index, module) for each unit this slice holds, in order."""
        if self.embedding is not None:
            yield 0, self.embedding
        for name, layer in self.layers.items():
            yield int(name) + 1, layer
        if self.head is not None:
            yield self.cfg.num_units - 1, self.head

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every held unit from its own (seed, unit) generator."""
        cfg, std = self.cfg, self.cfg.init_method_std
        for unit, module in self.units():
            device = next(module.parameters()).device
            gen = unit_generator(seed, unit, device)
            if isinstance(module, Embedding):
                module.weight.normal_(0.0, std, generator=gen)
            elif isinstance(module, DecoderLayer):
                module.init_weights(cfg, gen)
            else:
                module.norm.weight.fill_(1.0)
                if module.output is not None:
                    # An untied head, or a tied head on a stage without the
                    # embedding: the latter must start equal to the embedding.
                    if cfg.share_embeddings_and_output_weights:
                        gen = unit_generator(seed, 0, device)
                    module.output.weight.normal_(0.0, std, generator=gen)


def set_document_masking(model: nn.Module, rule: Optional[DocumentRule]) -> None:
    """Make every chunk in ``model`` mask documents by ``rule`` (None: no masking;
    a rule resetting nothing is none too)."""
    if rule is not None and not (rule.reset_attention_mask or rule.reset_position_ids):
        rule = None
    for module in model.modules():
        if isinstance(module, CausalLM):
            module.document_rule = rule


def build_model(cfg: ModelConfig, seed: int, units: Optional[tuple[int, int]] = None,
                device: torch.device | str = "cpu") -> CausalLM:
    """Build and initialise the model (or a slice of it) directly on ``device``."""
    with torch.device(device):
        model = CausalLM(cfg, units)
    model.init_weights(seed)
    return model
