"""Measured per-unit costs: ``python -m hetpipe.plan profile`` and the files it writes.

Analytic costs rest on an assumed efficiency; a profile replaces them with what
the local device does. For the configured model shapes, microbatch size and
sequence length it runs the embedding, one decoder layer and the head - the
very modules ``pretrain`` builds, at TP 1, in the trainer's precision - and
records per unit the forward and backward time (mean over microbatches run
back to back after warm-up ones, as a step runs them), the bytes autograd keeps between forward and backward (counted
through saved-tensor hooks, so it works on CPUs too) and, on GPUs, the peak
memory above the memory held before the forward (weights and gradient
buffers). The JSON file is keyed by device type, so one file can
collect a profile per node type (run the command once on each). The layer
is measured once more per activation-recomputation mode (``recompute``: the
same four figures with the layer recomputing selectively or fully):

    {"format": "hetpipe-profile/1",
     "devices": {"H200": [{"shape": {...}, "micro_batch_size": 1, "units": {
         "embedding": {"forward_s": ..., "backward_s": ..., "activation_bytes": ...,
                       "peak_bytes": ...}, "layer": {...}, "head": {...}},
         "recompute": {"selective": {...}, "full": {...}}}]}}

The planner uses an entry whose ``shape`` (model dimensions, sequence length,
precision) matches the plan's; times and bytes scale with the microbatch size.
Entries without ``recompute`` (profiles made before it was measured) get the
recomputation modes' differences from the analytic model.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Optional

import torch

from hetpipe.devices.catalog import device_spec
from hetpipe.devices.facts import local_device_type
from hetpipe.devices.vendor import accelerator_name
from hetpipe.errors import ConfigError
from hetpipe.models import build_model
from hetpipe.models.layers import fuse_elementwise as fuse_module, fuses_elementwise
from hetpipe.models.model_config import ModelConfig
from hetpipe.models.recompute import RECOMPUTE_MODES, set_recompute
from hetpipe.models.fp8 import convert_to_fp8
from hetpipe.partitioner.profile_files import PROFILE_FORMAT, profile_shape, save_entry  # noqa: F401 - re-exported
from hetpipe.models.precision import (WORKING_COPY_MODES, Bf16Weights, activation_dtype, cast_parameters,
                                      compute_context, fuse_linear_grads, resolve_precision)

def measure_units(model: ModelConfig, seq_length: int, micro_batch_size: int, precision: str = "auto",
                  repeats: int = 40, warmup: int = 3, seed: int = 1234,
                  fuse_elementwise: Optional[bool] = None, warmup_s: float = 0.0,
                  fp8_recipe: str = "tensorwise") -> tuple[str, dict]:
    """Profile embedding, one decoder layer (once per recomputation mode) and
    the head on the local device, with the trainer's precision and elementwise
    fusion (``train.fuse_elementwise``). fp8 converts and compiles the layer as the
    trainer does (models/fp8.py), in the local device's FP8 format, and measures it
    without recomputation only (the trainer does not recompute compiled layers).

    Returns (device name as the runtime reports it, profile entry).
    """
    if repeats < 1 or warmup < 1:
        # Timed microbatches follow warmup ones, so the GPU runs at its sustained clocks.
        raise ConfigError("profiling needs repeats >= 1 and warmup >= 1")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    mode = resolve_precision(precision, device.type)
    fused = fuses_elementwise(fuse_elementwise, device.type, compiled=mode == "fp8")
    if mode != "fp32" and device.type == "cpu":
        raise ConfigError(f"{mode} profiles need a GPU (the trainer runs CPUs in fp32)")
    b, s, h, L = micro_batch_size, seq_length, model.hidden_size, model.num_layers
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def tokens() -> torch.Tensor:
        return torch.randint(0, model.vocab_size, (b, s), generator=gen).to(device)

    def hidden() -> torch.Tensor:
        return torch.randn(b, s, h, generator=gen).to(device, activation_dtype(mode)).requires_grad_(True)

    # (unit kind, recomputation of its layers): the layer once per mode.
    cases = {
        ("embedding", "none"): ((0, 1), lambda: (tokens(),)),
        **{("layer", rc): ((1, 2), lambda: (hidden(),)) for rc in RECOMPUTE_MODES
           if rc == "none" or mode != "fp8"},
        ("head", "none"): ((L + 1, L + 2), lambda: (hidden(), tokens())),
    }
    units, recompute = {}, {}
    for (kind, rc), (span, make_inputs) in cases.items():
        module = build_model(model, seed=seed, units=span, device=device)
        if mode == "bf16-pure":
            cast_parameters([module], torch.bfloat16)
            fuse_linear_grads([module])  # as the trainer runs it (train.grad_accumulation_fusion)
        if fused:
            fuse_module(module)
        if mode == "fp8" and kind == "layer":
            convert_to_fp8([module], fp8_recipe, _local_fp8_format())
            for layer in module.layers.values():
                layer.compile()
        set_recompute(module, rc)
        measured = _measure(module, make_inputs, device, mode, repeats, warmup, warmup_s)
        if rc == "none":
            units[kind] = measured
        else:
            recompute[rc] = measured
        del module
    entry = {"shape": profile_shape(model, seq_length, mode, fused),
             "micro_batch_size": micro_batch_size, "device_name": accelerator_name(),
             "torch": torch.__version__, "repeats": repeats, "warmup_s": warmup_s if device.type == "cuda" else 0.0,
             "units": units, "recompute": recompute, **({"fp8_recipe": fp8_recipe} if mode == "fp8" else {})}
    return accelerator_name(), entry


def _local_fp8_format() -> str:
    """The FP8 format of this machine's GPU in the catalog; its profile is refused without one."""
    kind, name = local_device_type()
    spec = device_spec(kind) if kind else None
    if spec is None or spec.fp8_format is None:
        raise ConfigError(f"an fp8 profile needs a GPU with FP8 in the device catalog; this machine's "
                          f"{name!r} ({kind or 'not in the catalog'}) has none")
    return spec.fp8_format


def weight_storages(module: torch.nn.Module, weights: Optional[Bf16Weights] = None) -> set[int]:
    """The storages of ``module``'s parameters and of their bf16 working copies."""
    storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    if weights is not None:  # the working copies are weights too, not activations
        storages |= {w.untyped_storage().data_ptr() for w in weights.copies()}
    return storages


@contextlib.contextmanager
def saved_tensor_bytes(weights: set[int]) -> Iterator[dict[int, int]]:
    """Bytes autograd keeps for the backward from the block, by storage: each
    storage once, the ``weights`` storages not at all (autocast's bf16 copies
    of weights are counted: they live until the backward). Tensors saved
    inside a checkpointed region are not seen; the region's inputs are."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def _measure(module, make_inputs, device, mode: str, repeats: int, warmup: int, warmup_s: float) -> dict:
    """Forward and backward times of ``module``, run the way a step runs it.

    The microbatches run back to back, with no host synchronisation between
    them: GPU times come from CUDA events recorded around each forward and
    backward and are read once at the end; inputs are made beforehand (a
    pageable host-to-device copy in the loop would stall the host). Timing
    each unit between ``synchronize()`` calls, as this did before, let the GPU
    idle and reclock between short bursts: on 2xH200 the planner's steps came
    out 6-9 % shorter than measured (docs/benchmarks.md). Two untimed
    microbatches come first: one allocates the gradient buffers, the other
    counts what autograd keeps and the peak memory above them.
    """
    cuda = device.type == "cuda"
    weights = Bf16Weights([module], fuse_linear_grads=True) if mode in WORKING_COPY_MODES else None
    params = weight_storages(module, weights)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def mark() -> Any:
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if cuda else b - a

    gen = torch.Generator(device=device).manual_seed(0)

    def microbatch(inputs: tuple) -> tuple[Any, Any, Any]:
        start = mark()
        with compute_context(mode, device.type, weights, 0):
            out = module(*inputs)
        middle = mark()
        if out.dim() == 0:
            out.backward()
        else:
            # A random output gradient, like a received one: a constant one
            # makes GEMMs draw less power and run faster than in training.
            out.backward(torch.randn(out.shape, generator=gen, device=device, dtype=out.dtype))
        return start, middle, mark()

    # One microbatch allocates the gradient buffers (and compiles); the next,
    # also untimed, gives the memory figures above weights and gradients.
    microbatch(make_inputs())
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with saved_tensor_bytes(params) as saved:
        microbatch(make_inputs())
    sync()
    kept = sum(saved.values())
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    # Warm up back to back for at least warmup_s: a GPU under sustained load
    # settles at lower clocks than a short burst sees (its power limit).
    # Gradients accumulate over the microbatches, as in a step.
    warm = [make_inputs() for _ in range(warmup)]
    started = time.perf_counter()
    while True:
        for x in warm:
            microbatch(x)
        sync()
        if not cuda or time.perf_counter() - started >= warmup_s:
            break
    del warm
    inputs = [make_inputs() for _ in range(repeats)]
    sync()
    timed = [microbatch(x) for x in inputs]
    sync()
    # Means over the span, which the phases partition: a backward lasts until
    # the next forward starts, so the host's time between microbatches (where
    # the GPU may idle) is counted as a step counts it. Medians of the phases
    # alone left it out: 19.1 ms against bench_layer's 20.8 ms per layer.
    starts = [a for a, _, _ in timed] + [timed[-1][2]]
    return {"forward_s": sum(seconds(a, b) for a, b, _ in timed) / repeats,
            "backward_s": sum(seconds(b, starts[i + 1]) for i, (_, b, _) in enumerate(timed)) / repeats,
            "activation_bytes": kept, "peak_bytes": peak}
