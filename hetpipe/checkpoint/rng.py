"""A rank's random-number-generator states as safetensors tensors plus JSON metadata.

Python's ``random``, NumPy's legacy global generator, torch's CPU generator
and the generator of the rank's accelerator are all saved, so a resumed run
draws the same numbers an uninterrupted one would (dropout, sampling noise).
The states are stored as integer tensors and the few scalars as JSON strings
in the file's metadata: no pickle, even for Python's own state tuple.
"""
from __future__ import annotations

import json
import random

import numpy as np
import torch


def capture_rng(device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This process's RNG states as (tensors, string metadata) for one safetensors file."""
    version, mt_state, gauss_next = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    tensors = {
        "python": torch.tensor(mt_state, dtype=torch.int64),
        "numpy": torch.from_numpy(np_keys.astype(np.int64)),
        "torch_cpu": torch.get_rng_state(),
    }
    if device.type == "cuda":  # CUDA and ROCm builds alike
        tensors["torch_accelerator"] = torch.cuda.get_rng_state(device)
    metadata = {
        "python": json.dumps({"version": version, "gauss_next": gauss_next}),
        "numpy": json.dumps({"name": np_name, "pos": int(np_pos), "has_gauss": int(np_has_gauss),
                             "cached_gaussian": float(np_cached)}),
    }
    return tensors, metadata


def restore_rng(tensors: dict[str, torch.Tensor], metadata: dict[str, str], device: torch.device) -> None:
    """Set this process's generators to a state from :func:`capture_rng`."""
    py = json.loads(metadata["python"])
    random.setstate((py["version"], tuple(int(x) for x in tensors["python"].tolist()), py["gauss_next"]))
    npm = json.loads(metadata["numpy"])
    np.random.set_state((npm["name"], tensors["numpy"].numpy().astype(np.uint32), npm["pos"],
                         npm["has_gauss"], npm["cached_gaussian"]))
    torch.set_rng_state(tensors["torch_cpu"])
    if device.type == "cuda" and "torch_accelerator" in tensors:
        torch.cuda.set_rng_state(tensors["torch_accelerator"], device)
