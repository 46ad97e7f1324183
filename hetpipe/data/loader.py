"""What the trainer asks for each step: this rank's (tokens, labels) micro-batches.

It ties the pieces together (``data.path``'s sources → their train, valid
or test documents → packed samples → global order) and owns the checks that
catch a wrong data/tokenizer/model pairing before it becomes a silent
out-of-bounds embedding lookup on a GPU. It deliberately knows nothing about
models: the trainer passes in the model's vocab size.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hetpipe.data.demo import demo_corpus
from hetpipe.data.indexed import IndexedDataset
from hetpipe.data.packed import PackedSequenceDataset
from hetpipe.data.sampler import GlobalBatchSampler
from hetpipe.data.sources import BlendedSamples, parse_data_path
from hetpipe.data.split import parse_split, split_documents
from hetpipe.data.tokenizer import load_tokenizer
from hetpipe.errors import DataError

# The loss's ignore_index (hetpipe.models.loss.IGNORE_INDEX, F.cross_entropy's
# default): a label equal to it adds nothing to the loss nor to the count of
# tokens the loss is averaged over.
IGNORE_INDEX = -100


class MicrobatchLoader:
    """Serves int64 ``[micro_batch_size, seq_length]`` (tokens, labels) pairs for one DP rank.

    ``data_path`` is a Megatron data prefix, ``"demo"`` for the
    standard-library corpus built with ``tokenizer_spec``, or a weighted blend
    ``"w1 prefix1 w2 prefix2 ..."`` (see :mod:`hetpipe.data.sources`).
    ``split`` (``"969,30,1"``) restricts every source to the documents of
    ``part``; None reads all of them. ``eod_mask_loss`` (Megatron's
    ``--eod-mask-loss``) sets the label of every position whose input token is
    the tokenizer's end of document to :data:`IGNORE_INDEX`: the loss does not
    ask the model to guess the next document's first token from the one before.
    """

    def __init__(
        self,
        data_path: str,
        tokenizer_spec: str,
        seq_length: int,
        global_batch_size: int,
        micro_batch_size: int,
        vocab_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 1234,
        split: str | None = None,
        part: str = "train",
        eod_mask_loss: bool = False,
    ) -> None:
        tokenizer = load_tokenizer(tokenizer_spec)
        self.eod_mask_loss = eod_mask_loss
        self.eod = tokenizer.eod
        if tokenizer.vocab_size > vocab_size:
            raise DataError(
                f"tokenizer {tokenizer_spec} has {tokenizer.vocab_size} tokens but the "
                f"model's vocab_size is {vocab_size}"
            )
        sources = parse_data_path(data_path)
        fractions = parse_split(split) if split is not None else None
        packed = []
        for source in sources:
            data = IndexedDataset(demo_corpus(tokenizer_spec) if source.prefix == "demo" else source.prefix)
            documents = None
            if fractions is not None:
                documents = split_documents(data.num_documents, fractions, part)
                if documents[0] == documents[1]:
                    raise DataError(f"data.split={split!r} leaves the {part} part of {data.prefix} no documents "
                                    f"(it has {data.num_documents})")
            packed.append(PackedSequenceDataset(data, seq_length, documents))
        self.data_path = packed[0].dataset.prefix if len(packed) == 1 else data_path
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.samples = BlendedSamples(packed)
        blended = len(packed) > 1
        self.sampler = GlobalBatchSampler(
            self.samples.sizes if blended else self.samples.num_samples,
            global_batch_size,
            micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
            weights=[s.weight for s in sources] if blended else None,
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
            tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
            if self.eod_mask_loss:  # a new tensor: with one sample per microbatch the two are views of batch
                labels = torch.where(tokens == self.eod, IGNORE_INDEX, labels)
            batches.append((tokens, labels))
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
                f"data {self.samples.describe(int(indices[bad_rows[0]]))} holds token id {bad}, "
                f"outside the model's vocab_size {self.vocab_size} "
                "(tokenized with a different tokenizer?)"
            )

    def restart(self) -> None:
        """Serve the first batches again (each validation run reads the same ones)."""
        self.sampler.restart()

    def state_dict(self) -> dict[str, Any]:
        """JSON-able loader state (the sampler's)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the exact sample order from :meth:`state_dict`."""
        self.sampler.load_state_dict(state)
