"""Which GPU vendor this process runs on, from its torch build.

A ROCm build of torch sets ``torch.version.hip`` and drives AMD GPUs through
the ``cuda`` device API; a CUDA build sets ``torch.version.cuda``. Without a
visible GPU the rank is a CPU rank (used for emulated clusters).
"""
from __future__ import annotations

# torch is imported by each function: the planner imports this module and plans without torch.


def detect_vendor() -> str:
    """'amd', 'nvidia' or 'cpu' for this process."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return "amd" if getattr(torch.version, "hip", None) else "nvidia"


def accelerator_name() -> str:
    """The current device's marketing name ('NVIDIA H200'), or 'cpu'."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(torch.cuda.current_device())
