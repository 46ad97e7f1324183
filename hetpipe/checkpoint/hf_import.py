"""Seeding a run's weights from a Hugging Face model directory (continued pretraining).

The directory's ``config.json`` must describe this run's model (checked field
by field before any tensor is read), and its weights must be safetensors —
one ``model.safetensors`` or shards named by ``model.safetensors.index.json``;
``pytorch_model.bin`` is refused because loading it means unpickling.

Each rank reads only the tensors of the units it holds: the rest are handed
to the converter as shape-only meta tensors, so an 8B model is not read (and
up-cast) in full by every pipeline rank.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch
from safetensors import SafetensorError, safe_open

from hetpipe.checkpoint.compat import check_model_fits, config_differences
from hetpipe.checkpoint.manifest import CheckpointError
from hetpipe.checkpoint.names import load_targets, whole_model_shapes
from hetpipe.models import CausalLM, ModelConfig
from hetpipe.models.hf import from_hf_config, from_hf_state_dict, hf_key_units

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _weight_files(hf_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    index = hf_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index ({exc})") from None
        files = {key: hf_dir / name for key, name in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise CheckpointError(f"{index} names {path.name}, which is missing from {hf_dir}")
        return files
    single = hf_dir / SINGLE_FILE
    if single.is_file():
        with _open(single) as f:
            return {key: single for key in f.keys()}
    if any(hf_dir.glob("*.bin")) or any(hf_dir.glob("*.pt")):
        raise CheckpointError(f"{hf_dir} holds pickled PyTorch weights only; hetpipe never unpickles: "
                              "convert them to safetensors (save_pretrained(..., safe_serialization=True))")
    raise CheckpointError(f"{hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None


class _LazyHFState(Mapping[str, torch.Tensor]):
    """HF tensors read on access; those this rank does not need come back as meta tensors."""

    def __init__(self, files: dict[str, Path], needed: Callable[[str], bool]) -> None:
        self.files = files
        self.needed = needed

    def __contains__(self, key: object) -> bool:
        return key in self.files

    def __getitem__(self, key: str) -> torch.Tensor:
        with _open(self.files[key]) as f:
            if key not in f.keys():
                raise CheckpointError(f"{self.files[key]} lacks tensor {key}, which its index promises")
            if self.needed(key):
                return f.get_tensor(key)
            return torch.empty(f.get_slice(key).get_shape(), device="meta")

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def read_hf_config(hf_dir: Path) -> ModelConfig:
    """The ModelConfig that an HF directory's config.json describes."""
    from transformers import AutoConfig

    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"{hf_dir} is not a Hugging Face model directory: it has no config.json")
    try:
        hf_config = AutoConfig.from_pretrained(str(hf_dir))
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{hf_dir / 'config.json'} is not a readable model config: {exc}") from None
    return from_hf_config(hf_config, name=hf_dir.name)


def load_hf_weights(hf_dir: str | Path, chunks: Sequence[CausalLM], model_cfg: ModelConfig,
                    shard=None) -> None:
    """Copy the weights of the units ``chunks`` hold from an HF directory."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"Hugging Face model directory {hf_dir} does not exist")
    differences = config_differences(read_hf_config(hf_dir).to_dict(), model_cfg)
    if differences:
        raise CheckpointError(f"Hugging Face model {hf_dir} does not match this run's model: "
                              f"{'; '.join(differences)}")
    held = {u for chunk in chunks for u in range(*chunk.unit_range)}
    lazy = _LazyHFState(_weight_files(hf_dir), lambda key: bool(hf_key_units(model_cfg, key) & held))
    state = from_hf_state_dict(model_cfg, lazy)
    check_model_fits(f"Hugging Face model {hf_dir}", {}, {k: tuple(v.shape) for k, v in state.items()},
                     whole_model_shapes(model_cfg), model_cfg)
    with torch.no_grad():
        for name, target in load_targets(chunks):
            # ``shard`` cuts this rank's tensor-parallel slice (None: whole tensors).
            target.copy_(shard(name, state[name]) if shard is not None else state[name])
