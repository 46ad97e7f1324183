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

import importlib

# name -> the submodule defining it, imported when the name is first used: the config
# schema reads only sources and split, and planning imports no torch (the loader's).
_SUBMODULE = {
    "BlendSchedule": "blend",
    "demo_corpus": "demo",
    "EpochOrder": "epochs",
    "IndexedDataset": "indexed",
    "IndexedDatasetWriter": "indexed",
    "optimal_dtype": "indexed",
    "MicrobatchLoader": "loader",
    "PackedSequenceDataset": "packed",
    "GlobalBatchSampler": "sampler",
    "DataSource": "sources",
    "parse_data_path": "sources",
    "parse_split": "split",
    "split_documents": "split",
    "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
}

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


def __getattr__(name: str):
    """``hetpipe.data.NAME``: NAME from its submodule, imported on first use."""
    if name in _SUBMODULE:
        return getattr(importlib.import_module(f"{__name__}.{_SUBMODULE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
