"""The device catalog and the per-unit cost and memory model."""
import pytest

from hetpipe.errors import ConfigError
from hetpipe.models import model_preset
from hetpipe.models.flops import megatron_model_flops
from hetpipe.devices.catalog import CATALOG, catalog_with, detect_device_type, device_spec
from hetpipe.partitioner.cost import (GIB, TP_UNSPLIT_SHARE, NetworkConfig, Precision, StageShape, allreduce_s,
                                      forward_flops, message_s, static_bytes_per_param, unit_costs, unit_params)


def test_catalog_has_the_issue_devices_and_takes_overrides():
    for name in ("H100", "H200", "A100", "A100-40GB", "MI250X", "MI300X", "MI325X", "CPU"):
        spec = device_spec(name.lower())
        assert spec.peak_bf16_tflops > 0 and spec.memory_gib > 0 and spec.intra_node_link_gbs > 0
    assert device_spec("MI325X").vendor == "amd" and device_spec("H200").vendor == "nvidia"
    assert detect_device_type("AMD Instinct MI325X") == "MI325X"
    assert detect_device_type("NVIDIA H200") == "H200"
    # One torch device each: an A100's memory size, an MI250X's GCD (64 GB).
    assert detect_device_type("NVIDIA A100-SXM4-40GB") == "A100-40GB"
    assert detect_device_type("NVIDIA A100-SXM4-80GB") == "A100"
    assert detect_device_type("AMD Instinct MI250X") == "MI250X" and device_spec("MI250X").memory_gib == 64

    catalog = catalog_with({"h200": {"efficiency": 0.7},
                            "B200": {"vendor": "nvidia", "peak_bf16_tflops": 2250.0, "memory_gib": 180.0,
                                     "memory_bandwidth_tbs": 8.0, "intra_node_link_gbs": 1800.0}})
    assert catalog["H200"].efficiency == 0.7 and CATALOG["H200"].efficiency != 0.7  # a copy
    assert device_spec("b200", catalog).peak_bf16_tflops == 2250.0
    assert detect_device_type("NVIDIA B200", catalog) == "B200"
    with pytest.raises(ConfigError, match="unknown field"):
        catalog_with({"H200": {"tflops": 1.0}})
    with pytest.raises(ConfigError, match="new device and needs .*memory_gib"):
        catalog_with({"X1": {"vendor": "amd", "peak_bf16_tflops": 1.0}})
    with pytest.raises(ConfigError, match="unknown device type 'B300'"):
        device_spec("B300")


@pytest.mark.parametrize("name", ["llama8b", "qwen2_7b", "qwen3_8b", "tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_unit_flops_and_params_add_up_to_the_model(name):
    model = model_preset(name)
    assert 3 * forward_flops(model, 2, 512).sum() == pytest.approx(megatron_model_flops(model, 2, 512), rel=1e-12)
    alone = model.share_embeddings_and_output_weights
    assert unit_params(model, 1, head_shares_embedding=alone).sum() == model.num_parameters()


def test_llama8b_head_weighs_about_two_layers_and_tp_divides_work():
    model = model_preset("llama8b")
    h200 = CATALOG["H200"]
    uc = unit_costs(model, h200, StageShape(1, 1, 8192), Precision.for_device(h200), NetworkConfig())
    assert 1.5 < uc.time_s[-1] / uc.time_s[1] < 2.5
    tp4 = unit_costs(model, h200, StageShape(4, 1, 8192), Precision.for_device(h200), NetworkConfig())
    # Each rank computes its quarter of the split work and all of the unsplit share.
    assert tp4.forward_s[1] == pytest.approx(uc.forward_s[1] * ((1 - TP_UNSPLIT_SHARE) / 4 + TP_UNSPLIT_SHARE))
    assert uc.forward_s[1] / 4 < tp4.forward_s[1] < uc.forward_s[1] / 2
    assert tp4.flops[1] == pytest.approx(uc.flops[1] / 4)  # model FLOPs: what TFLOP/s counts
    assert tp4.tp_comm_s[1] > 0 and uc.tp_comm_s[1] == 0
    # The norms' tensors stay whole on every TP rank.
    assert uc.activation_bytes[1] / 4 < tp4.activation_bytes[1] < uc.activation_bytes[1] * 0.75
    # Full recomputation keeps only the layer input and pays one more forward;
    # the rebuilt activations exist while its backward runs.
    rc = unit_costs(model, h200, StageShape(1, 1, 8192, "full"), Precision.for_device(h200), NetworkConfig())
    assert rc.activation_bytes[1] == 1 * 8192 * 4096 * 2  # its bf16 input
    assert rc.backward_s[1] == pytest.approx(uc.backward_s[1] + uc.forward_s[1])
    assert rc.transient_bytes[1] == pytest.approx(uc.transient_bytes[1] + uc.activation_bytes[1])
    # Selective drops SDPA's log-sum-exp and reruns the attention core.
    sel = unit_costs(model, h200, StageShape(1, 1, 8192, "selective"), Precision.for_device(h200), NetworkConfig())
    assert sel.activation_bytes[1] == uc.activation_bytes[1] - 4 * 8192 * 32
    assert uc.backward_s[1] < sel.backward_s[1] < uc.backward_s[1] + 0.3 * uc.forward_s[1]
    assert list(sel.activation_bytes[[0, -1]]) == list(uc.activation_bytes[[0, -1]])  # layers only


def test_memory_and_link_arithmetic():
    assert static_bytes_per_param(8, False) == 16
    assert static_bytes_per_param(8, True) == 4 + 4 + 1
    # Ring all-reduce: 2 (n-1)/n of the bytes through each link.
    assert allreduce_s(1e9, 4, 100.0, 0.0) == pytest.approx(2 * 3 / 4 * 1e9 / 100e9)
    assert allreduce_s(1e9, 1, 100.0, 5.0) == 0
    net = NetworkConfig(nic_gbs=50.0, nics_per_node=8, latency_us=0.0, tcp_stream_gbs=2.0,
                        cpu_forwarding_latency_us=0.0)
    h200, mi = CATALOG["H200"], CATALOG["MI325X"]
    direct = message_s(1e9, "network", h200, mi, net, senders_per_node=8)
    assert direct == pytest.approx(1e9 / 50e9)
    # CPU-forwarding: two PCIe copies plus TCP over 4 streams.
    forwarded = message_s(1e9, "cpu_forwarding", h200, mi, net, senders_per_node=8, tcp_streams=4)
    assert forwarded == pytest.approx(1e9 / 64e9 + 1e9 / 8e9 + 1e9 / 64e9)
    assert message_s(1e9, "intra_node", h200, h200, net) < direct


def test_precision_follows_the_trainer():
    assert Precision.for_device(CATALOG["CPU"]).name == "fp32"
    assert Precision.for_device(CATALOG["H200"]).name == "bf16"
    assert Precision.for_device(CATALOG["H200"], "bf16-autocast").name == "bf16-autocast"
    assert Precision.for_device(CATALOG["H200"], "fp32").name == "fp32"
    model = model_preset("llama8b")
    h200 = CATALOG["H200"]
    shape = StageShape(1, 1, 4096)
    bf16 = unit_costs(model, h200, shape, Precision.for_device(h200), NetworkConfig())
    autocast = unit_costs(model, h200, shape, Precision.for_device(h200, "bf16-autocast"), NetworkConfig())
    fp32 = unit_costs(model, h200, shape, Precision(4), NetworkConfig())
    # Autocast keeps a bf16 copy of a layer's weights per microbatch in flight.
    assert autocast.activation_bytes[1] > 2 * autocast.params[1] > 0.4 * GIB
    assert fp32.activation_bytes[1] > autocast.activation_bytes[1] - 2 * autocast.params[1]
    # bf16 mode: no per-microbatch copies and a bf16 residual stream, so less
    # is kept per microbatch and boundary messages are half the size.
    assert bf16.activation_bytes[1] < autocast.activation_bytes[1] - 2 * autocast.params[1]
    assert bf16.boundary_bytes == autocast.boundary_bytes / 2

def test_bf16_pure_keeps_eight_bytes_per_parameter_and_plans_with_them():
    h200 = CATALOG["H200"]
    bf16, pure = Precision.for_device(h200), Precision.for_device(h200, "bf16-pure")
    assert pure.name == "bf16-pure" and pure.grad_bytes == 2
    assert bf16.static_bytes_per_param(1, False) == 4 + 4 + 8 + 2  # Megatron's bf16 mode
    assert pure.static_bytes_per_param(1, False) == 2 + 2 + 4  # the pipelining peer's bf16 weights
    # ZeRO-1 over DP4 of bf16 parameters: fp32 main shards and moments.
    assert pure.static_bytes_per_param(4, True) == 2 + 2 + 12 / 4
    # Same compute, so the same activations and boundary messages.
    shape = StageShape(1, 1, 4096)
    a = unit_costs(model_preset("llama8b"), h200, shape, bf16, NetworkConfig())
    b = unit_costs(model_preset("llama8b"), h200, shape, pure, NetworkConfig())
    assert list(a.activation_bytes) == list(b.activation_bytes) and a.boundary_bytes == b.boundary_bytes


def test_a_profile_prices_each_recompute_mode_it_measured():
    model, cpu = model_preset("tiny_llama"), CATALOG["CPU"]

    def unit(forward_s, backward_s, kept):
        return {"forward_s": forward_s, "backward_s": backward_s, "activation_bytes": kept, "peak_bytes": None}
    entry = {"micro_batch_size": 1, "units": {"embedding": unit(0.001, 0.002, 10), "layer": unit(0.01, 0.02, 1000),
                                               "head": unit(0.005, 0.01, 500)},
             "recompute": {"full": unit(0.01, 0.031, 100)}}

    def costs(mode):
        return unit_costs(model, cpu, StageShape(1, 2, 64, mode), Precision(4), NetworkConfig(), profile=entry)
    none, full, selective = costs("none"), costs("full"), costs("selective")
    # Measured (at microbatch 1, scaled to 2): the layer's own figures in that mode.
    assert full.backward_s[1] == pytest.approx(0.062) and full.activation_bytes[1] == pytest.approx(200)
    assert full.backward_s[-1] == none.backward_s[-1]  # the head does not recompute
    # Not measured: the measured layer plus the analytic difference.
    assert selective.activation_bytes[1] == none.activation_bytes[1] - 4 * 2 * 64 * model.num_attention_heads
    assert selective.backward_s[1] > none.backward_s[1] == pytest.approx(0.04)


def test_fp8_prices_the_layers_gemms_at_the_fp8_peak_and_their_casts_as_working_memory():
    from hetpipe.partitioner.cost import fp8_cast_bytes, fp8_layer_factor

    h200, model = CATALOG["H200"], model_preset("llama8b")
    bf16, fp8 = Precision.for_device(h200, "bf16", compiled=True), Precision.for_device(h200, "fp8")
    assert fp8.name == "fp8" and fp8.working_copy_bytes == 2 and not fp8.fused_elementwise  # compiled layers
    shape = StageShape(1, 1, 8192)
    a = unit_costs(model, h200, shape, bf16, NetworkConfig())
    b = unit_costs(model, h200, shape, fp8, NetworkConfig())
    factor = fp8_layer_factor(model, 1, 8192, h200)
    assert 0.55 < factor < 0.7  # GEMMs at 2x, the attention core at 1x
    assert b.forward_s[1] == pytest.approx(a.forward_s[1] * factor)
    assert b.backward_s[1] == pytest.approx(a.backward_s[1] * factor)
    assert (b.forward_s[0], b.forward_s[-1]) == (a.forward_s[0], a.forward_s[-1])  # embedding, head: bf16
    assert b.activation_bytes[1] == a.activation_bytes[1]  # torchao saves the linears' bf16 inputs
    assert b.transient_bytes[1] - a.transient_bytes[1] == pytest.approx(
        fp8_cast_bytes(model, 1, 8192, 1, a.params[1]))
    assert fp8_layer_factor(model, 1, 8192, CATALOG["A100"]) == 1.0
