"""Training data: Megatron indexed datasets, tokenizers, packing and sampling.

The flow is ``scripts/preprocess_data.py`` (text → ``.bin``/``.idx``) →
:class:`IndexedDataset` (memory-mapped reader) → :class:`PackedSequenceDataset`
(fixed-length windows of the document stream, or of one ``data.split`` part
of it) → :class:`GlobalBatchSampler` (reproducible, resumable order split over
DP ranks; for a weighted blend of sources, Megatron's mixing rule in
:class:`BlendSchedule` over each source's :class:`EpochOrder`) →
:class:`MicrobatchLoader` (the per-step (tokens, labels) tensors the trainer
consumes).
"""

from hetpipe.data.blend import BlendSchedule
from hetpipe.data.demo import demo_corpus
from hetpipe.data.epochs import EpochOrder
from hetpipe.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from hetpipe.data.loader import MicrobatchLoader
from hetpipe.data.packed import PackedSequenceDataset
from hetpipe.data.sampler import GlobalBatchSampler
from hetpipe.data.sources import DataSource, parse_data_path
from hetpipe.data.split import parse_split, split_documents
from hetpipe.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "BlendSchedule",
    "ByteTokenizer",
    "DataSource",
    "EpochOrder",
    "GlobalBatchSampler",
    "HFTokenizer",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "MicrobatchLoader",
    "PackedSequenceDataset",
    "demo_corpus",
    "load_tokenizer",
    "optimal_dtype",
    "parse_data_path",
    "parse_split",
    "split_documents",
]
