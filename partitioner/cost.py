"""Cost and memory model of one model unit on one device type.

The partitioner never runs the model: it needs, for each model unit (unit 0 the
embedding, units 1..L the decoder layers, unit L+1 the final norm + head +
loss), how long its forward and backward take on a device, how many bytes it
pins there, and how long messages and collectives take on the links between
devices. This module answers those questions, from a measured profile
(``python -m hetpipe.plan profile``) where one exists and from the device
catalog otherwise:

* compute time = Megatron model FLOPs / (dense peak x efficiency); the
  backward is twice the forward; recomputation adds a layer's forward (full)
  or its attention core's (selective) to the backward and keeps less (see
  :func:`unit_costs`);
* memory follows what hetpipe's trainer keeps: fp32 main weights (4
  bytes/param), fp32 gradients (4), Adam m and v (8; divided by DP with a
  distributed optimizer), in bf16 mode a bf16 working copy of the weights (2),
  plus per in-flight microbatch the saved activations and, under bf16
  autocast, the bf16 copies of the weights autocast made for that microbatch
  (autograd keeps them for the backward); under the zero-bubble schedules
  what B keeps for W and what W holds (:func:`weight_pass_bytes`); how many
  of each a rank holds at once is the schedule's
  (:func:`hetpipe.partitioner.schedule_model.memory_rows`);
* links: TP all-reduces on the intra-node fabric, stage boundaries over the
  fabric, the network (device-direct) or CPU-forwarding's two host copies plus
  TCP; DP gradient all-reduces as a ring over the slowest link of the group.

The formulas, and their assumptions, are written out in docs/partitioner.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from hetpipe.models.families import spec_of
from hetpipe.models.model_config import ModelConfig
from hetpipe.devices.catalog import DeviceSpec
from hetpipe.models.train_modes import compiles_layers, fuses_elementwise, resolve_precision

GIB = float(1 << 30)
# Bytes per parameter in hetpipe's trainer (fp32 weights, fp32 grads, AdamW m and v).
WEIGHT_BYTES = 4
GRAD_BYTES = 4
ADAM_BYTES = 8
# A fused AdamW step reads weight, grad, m, v and writes weight, m, v (fp32).
ADAM_STEP_BYTES = 28
# Receive buffers the engine keeps posted ahead, per direction.
RECV_AHEAD = 2
# Tensor parallelism: the share of the link's per-direction bandwidth its activation
# all-reduces reach, and the share of a TP1 unit's time each rank computes in full
# (norms, residual adds and the vocab-parallel loss's fp32 math are not split, and
# half-width GEMMs run slower). Both measured with LLaMA-3-8B at TP2 on two H100s:
# docs/benchmarks.md, "plan=auto's TP2 on two H100s" (2026-11-26), with its command.
TP_LINK_EFFICIENCY = 0.56
TP_UNSPLIT_SHARE = 0.117


@dataclass
class NetworkConfig:
    # One NIC's bandwidth in one direction, GB/s (400 Gb/s InfiniBand or RoCE = 50).
    nic_gbs: float = 50.0
    # NICs per node; the GPUs of a node that send at once share them.
    nics_per_node: int = 8
    # One-way latency of a message across the network, microseconds.
    latency_us: float = 10.0
    # Latency of a message or collective step over NVLink / Infinity Fabric.
    intra_node_latency_us: float = 5.0
    # What one TCP stream carries in practice, GB/s; CPU-forwarding stripes a
    # message over the cluster's transport addresses x streams_per_address.
    tcp_stream_gbs: float = 3.0
    # Software cost of one CPU-forwarded message (two copies' launches, socket
    # calls, the channel's header), microseconds.
    cpu_forwarding_latency_us: float = 100.0


@dataclass(frozen=True)
class Precision:
    """Element sizes of the trainer's precision modes (models/precision.py).

    ``bf16``: bf16 matmuls and a bf16 residual stream (stage boundaries carry
    bf16), plus a persistent bf16 working copy of every fp32 main weight.
    ``bf16-autocast``: fp32 weights and residual stream, bf16 matmul inputs
    and outputs, and autocast's bf16 weight copies per microbatch in flight.
    ``bf16-pure``: as ``bf16`` for compute, but the parameters, gradients and
    AdamW moments themselves are bf16 (no working copy, no fp32 state).
    ``fp32``: CPUs.

    ``fused_elementwise``: the layers' elementwise work runs as compiled fused
    kernels (``train.fuse_elementwise``, on by default on GPUs), which keep
    fewer activations for the backward (:func:`layer_activation_bytes`).
    """
    matmul_bytes: int
    residual_bytes: int = 4
    # Bytes per parameter of the persistent working copy (bf16 mode).
    working_copy_bytes: int = 0
    fused_elementwise: bool = False
    # bf16-pure: bf16 parameters, gradients and AdamW state.
    pure_bf16: bool = False
    # bf16 with gradient-accumulation fusion (train.grad_accumulation_fusion,
    # not under train.compile): the decoder linears' weight-gradient GEMMs
    # add straight into fp32 .grad (models/precision.py), which decides what
    # a zero-bubble W holds (weight_pass_bytes).
    fused_linear_grads: bool = False
    # fp8: as bf16, with the decoder linears' GEMMs at the device's FP8 peak
    # (fp8_gemm_speedup) and their FP8 casts of weights and inputs as working memory.
    fp8: bool = False

    @property
    def grad_bytes(self) -> int:
        return 2 if self.pure_bf16 else GRAD_BYTES

    def static_bytes_per_param(self, dp: int, distributed_optimizer: bool) -> float:
        """Weights, gradients, optimizer state and working copy per parameter.
        bf16-pure under ZeRO-1 keeps fp32 main shards and moments (12 bytes / DP)."""
        if not self.pure_bf16:
            return static_bytes_per_param(dp, distributed_optimizer) + self.working_copy_bytes
        if distributed_optimizer and dp > 1:
            return 2 + 2 + (WEIGHT_BYTES + ADAM_BYTES) / dp
        return 2 + 2 + ADAM_BYTES / 2

    @classmethod
    def for_device(cls, spec: DeviceSpec, precision: str = "auto", fuse_elementwise: Optional[bool] = None,
                   compiled: bool = False, grad_accumulation_fusion: bool = True) -> "Precision":
        """The trainer's rules: ``auto`` is bf16 on GPUs and fp32 on CPUs; fused
        elementwise kernels on GPUs unless whole layers are compiled; in bf16,
        gradient-accumulation fusion unless turned off or compiled
        (hetpipe/training/rank_setup.py)."""
        device_type = "cpu" if spec.vendor == "cpu" else "cuda"
        mode = resolve_precision(precision, device_type)
        compiled = compiles_layers(compiled, mode == "fp8", device_type)
        fused = fuses_elementwise(fuse_elementwise, device_type, compiled, local=False)
        if mode == "fp8":
            return cls(matmul_bytes=2, residual_bytes=2, working_copy_bytes=2, fused_elementwise=fused, fp8=True)
        if mode == "bf16":
            return cls(matmul_bytes=2, residual_bytes=2, working_copy_bytes=2, fused_elementwise=fused,
                       fused_linear_grads=grad_accumulation_fusion and not compiled)
        if mode == "bf16-pure":
            return cls(matmul_bytes=2, residual_bytes=2, fused_elementwise=fused, pure_bf16=True)
        return cls(matmul_bytes=2 if mode == "bf16-autocast" else 4, fused_elementwise=fused)

    @property
    def name(self) -> str:
        if self.matmul_bytes == 4:
            return "fp32"
        if self.fp8:
            return "fp8"
        if self.pure_bf16:
            return "bf16-pure"
        return "bf16" if self.residual_bytes == 2 else "bf16-autocast"

    @property
    def autocast_copies(self) -> bool:
        """Autocast keeps a bf16 copy of each fp32 weight per microbatch in flight."""
        return self.name == "bf16-autocast"


@dataclass(frozen=True)
class StageShape:
    """What a unit's costs depend on besides the model and the device."""
    tp: int
    micro_batch_size: int
    seq_length: int
    # Activation recomputation of every decoder layer: none, selective or full.
    recompute: str = "none"


@dataclass
class UnitCosts:
    """Per-unit costs on one device type at one :class:`StageShape`.

    Every array has one entry per model unit (embedding, layers, head) and is
    per device of a stage, per microbatch where that applies.
    """
    forward_s: np.ndarray
    # Includes the rerun forward (or attention core) of a recomputing layer.
    backward_s: np.ndarray
    # Blocking TP all-reduces of a microbatch (forward, backward, recompute).
    tp_comm_s: np.ndarray
    # Megatron model FLOPs of forward + backward (recomputation not counted).
    flops: np.ndarray
    params: np.ndarray
    # Kept from a unit's forward until its backward, per microbatch in flight.
    activation_bytes: np.ndarray
    # Working memory while the unit runs (freed afterwards).
    transient_bytes: np.ndarray
    # Zero-bubble schedules (weight_pass_bytes): kept from a microbatch's B
    # to its W on top of its activations, and what its W holds while it runs
    # (the weight gradients it materialises, and of them what stays until the
    # W ends once the inputs it frees are taken off).
    weight_kept_bytes: np.ndarray
    weight_grad_bytes: np.ndarray
    weight_net_bytes: np.ndarray
    # One activation (or gradient) message at a stage boundary, per device.
    boundary_bytes: float
    # "analytic" or "profile".
    source: str

    @property
    def time_s(self) -> np.ndarray:
        """Per-microbatch time a unit keeps its device busy (forward + backward)."""
        return self.forward_s + self.backward_s + self.tp_comm_s


# -- model arithmetic --------------------------------------------------------------
# The per-layer figures are the model family's (hetpipe.models.families.dense,
# through the family's spec); this section lays them out per unit and device.

def layer_params(model: ModelConfig) -> tuple[int, int]:
    """(parameters split by TP, parameters every TP rank keeps) of one decoder layer."""
    return spec_of(model).layer_params(model)


def unit_params(model: ModelConfig, tp: int = 1, head_shares_embedding: bool = False) -> np.ndarray:
    """Parameters each device of a TP group holds, per unit.

    With tied embeddings the head keeps its own copy of the embedding unless
    embedding and head sit on the same stage (``head_shares_embedding``).
    """
    h, v = model.hidden_size, model.vocab_size
    split, replicated = layer_params(model)
    head = h + (0 if head_shares_embedding else v * h / tp)
    return np.array([v * h / tp] + [split / tp + replicated] * model.num_layers + [head], dtype=float)


def forward_flops(model: ModelConfig, micro_batch_size: int, seq_length: int) -> np.ndarray:
    """Megatron model FLOPs of one microbatch's forward, per unit (whole TP group):
    the per-unit split of megatron_model_flops (the embedding lookup counts none).
    Forward + backward is 3x this."""
    spec, b, s = spec_of(model), micro_batch_size, seq_length
    layer = spec.layer_forward_flops(model, b, s)
    return np.array([0.0] + [layer] * model.num_layers + [spec.head_forward_flops(model, b, s)])


def layer_activation_bytes(model: ModelConfig, b: int, s: int, tp: int, prec: Precision) -> float:
    """Bytes one decoder layer keeps for its backward (per microbatch, per device);
    see hetpipe.models.families.dense.layer_activation_bytes."""
    return spec_of(model).layer_activation_bytes(model, b, s, tp, prec)


def head_activation_bytes(model: ModelConfig, b: int, s: int, tp: int, prec: Precision) -> tuple[float, float]:
    """(kept, transient) bytes of the head (hetpipe.models.families.dense)."""
    return spec_of(model).head_activation_bytes(model, b, s, tp, prec)


def weight_pass_bytes(model: ModelConfig, b: int, s: int, tp: int, prec: Precision
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per unit, what a zero-bubble schedule's split backward holds
    (hetpipe/models/split_backward.py): (kept from B to W, weight gradients
    W materialises, of those what stays until W ends), per microbatch and device.

    A layer's figures are its family's
    (hetpipe.models.families.dense.layer_weight_pass_bytes). On the first
    stage B also keeps the embedding output's gradient; the fused loss keeps
    its weight gradient from the forward (in the head's activations), so the
    head keeps nothing more, the eager one its norm's incoming gradient. W,
    under gradient-accumulation fusion (bf16 on GPUs), runs the queued GEMMs
    into fp32 ``.grad`` in place: nothing more.
    """
    h, r = model.hidden_size, prec.residual_bytes
    layer, layer_grad, freed = spec_of(model).layer_weight_pass_bytes(model, b, s, tp, prec)
    kept = np.full(model.num_units, layer)
    kept[0] = b * s * h * r
    kept[-1] = 0.0 if prec.fused_elementwise else b * s * h * r
    grad = np.zeros(model.num_units)
    if not prec.fused_linear_grads:
        grad[1:-1] = layer_grad
    return kept, grad, np.maximum(0.0, grad - freed)


# -- links ---------------------------------------------------------------------------

def allreduce_s(nbytes, n: int, gbs: float, latency_us: float):
    """Ring all-reduce of ``nbytes`` (a number or an array) over ``n`` ranks on
    links of ``gbs`` GB/s per direction."""
    if n <= 1:
        return 0.0 * nbytes
    return 2.0 * (n - 1) / n * nbytes / (gbs * 1e9) + 2.0 * (n - 1) * latency_us * 1e-6


def nic_share_gbs(net: NetworkConfig, senders_per_node: int) -> float:
    """Network bandwidth one device gets when ``senders_per_node`` devices of its node send at once."""
    return net.nic_gbs * net.nics_per_node / max(1, senders_per_node)


def message_s(nbytes: float, route: str, sender: DeviceSpec, receiver: DeviceSpec, net: NetworkConfig,
              senders_per_node: int = 1, tcp_streams: int = 1) -> float:
    """Time of one stage-boundary message of ``nbytes`` (per device).

    route: ``intra_node`` (NVLink / Infinity Fabric, same vendor), ``network``
    (the vendor library or the device-direct channel: GPU memory to GPU memory
    through the NICs), or ``cpu_forwarding`` (device -> pinned host, TCP
    striped over ``tcp_streams`` streams, pinned host -> device; the three
    legs of a message run one after the other).
    """
    if route == "intra_node":
        return nbytes / (min(sender.intra_node_link_gbs, receiver.intra_node_link_gbs) / 2 * 1e9) \
            + net.intra_node_latency_us * 1e-6
    share = nic_share_gbs(net, senders_per_node)
    if route == "network":
        return nbytes / (share * 1e9) + net.latency_us * 1e-6
    if route == "cpu_forwarding":
        wire = min(share, tcp_streams * net.tcp_stream_gbs)
        return (nbytes / (sender.host_link_gbs * 1e9) + nbytes / (wire * 1e9)
                + nbytes / (receiver.host_link_gbs * 1e9)
                + (net.latency_us + net.cpu_forwarding_latency_us) * 1e-6)
    raise ValueError(f"unknown route {route!r}")


def static_bytes_per_param(dp: int, distributed_optimizer: bool) -> float:
    """Weights + gradients + Adam state per parameter (Adam state sharded over DP on request)."""
    return WEIGHT_BYTES + GRAD_BYTES + ADAM_BYTES / (dp if distributed_optimizer else 1)


def grad_sync_s(params, dp: int, gbs: float, latency_us: float, spec: DeviceSpec,
                distributed_optimizer: bool, grad_bytes: int = GRAD_BYTES):
    """DP gradient all-reduce (or reduce-scatter + all-gather: the same bytes) of a
    stage's fp32 gradients, plus the AdamW step that follows it (``params`` a
    number or an array)."""
    sync = allreduce_s(params * grad_bytes, dp, gbs, latency_us)
    shard = dp if distributed_optimizer else 1
    return sync + params / shard * ADAM_STEP_BYTES / (spec.memory_bandwidth_tbs * 1e12)


# -- per-unit costs --------------------------------------------------------------------

def unit_costs(model: ModelConfig, spec: DeviceSpec, shape: StageShape, prec: Precision,
               net: NetworkConfig, efficiency: Optional[float] = None,
               profile: Optional[dict] = None, head_shares_embedding: bool = False,
               profile_is_bf16: bool = False) -> UnitCosts:
    """Costs of every unit on ``spec`` at ``shape``: measured (``profile``, one
    entry of a profile file for this device) where given, analytic otherwise.
    ``profile_is_bf16``: an fp8 run priced from a bf16 entry (fp8 not measured),
    whose layers are scaled as the analytic model scales them (fp8_gemm_speedup)."""
    tp, b, s = shape.tp, shape.micro_batch_size, shape.seq_length
    h, v, num_layers = model.hidden_size, model.vocab_size, model.num_layers
    e, r = prec.matmul_bytes, prec.residual_bytes
    layers = slice(1, num_layers + 1)
    params = unit_params(model, tp, head_shares_embedding)
    flops_fwd = forward_flops(model, b, s) / tp
    rate = spec.peak_bf16_tflops * 1e12 * (efficiency if efficiency is not None else spec.efficiency)
    bandwidth = spec.memory_bandwidth_tbs * 1e12

    # Compute. The embedding is memory-bound: gather rows, then scatter-add its
    # gradient into a dense fp32 table.
    fwd = forward_flops(model, b, s) * tp_share(tp) / rate
    bwd = 2.0 * fwd
    fwd[0] = 2.0 * b * s * h * r / bandwidth
    bwd[0] = (b * s * h * r + 2.0 * v * h / tp * GRAD_BYTES) / bandwidth

    # The attention core's forward (what selective recomputation reruns):
    # QK^T and the product with V, counted in full like Megatron's formula,
    # so the same efficiency calibrates it.
    core_s = 4.0 * b * s * s * model.num_attention_heads * model.head_dim / tp / rate

    act, transient = _analytic_memory(model, b, s, tp, prec, params)
    source, measured = "analytic", None
    if profile is not None:
        source, scale = "profile", b / profile["micro_batch_size"]
        # A layer measured in this recomputation mode stands in for the layer measured without.
        measured = profile.get("recompute", {}).get(shape.recompute)
        units = profile["units"] if measured is None else {**profile["units"], "layer": measured}
        fwd, bwd = _measured_times(units, model, scale, tp)
        # The analytic model says how TP divides a unit's saved tensors; the
        # measurement (at TP 1) says how many bytes there are.
        act_tp1 = _analytic_memory(model, b, s, 1, prec, unit_params(model, 1, head_shares_embedding))[0]
        if measured is not None:
            act, transient = _recompute_memory(act, transient, model, b, s, tp, prec, shape.recompute)
            act_tp1 = _recompute_memory(act_tp1, transient, model, b, s, 1, prec, shape.recompute)[0]
        head_act, head_transient = act[-1], transient[-1]
        act, transient = _measured_memory(units, model, scale, act / act_tp1, transient)
        if tp > 1:
            # The profile measured the fused, chunked loss; under TP the head runs the
            # vocab-parallel one, which holds its [tokens, vocab/tp] logits in fp32.
            act[-1], transient[-1] = head_act, head_transient
    if prec.fp8 and (profile is None or profile_is_bf16):
        factor = fp8_layer_factor(model, b, s, spec)
        fwd[layers], bwd[layers] = fwd[layers] * factor, bwd[layers] * factor
    if prec.fp8:
        transient[layers] += fp8_cast_bytes(model, b, s, tp, params[1])
    if measured is None:
        bwd[layers] += _recompute_s(shape.recompute, fwd[layers], core_s)
        act, transient = _recompute_memory(act, transient, model, b, s, tp, prec, shape.recompute)

    tp_comm = np.zeros(model.num_units)
    if tp > 1:
        link, lat = spec.intra_node_link_gbs / 2 * TP_LINK_EFFICIENCY, net.intra_node_latency_us

        def ar(nbytes: float) -> float:
            return allreduce_s(nbytes, tp, link, lat)
        # Megatron TP: two all-reduces per layer forward, two backward, two
        # more when the forward is recomputed; vocab-parallel embedding and
        # cross-entropy add one each way.
        per_layer = (4 + (2 if shape.recompute == "full" else 0)) * ar(b * s * h * e)
        tp_comm[layers] = per_layer
        tp_comm[0] = ar(b * s * h * r)
        tp_comm[-1] = ar(b * s * h * e) + 3 * ar(b * s * 4.0)

    kept, wgrad, wnet = weight_pass_bytes(model, b, s, tp, prec)
    return UnitCosts(forward_s=fwd, backward_s=bwd, tp_comm_s=tp_comm, flops=3.0 * flops_fwd, params=params,
                     activation_bytes=act, transient_bytes=transient, weight_kept_bytes=kept,
                     weight_grad_bytes=wgrad, weight_net_bytes=wnet,
                     boundary_bytes=float(b * s * h * r / tp), source=source)


def fp8_layer_factor(model: ModelConfig, b: int, s: int, spec: DeviceSpec) -> float:
    """A decoder layer's fp8 time over its bf16 time: its linear GEMMs' share of
    the layer's model FLOPs runs at the FP8 peak, the attention core's at BF16's
    (same efficiency for both: an assumption until fp8 is profiled). 1 on a
    device without FP8."""
    if spec.peak_fp8_tflops is None:
        return 1.0
    layer = spec_of(model).layer_forward_flops(model, b, s)
    gemm = 1.0 - 4.0 * b * s * s * model.num_attention_heads * model.head_dim / layer
    return 1.0 - gemm + gemm * spec.peak_bf16_tflops / spec.peak_fp8_tflops


def fp8_cast_bytes(model: ModelConfig, b: int, s: int, tp: int, layer_params: float) -> float:
    """Working memory of a layer's FP8 casts: its weights in FP8 and transposed
    (1 byte each per parameter) and the widest input cast (SwiGLU's down
    projection, b x s x ffn bytes). torchao keeps the bf16 inputs for the
    backward, so the saved activations are bf16's."""
    return 2.0 * layer_params + b * s * model.ffn_hidden_size / tp


def _recompute_s(mode: str, layer_forward_s: np.ndarray, core_s: float) -> np.ndarray:
    """What recomputation adds to a layer's backward: its forward (full) or its
    attention core's (selective)."""
    if mode == "full":
        return layer_forward_s
    return np.full_like(layer_forward_s, core_s if mode == "selective" else 0.0)


def _recompute_memory(act: np.ndarray, transient: np.ndarray, model: ModelConfig, b: int, s: int, tp: int,
                      prec: Precision, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(kept, transient) bytes per unit when every layer recomputes in ``mode``,
    from those without recomputation.

    Full (Korthikanti et al. 2022, section 4: a checkpointed layer stores only
    its input, sbh x 2 bytes in bf16): a layer keeps its input, and while its
    backward runs its rebuilt activations exist on top of its working memory
    (on one H100, LLaMA-3-8B at seq 8192, four layers peaked 3.0 GiB lower,
    65 instead of 1090 MiB kept per layer, bench_layer). Selective: the
    attention core's own saved tensors are SDPA's log-sum-exp (4 bytes per
    head and token); flash-style kernels keep no scores, so the 5as/h x sbh
    bytes of the paper's unfused attention are not there to drop, and q, k,
    v and the output stay (the core's input, and the output projection's).
    """
    act, transient = act.copy(), transient.copy()
    layers = slice(1, model.num_layers + 1)
    if mode == "full":
        transient[layers] += act[layers]
        act[layers] = b * s * model.hidden_size * prec.residual_bytes
    elif mode == "selective":
        act[layers] -= 4.0 * b * s * model.num_attention_heads / tp
    return act, transient


def _analytic_memory(model: ModelConfig, b: int, s: int, tp: int, prec: Precision,
                     params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(kept per microbatch in flight, transient) bytes per unit, without recomputation."""
    h, r, e = model.hidden_size, prec.residual_bytes, prec.matmul_bytes
    copies = params * e if prec.autocast_copies else np.zeros_like(params)
    copies[0] = 0.0  # the embedding lookup is not autocast
    head_kept, head_transient = head_activation_bytes(model, b, s, tp, prec)
    layer = layer_activation_bytes(model, b, s, tp, prec) + copies[1]
    act = np.array([8.0 * b * s] + [layer] * model.num_layers + [head_kept + copies[-1]])
    # A layer's backward briefly holds gradients of its widest intermediates.
    layer_transient = b * s * (2 * model.ffn_hidden_size * e / tp + 2 * h * r)
    # The embedding's backward makes a dense gradient of its table, in the
    # weight's dtype (the bf16 working copy, bf16-pure's bf16 table, else
    # fp32), which a working copy's cast turns into fp32 before it is added
    # to .grad: 3.06 GiB measured for LLaMA-3's table in bf16 on an H200
    # (0.98 + 1.96 GiB), 1.11 in bf16-pure (the built-in profiles).
    table = model.vocab_size * h / tp
    weight_bytes = prec.working_copy_bytes or (2 if prec.pure_bf16 else 4)
    embedding_transient = b * s * h * r + table * weight_bytes + (table * GRAD_BYTES if prec.working_copy_bytes else 0)
    transient = np.array([embedding_transient] + [layer_transient] * model.num_layers + [head_transient])
    return act, transient


def _profile_kinds(model: ModelConfig) -> list[str]:
    return ["embedding"] + ["layer"] * model.num_layers + ["head"]


def tp_share(tp: int) -> float:
    """The share of a TP1 unit's compute time one of ``tp`` ranks spends on it."""
    return 1.0 if tp <= 1 else (1.0 - TP_UNSPLIT_SHARE) / tp + TP_UNSPLIT_SHARE


def _measured_times(units: dict, model: ModelConfig, scale: float, tp: int) -> tuple[np.ndarray, np.ndarray]:
    """A profile's forward and backward times, scaled to the microbatch's tokens
    (exact when the profile used the training microbatch size) and split over TP."""
    kinds = _profile_kinds(model)
    fwd = np.array([units[k]["forward_s"] for k in kinds]) * scale * tp_share(tp)
    bwd = np.array([units[k]["backward_s"] for k in kinds]) * scale * tp_share(tp)
    return fwd, bwd


def _measured_memory(units: dict, model: ModelConfig, scale: float, tp_share: np.ndarray,
                     analytic_transient: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A profile's kept activation bytes and, where it measured a peak (GPUs),
    the transient bytes above them, at this shape."""
    act, transient = [], []
    for u, kind in enumerate(_profile_kinds(model)):
        m = units[kind]
        act.append(m["activation_bytes"] * scale * tp_share[u])
        peak = m.get("peak_bytes")
        if peak is None:
            transient.append(analytic_transient[u])
        else:
            transient.append(max(0.0, peak - m["activation_bytes"]) * scale * tp_share[u])
    return np.array(act), np.array(transient)
