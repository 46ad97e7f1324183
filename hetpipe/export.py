"""``python -m hetpipe.export CKPT OUT_DIR``: a checkpoint as a Hugging Face model directory.

Gathers the unit-keyed weights from every shard of a checkpoint (on CPU, no
processes, whatever plan wrote it), converts them with ``hetpipe.models.hf``
and writes ``config.json``, ``generation_config.json`` and ``model.safetensors``
that ``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads, with
the run's tokenizer beside them (or a note where it was the byte tokenizer:
hetpipe.checkpoint.export_tokenizer) and its bos/eos/pad ids in both configs. Every file
is mode 0644: an export is meant to be shared. CKPT is an ``iter_NNNNNNN``
directory or a save directory (its latest checkpoint). Optimizer and trainer
state are not exported.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors.torch import save_file

from hetpipe.checkpoint.compat import check_model_fits
from hetpipe.checkpoint.layout import TRAINER_STATE, resolve_checkpoint
from hetpipe.checkpoint.manifest import Checkpoint, CheckpointError
from hetpipe.checkpoint.names import whole_model_shapes
from hetpipe.errors import run_cli
from hetpipe.checkpoint.export_tokenizer import TOKENIZER_FILES, recorded_tokenizer, write_tokenizer
from hetpipe.models import ModelConfig
from hetpipe.models.hf import to_hf_config, to_hf_state_dict
from hetpipe.process.torch_compat import require_supported_torch

EXPORTED_FILES = ("config.json", "generation_config.json", "model.safetensors")
# Readable by everyone, writable by the owner (safetensors writes its file 0600).
FILE_MODE = 0o644
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"export directory {out} is a file")
    # Other weight files beside ours would leave transformers a choice of
    # which to load; a previous export of ours is simply replaced.
    ours = (*EXPORTED_FILES, *TOKENIZER_FILES)
    foreign = sorted(p.name for p in out.iterdir() if p.name not in ours) if out.is_dir() else []
    if foreign:
        raise CheckpointError(f"export directory {out} already holds {', '.join(foreign[:3])}; "
                              "choose a new or empty directory")
    for name in TOKENIZER_FILES:  # a previous export's tokenizer must not outlive it
        (out / name).unlink(missing_ok=True)


def _hf_configs(cfg: ModelConfig, dtype: str, token_ids: dict[str, Optional[int]]):
    """The model's HF config and its generation config, both naming the tokenizer's ids."""
    from transformers import GenerationConfig

    hf_config = to_hf_config(cfg)
    hf_config.dtype = dtype
    for key, value in token_ids.items():  # transformers' defaults (eos 2) are not our tokenizer's
        setattr(hf_config, key, value)
    return hf_config, GenerationConfig(**{k: v for k, v in token_ids.items() if v is not None})


def export_hf(checkpoint: str | Path, out_dir: str | Path, dtype: str = "float32",
              tokenizer: Optional[str] = None) -> tuple[Path, str]:
    """Write the checkpoint's model as a transformers directory with its tokenizer
    (``tokenizer``, else the one the checkpoint records); returns ``out_dir`` and
    a line saying what became of the tokenizer."""
    out = Path(out_dir)
    _check_out_dir(out)
    ckpt = Checkpoint(resolve_checkpoint(checkpoint))
    try:
        cfg = ModelConfig(**ckpt.model)
    except TypeError as exc:
        raise CheckpointError(f"checkpoint {ckpt.path} has a model config this hetpipe cannot read: {exc}") from None
    shapes = whole_model_shapes(cfg)
    saved = {name: tuple(e["shape"]) for name, e in ckpt.tensors.items() if "/" not in name}
    check_model_fits(f"checkpoint {ckpt.path}", ckpt.model, saved, shapes, cfg)
    state = dict(ckpt.iter_tensors(shapes))
    hf_state = {k: v.to(DTYPES[dtype]).contiguous() for k, v in to_hf_state_dict(cfg, state).items()}
    spec = tokenizer or recorded_tokenizer(ckpt.read_json(TRAINER_STATE))
    out.mkdir(parents=True, exist_ok=True)
    token_ids, tokenizer_line = write_tokenizer(spec, out)
    _write_model(out, hf_state, *_hf_configs(cfg, dtype, token_ids))
    return out, tokenizer_line


def _write_model(out: Path, hf_state: dict[str, torch.Tensor], hf_config, generation_config) -> None:
    """The configs and weights into ``out``; then every file there readable by all."""
    hf_config.save_pretrained(str(out))
    generation_config.save_pretrained(str(out))
    # "format": "pt" tells transformers how the tensors are laid out.
    save_file(hf_state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for path in out.iterdir():
        path.chmod(FILE_MODE)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hetpipe.export", description="Write a hetpipe checkpoint as a Hugging Face model directory.")
    parser.add_argument("checkpoint", help="an iter_NNNNNNN checkpoint directory, or a save directory")
    parser.add_argument("out_dir", help="the Hugging Face model directory to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="precision of the exported weights (checkpoints hold float32 masters, bf16 under "
                             "train.precision=bf16-pure)")
    parser.add_argument("--tokenizer", default=None,
                        help="the run's tokenizer (byte or a local HF tokenizer directory) where the "
                             "checkpoint records none or its directory moved")
    args = parser.parse_args(argv)

    def _run() -> None:
        require_supported_torch()
        source = resolve_checkpoint(args.checkpoint)
        out, tokenizer_line = export_hf(source, args.out_dir, args.dtype, args.tokenizer)
        print(f"hetpipe: exported {source} to {out} ({args.dtype}); {tokenizer_line}")

    run_cli(_run)


if __name__ == "__main__":
    main()
