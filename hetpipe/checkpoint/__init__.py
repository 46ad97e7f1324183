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

Where things live, along the two paths a checkpoint takes:

* its format: ``layout`` (where checkpoints live, how one becomes visible),
  ``manifest`` (what a checkpoint claims; :class:`Checkpoint` opens one) with
  ``consistency`` (every claim checked) and ``digest`` (the checksums),
  ``names`` (plan-neutral tensor names), ``regions`` (a tensor's pieces and
  which part of the whole each is), ``st_io`` (safetensors), ``rng``, ``errors``;
* saving, in order: ``saver`` (the trainer's object) -> ``snapshot`` (the
  host copy, in the step) -> ``writes`` (who writes which piece) -> ``board``
  (ranks meet in the store) -> ``commit`` (one manifest, checked, into
  place); ``sync_save`` runs the same in one call;
* loading, in order: ``resume`` (checkpoint, HF weights or fresh) -> ``load``
  (this rank's regions under any plan) -> ``manifest.Checkpoint.plan/read``
  -> ``assemble`` (a region from the pieces that cover it); ``tp_slices``
  (a TP rank's slice of a whole tensor), ``compat`` (do the weights fit this
  model), ``hf_import`` (seeding from a Hugging Face directory);
* ``settings``: the ``checkpoint`` config group.
"""
import importlib

# name -> the submodule defining it, imported when the name is first used: the config
# schema reads only settings, and planning imports no torch (saving and loading do).
_SUBMODULE = {
    "CheckpointConfig": "settings",
    "resolve_save_dir": "settings",
    "should_save": "settings",
    "load_hf_weights": "hf_import",
    "latest_checkpoint": "layout",
    "resolve_checkpoint": "layout",
    "LoadedCheckpoint": "load",
    "load_checkpoint": "load",
    "restore": "resume",
    "Checkpoint": "manifest",
    "CheckpointError": "manifest",
    "save_checkpoint": "sync_save",
    "CheckpointSaver": "saver",
}

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


def __getattr__(name: str):
    """``hetpipe.checkpoint.NAME``: NAME from its submodule, imported on first use."""
    if name in _SUBMODULE:
        return getattr(importlib.import_module(f"{__name__}.{_SUBMODULE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
