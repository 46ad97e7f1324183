"""Float8 linears for ``train.precision=fp8``, through torchao (``pip install 'hetpipe[fp8]'``).

The decoder layers' projections (q/k/v, attention output, SwiGLU's gate/up
and down) become torchao ``Float8Linear`` modules; the embedding and the head
do not (torchtitan's default: the head's GEMM decides the logits' precision
and the embedding is a lookup). A ``Float8Linear`` is an ``nn.Linear`` with
the same ``weight``/``bias`` parameters, so state dicts, checkpoints and the
optimizer see the model unchanged: checkpoints stay precision-neutral.

Its forward reads ``self.weight``, which inside :class:`Bf16Weights.swap` is
the bf16 working copy of the fp32 main weight, and casts that copy and its
bf16 input to FP8 with dynamic scales (``tensorwise``: one scale per tensor;
``rowwise``: one per row, power-of-two scales). Its backward returns a bf16
weight gradient, which flows back through the working copy's cast into the
fp32 ``.grad`` as every non-fused parameter's does; so these linears never
take the gradient-accumulation fusion path (``_LinearMainGrad``), which would
bypass the FP8 GEMMs.

torchao picks its FP8 dtypes from the process it runs in; hetpipe picks them
from the device catalog instead (``DeviceSpec.fp8_format``), so each vendor
group computes in its own pair: OCP e4m3fn/e5m2 (forward e4m3, gradients e5m2
under ``tensorwise``) or e4m3fnuz/e5m2fnuz on MI300X/MI325X.

torchao's filter: both dimensions of a converted weight must be multiples
of 16 (the FP8 GEMM's alignment); other linears stay bf16 and the trainer
says which. Under TP the shards are converted (each rank scales its own
shard; the TP collectives sit outside the linears, models/tp_modules.py).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import torch
from torch import nn

from hetpipe.errors import ConfigError
from hetpipe.models.train_modes import FP8_RECIPES, compiles_layers  # noqa: F401 - re-exported

# FP8 pair per catalog format (hetpipe.devices.catalog.FP8_FORMATS): (e4m3, e5m2).
_DTYPES = {"e4m3fn": (torch.float8_e4m3fn, torch.float8_e5m2),
           "e4m3fnuz": (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)}
_ALIGNMENT = 16


# Loggers whose import-time warnings say nothing to a float8 training user: torchao's
# "Failed to load ..._C_mxfp8/_C_cutlass_90a" (optional MX and CUTLASS kernels
# for other recipes, absent from CPU and some GPU builds; Float8Linear's GEMM is
# torch._scaled_mm) and torch's deprecation of register_constant on Enums,
# which torchao 0.18 still calls.
_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


def _torchao_float8():
    """torchao.float8, imported only when fp8 is chosen."""
    loggers = [logging.getLogger(name) for name in _IMPORT_LOGGERS]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError:
        raise ConfigError("train.precision=fp8 needs torchao: pip install 'hetpipe[fp8]'") from None
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
    return float8


def is_float8(module: nn.Module) -> bool:
    """Whether ``module`` is a torchao float8 linear (without importing torchao)."""
    return type(module).__name__ == "Float8Linear" and type(module).__module__.startswith("torchao.")


def float8_config(recipe: str, fp8_format: str):
    """torchao's config for ``recipe``, its FP8 dtypes set to ``fp8_format``'s pair."""
    if recipe not in FP8_RECIPES:
        raise ConfigError(f"train.fp8_recipe={recipe!r} must be one of {', '.join(FP8_RECIPES)}")
    config = _torchao_float8().Float8LinearConfig.from_recipe_name(recipe)
    e4m3, e5m2 = _DTYPES[fp8_format]
    casts = {}
    for field in dataclasses.fields(config):
        cast = getattr(config, field.name)
        if field.name.startswith("cast_config") and cast is not None and cast.target_dtype is not None:
            wide = cast.target_dtype in (torch.float8_e5m2, torch.float8_e5m2fnuz)
            casts[field.name] = dataclasses.replace(cast, target_dtype=e5m2 if wide else e4m3)
    return dataclasses.replace(config, **casts)


def aligned(linear: nn.Linear) -> bool:
    """Both weight dimensions are multiples of 16 (torchao's FP8 GEMM alignment)."""
    return linear.in_features % _ALIGNMENT == 0 and linear.out_features % _ALIGNMENT == 0


def _decoder_linear_names(chunk: nn.Module) -> list[str]:
    """Qualified names of the linears inside ``chunk``'s decoder layers."""
    if not hasattr(chunk, "layers"):
        return []
    return [f"layers.{key}.{name}" for key, layer in chunk.layers.items()
            for name, m in layer.named_modules() if isinstance(m, nn.Linear)]


def convert_to_fp8(chunks: Sequence[nn.Module], recipe: str, fp8_format: str) -> list[str]:
    """Turn the decoder layers' aligned linears of ``chunks`` into float8 linears in
    place; returns the qualified names of the decoder linears left bf16 (unaligned)."""
    convert = _torchao_float8().convert_to_float8_training
    config = float8_config(recipe, fp8_format)
    skipped = []
    for chunk in chunks:
        names = set(_decoder_linear_names(chunk))
        skipped += [n for n in sorted(names) if not aligned(chunk.get_submodule(n))]
        convert(chunk, config=config,
                module_filter_fn=lambda m, fqn, names=names: fqn in names and aligned(m))
    return skipped


def torchao_fp8_format() -> str:
    """The FP8 format torchao itself picks for this process (fnuz on MI300-class GPUs),
    for callers that run torchao's own way (the benchmarks' pipelining peer)."""
    _torchao_float8()
    from torchao.float8.config import e4m3_dtype
    return "e4m3fnuz" if e4m3_dtype == torch.float8_e4m3fnuz else "e4m3fn"
