"""``python -m hetpipe.export CKPT OUT_DIR``: a checkpoint as a Hugging Face model directory.

Gathers the unit-keyed weights from every shard of a checkpoint (on CPU, no
processes, whatever plan wrote it), converts them with ``hetpipe.models.hf``
and writes ``config.json`` + ``model.safetensors`` that
``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads. CKPT is
an ``iter_NNNNNNN`` directory or a save directory (its latest checkpoint).
Optimizer and trainer state are not exported.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors.torch import save_file

from hetpipe.checkpoint.compat import check_model_fits
from hetpipe.checkpoint.layout import resolve_checkpoint
from hetpipe.checkpoint.manifest import Checkpoint, CheckpointError
from hetpipe.checkpoint.names import whole_model_shapes
from hetpipe.errors import run_cli
from hetpipe.models import ModelConfig
from hetpipe.models.hf import to_hf_config, to_hf_state_dict
from hetpipe.torch_compat import require_supported_torch

EXPORTED_FILES = ("config.json", "model.safetensors")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"export directory {out} is a file")
    # Other weight files beside ours would leave transformers a choice of
    # which to load; a previous export of ours is simply replaced.
    foreign = sorted(p.name for p in out.iterdir() if p.name not in EXPORTED_FILES) if out.is_dir() else []
    if foreign:
        raise CheckpointError(f"export directory {out} already holds {', '.join(foreign[:3])}; "
                              "choose a new or empty directory")


def export_hf(checkpoint: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write the checkpoint's model as a transformers directory; returns ``out_dir``."""
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
    hf_config = to_hf_config(cfg)
    hf_config.dtype = dtype
    out.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(out))
    # "format": "pt" tells transformers how the tensors are laid out.
    save_file(hf_state, str(out / EXPORTED_FILES[1]), metadata={"format": "pt"})
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hetpipe.export", description="Write a hetpipe checkpoint as a Hugging Face model directory.")
    parser.add_argument("checkpoint", help="an iter_NNNNNNN checkpoint directory, or a save directory")
    parser.add_argument("out_dir", help="the Hugging Face model directory to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="precision of the exported weights (checkpoints hold float32 masters, bf16 under "
                             "train.precision=bf16-pure)")
    args = parser.parse_args(argv)

    def _run() -> None:
        require_supported_torch()
        source = resolve_checkpoint(args.checkpoint)
        out = export_hf(source, args.out_dir, args.dtype)
        print(f"hetpipe: exported {source} to {out} ({args.dtype})")

    run_cli(_run)


if __name__ == "__main__":
    main()
