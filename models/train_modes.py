"""The model's training settings as words, checked and resolved without torch.

``train.precision``, ``train.fp8_recipe``, ``train.recompute``,
``train.attention_backend`` and ``train.fuse_elementwise``: their values and
what a rank on a given device runs for them. The config schema and the
planner read only these, so composing a config or planning
(``python -m hetpipe.plan``) imports no torch; the modules that run the modes
(precision, fp8, recompute, attention, layers) re-export them.
"""
from __future__ import annotations

from typing import Any, Optional

from hetpipe.errors import ConfigError

FP8_RECIPES = ("tensorwise", "rowwise")
RECOMPUTE_MODES = ("none", "selective", "full")
ATTENTION_BACKENDS = ("auto", "fa4", "cudnn", "flash", "efficient", "math")


PRECISIONS = ("auto", "bf16", "fp8", "bf16-pure", "bf16-autocast", "fp32")
# The modes that run on Bf16Weights' working copies of fp32 main weights.
WORKING_COPY_MODES = ("bf16", "fp8")


def resolve_precision(precision: str, device_type: str) -> str:
    """The mode a rank on ``device_type`` runs for ``train.precision``."""
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision={precision!r} must be one of {', '.join(PRECISIONS)}")
    if precision == "auto":
        return "fp32" if device_type == "cpu" else "bf16"
    return precision


def compiles_layers(compile_setting: bool, fp8: bool, device_type: str) -> bool:
    """Whether the decoder layers run compiled: ``train.compile``, or fp8 on a GPU
    (torchao's scaling and casts are separate slow kernels unless compiled; CPU
    ranks emulating FP8 run them eager)."""
    return compile_setting or (fp8 and device_type != "cpu")


def check_attention_backend(backend: str) -> None:
    if backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"train.attention_backend={backend!r} must be one of {', '.join(ATTENTION_BACKENDS)}")


def check_recompute(recompute: Any, num_layers: Any) -> None:
    """Raise ConfigError unless ``train.recompute`` / ``train.recompute_num_layers``
    are a mode or per-stage list of modes / a count or per-stage list of counts."""
    modes = list(recompute) if isinstance(recompute, (list, tuple)) else [] if recompute is None else [recompute]
    for mode in modes:
        if mode not in RECOMPUTE_MODES:
            raise ConfigError(f"train.recompute={recompute!r}: {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    counts = num_layers if isinstance(num_layers, (list, tuple)) else [num_layers]
    for n in counts:
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ConfigError(f"train.recompute_num_layers={num_layers!r}: {n!r} is not a layer count (0 or more)")
    if isinstance(recompute, (list, tuple)) and isinstance(num_layers, (list, tuple)) \
            and len(recompute) != len(num_layers):
        raise ConfigError(f"train.recompute={list(recompute)} and train.recompute_num_layers={list(num_layers)} "
                          "list different numbers of stages")


ELEMENTWISE_KERNELS = ("auto", "compile", "liger", "none")
# GPU kinds (hetpipe.devices.catalog's names) whose ``auto`` takes liger's
# kernels instead of torch.compile's: those where docs/benchmarks.md (the
# eighteenth session's layer table, scripts/bench_attention.py) measures liger
# faster for RMSNorm, SwiGLU and the cross-entropy together. None so far: on
# the H200 liger was slower for all three, and the other GPUs are unmeasured.
LIGER_AUTO_DEVICES: frozenset[str] = frozenset()


def elementwise_mode(setting: Any) -> str:
    """``train.fuse_elementwise`` as one of ELEMENTWISE_KERNELS: null is auto,
    true compile, false none (its values before liger); ConfigError otherwise."""
    if setting is None or isinstance(setting, bool):
        return {None: "auto", True: "compile", False: "none"}[setting]
    if setting not in ELEMENTWISE_KERNELS:
        raise ConfigError(f"train.fuse_elementwise={setting!r} must be one of {', '.join(ELEMENTWISE_KERNELS)} "
                          "(or null, true, false: auto, compile, none)")
    return setting


def elementwise_kernels(setting: Any, device_type: str, compiled: bool, local: bool = True,
                        device_kind: Optional[str] = None) -> str:
    """The kernels ranks on ``device_type`` (catalog kind ``device_kind``) run for
    ``train.fuse_elementwise=setting`` and ``train.compile=compiled``: compile,
    liger or none.

    Automatic: none on CPUs (the CPU backend compiles C++, slow to build for
    the speed it brings) and under ``train.compile`` (whole layers are
    compiled anyway); on GPUs liger where LIGER_AUTO_DEVICES lists the kind
    and liger is installed, else compile. ``local``: the GPU is this
    process's, so Triton's or liger's absence turns the automatic choice off
    and an explicit one into an error; the planner, reasoning about a
    cluster's devices, passes False and assumes them.
    """
    mode = elementwise_mode(setting)
    if mode == "auto":
        if device_type == "cpu" or compiled:
            return "none"
        if device_kind in LIGER_AUTO_DEVICES and (not local or _liger_installed()):
            return "liger"
        return "compile" if not local or _has_triton() else "none"
    if local and mode == "liger":
        _check_liger(device_type)
    if local and mode == "compile" and device_type != "cpu" and not _has_triton():
        raise ConfigError(f"train.fuse_elementwise={str(setting).lower()} compiles kernels with Triton, which "
                          "this machine's torch cannot use; set train.fuse_elementwise=false")
    return mode


def _check_liger(device_type: str) -> None:
    if device_type == "cpu":
        raise ConfigError("train.fuse_elementwise=liger: liger-kernel's Triton kernels run on CUDA and ROCm "
                          "GPUs, not on this rank's CPU; use compile or none")
    if not _liger_installed():
        from hetpipe.models.liger import LIGER_INSTALL

        raise ConfigError(f"train.fuse_elementwise=liger: liger-kernel is not installed on this rank's "
                          f"machine: {LIGER_INSTALL}")


def fuses_elementwise(setting: Any, device_type: str, compiled: bool, local: bool = True) -> bool:
    """Whether ranks on ``device_type`` run fused elementwise kernels of either
    kind (:func:`elementwise_kernels`) for ``train.fuse_elementwise=setting``."""
    return elementwise_kernels(setting, device_type, compiled, local) != "none"


def _liger_installed() -> bool:
    from hetpipe.models.liger import liger_installed

    return liger_installed()


def _has_triton() -> bool:
    from hetpipe.process.torch_compat import triton_available

    return triton_available()
