"""Training data: Megatron indexed datasets, tokenizers, packing and sampling.

The flow is ``scripts/preprocess_data.py`` (text → ``.bin``/``.idx``) →
:class:`IndexedDataset` (memory-mapped reader) → :class:`PackedSequenceDataset`
(fixed-length windows of the document stream) → :class:`GlobalBatchSampler`
(reproducible, resumable order split over DP ranks) → :class:`MicrobatchLoader`
(the per-step (tokens, labels) tensors the trainer consumes).
"""

from hetpipe.data.demo import demo_corpus
from hetpipe.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from hetpipe.data.loader import MicrobatchLoader
from hetpipe.data.packed import PackedSequenceDataset
from hetpipe.data.sampler import GlobalBatchSampler
from hetpipe.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "GlobalBatchSampler",
    "HFTokenizer",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "MicrobatchLoader",
    "PackedSequenceDataset",
    "demo_corpus",
    "load_tokenizer",
    "optimal_dtype",
]
