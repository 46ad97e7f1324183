"""Vendor- and plan-neutral checkpoints.

Tensors are saved on CPU in safetensors, keyed by model unit
(``layers.17.mlp.down.weight``), never by rank or stage: each rank writes the
pieces it holds (its TP slices, its ZeRO-1 ranges) and the manifest says
where each piece sits in the whole tensor, with sha256 checksums; so a
checkpoint written by any plan (any split, any mix of AMD and NVIDIA ranks,
any TP and DP degree) loads into any other, and exports to a Hugging Face
directory without processes. Trainer state is JSON; RNG states are integer
tensors. Nothing is pickled. The directory layout is described in
:mod:`hetpipe.checkpoint.layout`, the whole design in docs/checkpoints.md.

The trainer uses :func:`restore` before its step loop and a
:class:`CheckpointSaver` (asynchronous saves) when :func:`should_save` says
so; :func:`save_checkpoint` is the synchronous path for scripts and tests.
"""
from hetpipe.checkpoint.settings import CheckpointConfig, resolve_save_dir, should_save
from hetpipe.checkpoint.hf_import import load_hf_weights
from hetpipe.checkpoint.layout import latest_checkpoint, resolve_checkpoint
from hetpipe.checkpoint.load import LoadedCheckpoint, load_checkpoint
from hetpipe.checkpoint.resume import restore
from hetpipe.checkpoint.manifest import Checkpoint, CheckpointError
from hetpipe.checkpoint.sync_save import save_checkpoint
from hetpipe.checkpoint.saver import CheckpointSaver

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointSaver",
    "LoadedCheckpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "load_hf_weights",
    "resolve_checkpoint",
    "resolve_save_dir",
    "restore",
    "save_checkpoint",
    "should_save",
]
