"""The planner's price of context parallelism (partitioner/context_cost.py)."""
import pytest

from hetpipe.devices.catalog import device_spec
from hetpipe.models import model_preset
from hetpipe.partitioner import cost
from hetpipe.partitioner.context_cost import (attention_share, cp_degrees, cp_layer_cost, kv_bytes,
                                              smallest_fitting_cp)

LLAMA8B = model_preset("llama8b", max_position_embeddings=131072)
GIB = 2**30


def _act(s: int) -> float:
    prec = cost.Precision.for_device(device_spec("H200"), "bf16")
    return cost.layer_activation_bytes(LLAMA8B, 1, s, 1, prec)


def test_attention_grows_to_most_of_a_layer_at_long_sequences():
    # 4s·ad against 4(had + hgd + 1.5hf) per token: 0.235 at 8K, 0.83 at 128K.
    assert attention_share(LLAMA8B, 8192) == pytest.approx(0.235, abs=0.001)
    assert attention_share(LLAMA8B, 131072) == pytest.approx(0.831, abs=0.001)


def test_a_cp_rank_computes_and_keeps_its_share_and_pays_for_the_keys():
    whole = cp_layer_cost(LLAMA8B, 1, 32768, 1, "allgather", _act(32768), 2, 450.0, 10.0)
    four = cp_layer_cost(LLAMA8B, 1, 32768, 4, "allgather", _act(32768), 2, 450.0, 10.0)
    ring = cp_layer_cost(LLAMA8B, 1, 32768, 4, "ring", _act(32768), 2, 450.0, 10.0)
    assert four.forward_flops == pytest.approx(whole.forward_flops / 4)
    assert whole.comm_s == 0.0 and whole.traffic_bytes == 0.0
    others = kv_bytes(LLAMA8B, 1, 32768, 2) * 3 / 4
    assert four.traffic_bytes == pytest.approx(2 * others)
    assert ring.traffic_bytes == pytest.approx(3 * others)
    # All-gather keeps the gathered K/V for its backward: more than a quarter, less than all.
    assert whole.activation_bytes / 4 < four.activation_bytes < whole.activation_bytes
    assert ring.activation_bytes == pytest.approx(whole.activation_bytes / 4)


def test_cp_degrees_divide_the_group_and_split_the_sequence_in_two_chunks_each():
    assert cp_degrees(4, 32768) == [1, 2, 4]
    assert cp_degrees(4, 6) == [1]


def test_the_smallest_cp_that_fits_long_sequences_on_h200s():
    """LLaMA-3-8B's 32 layers on one stage of four H200s, AdamW sharded over
    the four replicas (DP x CP): seq 32768 needs CP4 (CP2 keeps 70 GiB of
    activations beside 75 GiB of state); 131072 fits with no CP degree
    without recomputation."""
    static = cost.static_bytes_per_param(4, True) * LLAMA8B.num_parameters()
    assert smallest_fitting_cp(LLAMA8B, 1, 32768, 4, 32, _act(32768), static, 139 * GIB, 2) == 4
    assert smallest_fitting_cp(LLAMA8B, 1, 131072, 4, 32, _act(131072), static, 139 * GIB, 2) == 0
