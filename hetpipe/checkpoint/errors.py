"""The one error type of checkpoints (re-exported by :mod:`hetpipe.checkpoint.manifest`)."""
from hetpipe.errors import HetpipeError


class CheckpointError(HetpipeError):
    """A checkpoint (or HF model directory) is missing, incomplete, corrupted or does not fit."""
