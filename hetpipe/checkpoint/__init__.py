"""Vendor- and plan-neutral checkpoints.

Tensors are saved on CPU in safetensors, keyed by model unit
(``layers.17.mlp.down.weight``), never by rank or stage, with a manifest of
sha256 checksums; so a checkpoint written by any plan (any split, any mix of
AMD and NVIDIA ranks) loads into any other, and exports to a Hugging Face
directory without processes. Trainer state is JSON; RNG states are integer
tensors. Nothing is pickled. The directory layout is described in
:mod:`hetpipe.checkpoint.layout`.

The trainer uses :func:`restore` before its step loop and
:func:`save_checkpoint` when :func:`should_save` says so.
"""
from hetpipe.checkpoint.settings import CheckpointConfig, resolve_save_dir, should_save
from hetpipe.checkpoint.hf_import import load_hf_weights
from hetpipe.checkpoint.layout import latest_checkpoint, resolve_checkpoint
from hetpipe.checkpoint.load import LoadedCheckpoint, load_checkpoint, restore
from hetpipe.checkpoint.manifest import Checkpoint, CheckpointError
from hetpipe.checkpoint.save import save_checkpoint

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointError",
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
