"""Document masking of packed samples (``data.reset_attention_mask``,
``data.reset_position_ids``): Megatron-LM's ``--reset-attention-mask`` and
``--reset-position-ids``, read from its ``get_ltor_masks_and_position_ids``.

A sample packs documents end to end, each ended by the tokenizer's
end-of-document id (the byte tokenizer's 256). The end-of-document token
belongs to the document it ends. With ``reset_attention_mask`` a token
attends only to earlier tokens of its own document (block-causal); with
``reset_position_ids`` positions restart at 0 on the token after each
end-of-document, so RoPE rotates every document as if it stood alone.

Both are read from the microbatch's input tokens, which every pipeline rank
has (the loader serves each rank the same microbatches; the last stage reads
its labels from them the same way), so no boundary carries them. They are
computed on the host from CPU tokens: the varlen kernel takes the longest
document as a host integer, and reading it from device tokens would wait for
the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(frozen=True)
class DocumentRule:
    """What a chunk does with the end-of-document id ``eod`` of its tokens."""
    eod: int
    reset_attention_mask: bool
    reset_position_ids: bool


@dataclass
class Documents:
    """One microbatch's documents.

    positions: [b, s] position of each token in its document, or None (0..s-1).
    segments: [b, s] index of each token's document in its row, or None (one
    document per row). cu_seqlens: int32 [n + 1], the documents' starts over
    the flattened b*s tokens then b*s (FlashAttention's varlen layout).
    """
    positions: Optional[torch.Tensor]
    segments: Optional[torch.Tensor]
    cu_seqlens: Optional[torch.Tensor]
    max_seqlen: int
    _mask: Optional[torch.Tensor] = field(default=None, repr=False)

    def to(self, device: torch.device) -> "Documents":
        def move(t):
            return None if t is None else t.to(device, non_blocking=True)
        return Documents(move(self.positions), move(self.segments), move(self.cu_seqlens), self.max_seqlen)

    def block_causal_mask(self) -> torch.Tensor:
        """[b, 1, s, s] bool, True where query i may attend key j (SDPA's
        ``attn_mask``); built once per microbatch and shared by its layers."""
        if self._mask is None:
            seq = self.segments.shape[1]
            causal = torch.ones(seq, seq, dtype=torch.bool, device=self.segments.device).tril()
            same = self.segments[:, :, None] == self.segments[:, None, :]
            self._mask = (same & causal).unsqueeze(1)
        return self._mask


def _starts(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] bool: the token opens a document (first of its row, or after an eod)."""
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eod
    return starts


def _positions(starts: torch.Tensor) -> torch.Tensor:
    index = torch.arange(starts.shape[1]).expand_as(starts)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def find_documents(tokens: torch.Tensor, rule: DocumentRule) -> Documents:
    """The documents of ``tokens`` [b, s] under ``rule`` (read on the host)."""
    tokens = tokens.cpu()
    starts = _starts(tokens, rule.eod)
    positions = _positions(starts) if rule.reset_position_ids else None
    if not rule.reset_attention_mask:
        return Documents(positions, None, None, tokens.shape[1])
    flat = starts.flatten().nonzero().flatten()
    bounds = torch.cat((flat, torch.tensor([tokens.numel()])))
    max_seqlen = int((bounds[1:] - bounds[:-1]).max())
    segments = starts.long().cumsum(dim=1) - 1
    return Documents(positions, segments, bounds.to(torch.int32), max_seqlen)
