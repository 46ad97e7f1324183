"""The planner's price of context parallelism (partitioner/context_cost.py)."""
import pytest

from hetpipe.devices.cluster import ClusterConfig, GroupConfig
from hetpipe.devices.catalog import device_spec
from hetpipe.errors import ConfigError
from hetpipe.training.memory_fit import Capacity, check_stage, with_prediction
from hetpipe.models import model_preset
from hetpipe.partitioner import cost
from hetpipe.partitioner.context_cost import (attention_share, cp_degrees, cp_layer_cost, kv_bytes,
                                              smallest_fitting_cp)
from hetpipe.partitioner.plan_memory import predicted_memory_gib
from hetpipe.partitioner.planner_config import PlannerConfig
from hetpipe.partitioner.resolve import resolve_plan
from hetpipe.partitioner.solver import plan_for, solve
from hetpipe.schema.pretrain_config import PretrainConfig, TrainConfig

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


# -- plan=auto over CP degrees, and the memory check of a CP plan ------------------------------

FOUR_H200 = ClusterConfig(name="h200x4", groups=[GroupConfig(name="nvidia", vendor="nvidia", device_type="H200",
                                                             nodes=1, ranks_per_node=4)])
H200 = Capacity(139.8, "NVIDIA H200")


def _train(seq: int) -> TrainConfig:
    train = TrainConfig()
    train.seq_length, train.micro_batch_size, train.global_batch_size, train.precision = seq, 1, 16, "bf16"
    return train


def test_plan_auto_splits_long_sequences_and_keeps_short_ones_whole():
    """LLaMA-3-8B on four H200s: at 32K tokens the attention's quadratic share
    makes CP (no TP's unsplit share, no bubble) the fastest plan; at 4K the
    split buys nothing and CP1 stays."""
    planner = PlannerConfig(distributed_optimizer=True)
    long = plan_for(LLAMA8B, FOUR_H200, _train(32768), planner)
    short = plan_for(LLAMA8B, FOUR_H200, _train(4096), planner)
    assert long.stages[0].cp > 1 and {s.cp for s in long.stages} == {long.stages[0].cp}
    assert sorted(r for s in long.stages[:long.pipeline_size] for r in s.ranks) == [0, 1, 2, 3]
    assert {s.cp for s in short.stages} == {1}


def test_the_search_over_cp_is_the_best_of_each_degree():
    planner, train = PlannerConfig(distributed_optimizer=True), _train(32768)
    each = {c: solve(LLAMA8B, FOUR_H200, train, planner, cp=c).step_s for c in (1, 2, 4)}
    chosen = solve(LLAMA8B, FOUR_H200, train, planner)
    assert chosen.step_s == pytest.approx(min(each.values()))
    assert chosen.stages[0].cp == min(each, key=each.get)


def test_planner_cp_fixes_the_degree_and_a_bad_one_is_one_line():
    fixed = solve(LLAMA8B, FOUR_H200, _train(32768), PlannerConfig(cp=2))
    assert {s.cp for s in fixed.stages} == {2}
    with pytest.raises(ConfigError, match="planner.cp=3 must divide"):
        solve(LLAMA8B, FOUR_H200, _train(32768), PlannerConfig(cp=3))


def test_the_planners_memory_is_the_checks_memory_under_cp():
    """What plan=auto predicts for its CP plan is what the check before a run predicts."""
    train, planner = _train(32768), PlannerConfig(distributed_optimizer=True)
    solution = solve(LLAMA8B, FOUR_H200, train, planner)
    plan = solution.to_plan()
    assert predicted_memory_gib(plan, LLAMA8B, FOUR_H200, train, planner) == \
        pytest.approx([s.memory_gib for s in solution.stages])


def _cfg(cp: int, method: str = "allgather") -> PretrainConfig:
    cfg = PretrainConfig(model=LLAMA8B, cluster=FOUR_H200)
    cfg.train = _train(32768)
    cfg.train.recompute = "full"
    cfg.partition.cp, cfg.partition.dp, cfg.partition.cp_method = cp, 4 // cp, method
    cfg.planner.distributed_optimizer = True
    return cfg


def test_a_long_sequence_refused_whole_fits_split_over_cp():
    """32K tokens on one stage of four H200s, full recomputation: DP4 keeps
    each rank's whole sequence (refused), CP4 a quarter of it plus the K/V
    buffers of its method (all-gather: the whole K/V per layer; ring: fp32
    blocks), so it runs."""
    whole, split, ring = (with_prediction(resolve_plan(c), c) for c in (_cfg(1), _cfg(4), _cfg(4, "ring")))
    with pytest.raises(ConfigError, match="predicted to need"):
        check_stage(whole, _cfg(1), 0, 0, H200)
    assert check_stage(split, _cfg(4), 0, 0, H200) is None
    gib = [p.notes["predicted_memory_gib"][0] for p in (whole, split, ring)]
    assert gib[1] < gib[0] / 1.5 and gib[1] != gib[2]


def test_sequence_parallel_with_cp_is_one_line_and_plan_auto_keeps_cp1_under_it():
    from hetpipe.schema.pretrain_config import PartitionConfig
    with pytest.raises(ConfigError, match="sequence_parallel=true with partition.cp > 1"):
        PartitionConfig(cp=2, sequence_parallel=True)
    cfg = _cfg(1)
    cfg.plan, cfg.train.recompute, cfg.partition.sequence_parallel = "auto", None, True
    assert {s.cp for s in resolve_plan(cfg).stages} == {1}
