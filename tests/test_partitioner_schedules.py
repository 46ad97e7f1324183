"""The planner's schedule model: its bubbles and memory agree with the simulator,
zero bubble predicts a step shorter by the modelled bubble, and auto picks the
fastest schedule that fits memory."""
from __future__ import annotations

import numpy as np
import pytest

from hetpipe.cluster import ClusterConfig, GroupConfig
from hetpipe.errors import ConfigError
from hetpipe.models import model_preset
from hetpipe.partitioner import schedule_model
from hetpipe.partitioner.cost_context import CostContext
from hetpipe.partitioner.planner_config import PlannerConfig
from hetpipe.partitioner.solver import solve
from hetpipe.partitioner.split import step_time_s
from hetpipe.pretrain_config import TrainConfig
from hetpipe.placement import Placement
from hetpipe.schedule_check import simulate
from hetpipe.schedules import build_schedule


@pytest.mark.parametrize("P", range(1, 7))
@pytest.mark.parametrize("M", (1, 2, 3, 4, 5, 8, 13))
def test_unit_cost_steps_and_memory_equal_the_simulator(P, M):
    """F = B = W = 1: a stage costs t = 3 per microbatch, of which w = 1 is W."""
    for schedule in schedule_model.PLANNED_SCHEDULES:
        run = simulate(build_schedule(schedule, P, M))
        credit = 2 * schedule_model.weight_credit(schedule, P, M)
        path = [3.0] + [3.0 - credit] * (P - 1)
        assert step_time_s(M, [3.0] * P, [], [0.0], path) == pytest.approx(run.makespan)
        held = run.max_in_flight if schedule == "zb_h1" else run.max_live_activations
        assert list(schedule_model.in_flight(schedule, P, M)) == held
    if M >= P:  # Qi et al.: bubble (P-1)(F+B-W) = P-1 against 1F1B's 3(P-1)
        assert simulate(build_schedule("zb_h1", P, M)).makespan == 3 * M + P - 1


def _homogeneous() -> ClusterConfig:
    return ClusterConfig(name="h200", groups=[
        GroupConfig(name="nvidia", vendor="nvidia", device_type="H200", nodes=1, ranks_per_node=8)])


def _paper() -> ClusterConfig:
    return ClusterConfig(name="h200_mi325x", groups=[
        GroupConfig(name="nvidia", vendor="nvidia", device_type="H200", nodes=1, ranks_per_node=8),
        GroupConfig(name="amd", vendor="amd", device_type="MI325X", nodes=1, ranks_per_node=8)])


MODEL = model_preset("llama8b")
TRAIN = TrainConfig(micro_batch_size=1, global_batch_size=16, seq_length=4096)


@pytest.mark.parametrize("P", (2, 4))
def test_zero_bubble_step_is_shorter_by_the_modelled_bubble(P):
    fixed = dict(tp=1, dp=8 // P, stages=[P], recompute="none")
    layers = [32 // P] * P
    one_f = solve(MODEL, _homogeneous(), TRAIN, PlannerConfig(schedule="1f1b", **fixed), layers)
    zero = solve(MODEL, _homogeneous(), TRAIN, PlannerConfig(schedule="zb_h1", **fixed), layers)
    assert (one_f.schedule, zero.schedule) == ("1f1b", "zb_h1")
    M = one_f.candidate.num_microbatches
    assert M >= P  # so weight_credit is 1
    uc = CostContext(MODEL, _homogeneous(), TRAIN, PlannerConfig(**fixed)).unit_costs(0, 1, 1, "none", False)
    w = schedule_model.weight_backward_s(MODEL, 1, TRAIN.seq_length, uc.forward_s, uc.backward_s)
    # W is about half a decoder layer's backward: its GEMMs' share of the forward.
    assert 0.4 < w[1] / uc.backward_s[1] <= 0.5
    # The bubble shrinks by 2 W of every stage after the first, as (P-1)(F+B+W)
    # -> (P-1)(F+B-W) for Qi et al.'s equal stages.
    saved = 2 * sum(float(w[a:b].sum()) for a, b in (st.units for st in one_f.stages[1:]))
    assert one_f.step_s - zero.step_s == pytest.approx(saved, rel=1e-9)
    # The same ratio as the simulator's unit makespans, with W's share of a
    # middle stage's work in place of 1/3: saving / bubble = 2 (P-1) / 3 (P-1).
    middle = one_f.stages[1]
    t = (middle.compute_s + middle.comm_s - float(one_f.split.max_sync_s)) / M
    share = float(w[middle.units[0]:middle.units[1]].sum()) / t
    unit_1f1b = simulate(build_schedule("1f1b", P, M)).makespan
    unit_zb = simulate(build_schedule("zb_h1", P, M)).makespan
    assert (unit_1f1b - unit_zb) / 3 == 2 * (P - 1) / 3
    assert saved / (P - 1) == pytest.approx(2 * share * t, rel=0.15)


def test_auto_picks_zero_bubble_where_it_fits_and_1f1b_where_memory_forbids_it():
    fixed = dict(tp=1, dp=8, stages=[1, 1], group_order=["nvidia", "amd"], recompute="none")
    roomy = solve(MODEL, _paper(), TRAIN, PlannerConfig(schedule="auto", **fixed), [16, 16])
    assert roomy.schedule == "zb_h1"
    options = {o.schedule: o for o in roomy.schedule_options}
    assert list(options) == ["1f1b", "zb_h1", "gpipe", "zb_v"]  # zb_v estimated, listed last
    assert options["zb_h1"].step_s < options["1f1b"].step_s <= options["gpipe"].step_s
    plan = roomy.to_plan()
    assert plan.schedule == "zb_h1" and plan.notes["predicted_step_s_by_schedule"]["1f1b"] > roomy.step_s
    # 1F1B keeps one microbatch on the last stage, zb_h1 two (held until W):
    # an MI325X between the two leaves only 1F1B.
    one_f = solve(MODEL, _paper(), TRAIN, PlannerConfig(schedule="1f1b", **fixed), [16, 16])
    last_1f1b, last_zb = one_f.stages[1].memory_gib, roomy.stages[1].memory_gib
    assert last_zb > last_1f1b
    cap = (last_1f1b + last_zb) / 2 / 0.9
    tight = solve(MODEL, _paper(), TRAIN, PlannerConfig(schedule="auto", **fixed, memory_gib={"amd": cap}), [16, 16])
    assert tight.schedule == "1f1b" and tight.step_s == pytest.approx(one_f.step_s)
    assert {o.schedule: o.step_s for o in tight.schedule_options}["zb_h1"] is None


def test_schedule_choices_are_checked():
    assert schedule_model.schedules_for("auto", "full") == ("1f1b", "gpipe")
    with pytest.raises(ConfigError, match="zb_h1 cannot run planner.recompute=full"):
        PlannerConfig(schedule="zb_h1", recompute="full")
    with pytest.raises(ConfigError, match="does not model interleaved_1f1b"):
        PlannerConfig(schedule="interleaved_1f1b")
    # Under zb_h1 the planner never recomputes in full, so Plan accepts what it writes.
    assert schedule_model.recompute_modes("zb_h1", ("none", "selective", "full")) == ("none", "selective")
    assert np.all(schedule_model.in_flight("zb_h1", 4, 8) == 4)


@pytest.mark.parametrize("P", range(1, 7))
@pytest.mark.parametrize("M", (1, 2, 3, 4, 5, 8, 13))
def test_zb_v_estimate_uses_the_simulators_counts(P, M):
    """A rank's two chunks, each F = B = W = 1: t = 6 per microbatch, of which w = 2 is W."""
    run = simulate(build_schedule("zb_v", P, M, 2), num_chunks=2, placement=Placement("zb_v", P, 2))
    credit = 2 * schedule_model.weight_credit("zb_v", P, M)
    path = [6.0] + [6.0 - 2 * credit] * (P - 1)
    assert step_time_s(M, [6.0] * P, [], [0.0], path) == pytest.approx(run.makespan)
    # Chunks in flight, as whole ranks' activations (rounded up): P on every rank once the V is full.
    assert list(schedule_model.in_flight("zb_v", P, M)) == [-(-n // 2) for n in run.max_in_flight]
    if M >= 2 * P - 1:
        assert schedule_model.weight_credit("zb_v", P, M) == (1.25 if P > 1 else 0.0)
        assert list(schedule_model.in_flight("zb_v", P, M)) == [P] * P
    assert schedule_model.weight_credit("zb_v", P, M) <= schedule_model.MAX_WEIGHT_CREDIT["zb_v"]


def test_zb_v_is_estimated_beside_the_planned_schedules_never_chosen():
    fixed = dict(tp=1, dp=2, stages=[4], recompute="none")
    auto = solve(MODEL, _homogeneous(), TRAIN, PlannerConfig(schedule="auto", **fixed), [8] * 4)
    options = {o.schedule: o for o in auto.schedule_options}
    assert list(options) == ["1f1b", "zb_h1", "gpipe", "zb_v"]
    assert auto.candidate.num_microbatches == 8  # >= 2P - 1: a full V
    # A full V's fill is one chunk forward per later rank, less than ZB-H1's
    # F + B - W (its doubled boundary messages, under the compute on NVLink, add to the fill only);
    # every rank keeps P = 4 microbatches' activations, ZB-H1's min(P, M) too.
    assert options["zb_v"].step_s < options["zb_h1"].step_s < options["1f1b"].step_s
    assert options["zb_v"].bubble_s < options["zb_h1"].bubble_s
    assert options["zb_v"].memory_gib == pytest.approx(options["zb_h1"].memory_gib)
    # The fastest, yet only listed: the plan runs the fastest planned schedule.
    assert auto.schedule == "zb_h1"
    plan = auto.to_plan()
    assert "zb_v" not in plan.notes["predicted_step_s_by_schedule"]
    assert plan.notes["estimated_step_s_by_schedule"]["zb_v"] == pytest.approx(options["zb_v"].step_s, rel=1e-3)
    with pytest.raises(ConfigError, match="estimates zb_v's step beside the others .* partition.num_chunks=2"):
        PlannerConfig(schedule="zb_v")
    assert schedule_model.estimated_for("auto", "full") == () and schedule_model.estimated_for("1f1b", "auto") == ()
    assert schedule_model.recompute_modes("zb_v", ("none", "selective", "full")) == ("none", "selective")
