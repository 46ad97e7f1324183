"""What the trainer asks for each step: this rank's (tokens, labels) micro-batches.

It ties the pieces together (indexed data → packed samples → global order)
and owns the checks that catch a wrong data/tokenizer/model pairing before it
becomes a silent out-of-bounds embedding lookup on a GPU. It deliberately
knows nothing about models: the trainer passes in the model's vocab size.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hetpipe.data.demo import demo_corpus
from hetpipe.data.indexed import IndexedDataset
from hetpipe.data.packed import PackedSequenceDataset
from hetpipe.data.sampler import GlobalBatchSampler
from hetpipe.data.tokenizer import load_tokenizer
from hetpipe.errors import DataError


class MicrobatchLoader:
    """Serves int64 ``[micro_batch_size, seq_length]`` (tokens, labels) pairs for one DP rank.

    ``prefix_or_demo`` is a Megatron data prefix, or ``"demo"`` for the
    standard-library corpus built with ``tokenizer_spec``.
    """

    def __init__(
        self,
        prefix_or_demo: str,
        tokenizer_spec: str,
        seq_length: int,
        global_batch_size: int,
        micro_batch_size: int,
        vocab_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 1234,
    ) -> None:
        tokenizer = load_tokenizer(tokenizer_spec)
        if tokenizer.vocab_size > vocab_size:
            raise DataError(
                f"tokenizer {tokenizer_spec} has {tokenizer.vocab_size} tokens but the "
                f"model's vocab_size is {vocab_size}"
            )
        self.data_path = demo_corpus(tokenizer_spec) if prefix_or_demo == "demo" else prefix_or_demo
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.samples = PackedSequenceDataset(IndexedDataset(self.data_path), seq_length)
        self.sampler = GlobalBatchSampler(
            self.samples.num_samples,
            global_batch_size,
            micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
        )

    @property
    def num_microbatches(self) -> int:
        """Micro-batches this rank runs per step."""
        return self.sampler.num_microbatches

    @property
    def tokens_per_step(self) -> int:
        """Tokens trained per optimizer step across all DP ranks."""
        return self.sampler.global_batch_size * self.seq_length

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (tokens, labels) micro-batches for the next step."""
        batches = []
        for indices in self.sampler.next_step():
            samples = np.stack([self.samples[int(i)] for i in indices])
            self._check_ids(samples, indices)
            batch = torch.from_numpy(samples)
            # Inputs and labels are the same window shifted by one token.
            batches.append((batch[:, :-1].contiguous(), batch[:, 1:].contiguous()))
        return batches

    def _check_ids(self, samples: np.ndarray, indices: np.ndarray) -> None:
        # An id outside the embedding table is an illegal memory access on a
        # GPU (or a cryptic device assert), so name the culprit here instead.
        bad_rows = np.flatnonzero(
            (samples.max(axis=1) >= self.vocab_size) | (samples.min(axis=1) < 0)
        )
        if bad_rows.size:
            row = samples[bad_rows[0]]
            bad = int(row.max()) if row.max() >= self.vocab_size else int(row.min())
            raise DataError(
                f"data {self.data_path} sample {int(indices[bad_rows[0]])} holds token id {bad}, "
                f"outside the model's vocab_size {self.vocab_size} "
                "(tokenized with a different tokenizer?)"
            )

    def state_dict(self) -> dict[str, int]:
        """JSON-able loader state (the sampler's)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the exact sample order from :meth:`state_dict`."""
        self.sampler.load_state_dict(state)
