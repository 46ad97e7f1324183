"""The plan solver: optimal over all candidates, inside every device's memory, deterministic, clear when nothing fits."""
import json

import numpy as np
import pytest

from hetpipe.devices.cluster import ClusterConfig, GroupConfig, TransportConfig
from hetpipe.schema.pretrain_config import TrainConfig
from hetpipe.errors import ConfigError
from hetpipe.models import model_preset
from hetpipe.partitioner import candidates, solver, v_search, v_split
from hetpipe.partitioner.v_bounds import VBounds
from hetpipe.devices.catalog import catalog_with, device_spec
from hetpipe.partitioner.cost import GIB, NetworkConfig, Precision, StageShape, unit_costs
from hetpipe.partitioner.context_plan import planned_cp_degrees
from hetpipe.partitioner.cost_context import CostContext
from hetpipe.partitioner.plan_data import Plan
from hetpipe.partitioner.planner_config import PlannerConfig
from hetpipe.partitioner.profile import PROFILE_FORMAT, profile_shape
from hetpipe.partitioner.schedule_model import memory_rows, schedules_for
from hetpipe.partitioner.solver import plan_for, solve
from hetpipe.partitioner.candidate_bounds import ContiguousBounds
from hetpipe.partitioner.split import _min_sum, best_split, minimax


def paper_cluster(**transport) -> ClusterConfig:
    """The seed paper's cluster: one node of 8 H200, one of 8 MI325X."""
    return ClusterConfig(name="h200_mi325x_2node", groups=[
        GroupConfig(name="nvidia", vendor="nvidia", device_type="H200", nodes=1, ranks_per_node=8),
        GroupConfig(name="amd", vendor="amd", device_type="MI325X", nodes=1, ranks_per_node=8)],
        transport=TransportConfig(**transport))


def exhaustive(model, cluster, train, planner):
    """Solve every candidate the solver enumerates under every schedule and
    context-parallel degree, without pruning; also check each bound."""
    best = None
    for cp in planned_cp_degrees(cluster, train.seq_length, planner.cp):
        found = _exhaustive_at(CostContext(model, cluster, train, planner, cp), planner)
        if found is not None:
            best = found if best is None else min(best, found)
    return best


def _exhaustive_at(ctx, planner):
    best = None
    for schedule in schedules_for(planner.schedule, planner.recompute):
        for block in candidates.enumerate_blocks(ctx, None, schedule):
            for row in range(len(block.stages)):
                cand = block.candidate(row)
                prob = ctx.problem(cand, schedule)
                split = best_split(prob.time, prob.sync, prob.feasible, cand.num_microbatches, prob.links,
                                   prob.path)
                if split is None:
                    continue
                assert block.lower_bounds[row] <= split.step_s * (1 + 1e-12)  # the bound is a bound
                best = split.step_s if best is None else min(best, split.step_s)
    return best


def test_search_equals_exhaustive_enumeration_on_random_clusters():
    rng = np.random.default_rng(5)
    devices = ["H100", "H200", "A100", "MI250X", "MI300X", "MI325X"]
    checked = 0
    for _ in range(20):
        groups = []
        for g in range(int(rng.integers(2, 4))):
            groups.append(GroupConfig(name=f"g{g}", vendor="nvidia", device_type=str(rng.choice(devices)),
                                      nodes=int(rng.integers(1, 3)), ranks_per_node=int(rng.choice([1, 2, 4]))))
        cluster = ClusterConfig(name="random", groups=groups)
        model = model_preset("llama8b", num_layers=int(rng.integers(3, 8)))
        train = TrainConfig(micro_batch_size=1, global_batch_size=int(rng.choice([4, 8, 16])),
                            seq_length=int(rng.choice([2048, 8192])))
        # Small memories make many candidates infeasible, so memory shapes the answer.
        catalog = {d: {"memory_gib": float(rng.uniform(12, 60))} for d in devices}
        # 1f1b: the exhaustive reference prices contiguous splits (zb_v's V is not one).
        planner = PlannerConfig(catalog=catalog, micro_batch_sizes=[1, 2], schedule="1f1b",
                                distributed_optimizer=bool(rng.integers(0, 2)))
        expected = exhaustive(model, cluster, train, planner)
        if expected is None:
            with pytest.raises(ConfigError, match="short by"):
                solve(model, cluster, train, planner)
            continue
        got = solve(model, cluster, train, planner)
        assert got.step_s == pytest.approx(expected, rel=1e-12)
        checked += 1
    assert checked >= 10


def _random_problem(rng, schedule: str):
    """A small random planning problem; some draws give two groups the same
    devices, so that candidates tie."""
    devices = ["H100", "H200", "MI300X", "MI325X"]
    groups = [GroupConfig(name=f"g{g}", vendor="nvidia", device_type=str(rng.choice(devices)),
                          nodes=int(rng.integers(1, 3)), ranks_per_node=int(rng.choice([1, 2, 4])))
              for g in range(int(rng.integers(1, 4)))]
    model = model_preset("llama8b", num_layers=int(rng.integers(3, 8)))
    train = TrainConfig(micro_batch_size=1, global_batch_size=int(rng.choice([4, 8, 16])),
                        seq_length=int(rng.choice([2048, 8192])))
    catalog = {d: {"memory_gib": float(rng.uniform(12, 60))} for d in devices}
    planner = PlannerConfig(catalog=catalog, micro_batch_sizes=[1, 2], schedule=schedule,
                            distributed_optimizer=bool(rng.integers(0, 2)))
    return CostContext(model, ClusterConfig(name="random", groups=groups), train, planner)


def _first_of_the_fastest(ctx, blocks, schedule):
    """Every candidate's best split, without bounds: the fastest, the first of
    equally fast ones in the balance bound's stable order."""
    lbs = np.concatenate([b.lower_bounds for b in blocks])
    starts = np.cumsum([0] + [len(b.lower_bounds) for b in blocks])
    best = None
    for pos in np.argsort(lbs, kind="stable"):
        bi = int(np.searchsorted(starts, pos, side="right")) - 1
        cand = blocks[bi].candidate(int(pos - starts[bi]))
        prob = ctx.problem(cand, schedule)
        split = best_split(prob.time, prob.sync, prob.feasible, cand.num_microbatches, prob.links, prob.path)
        if split is not None and (best is None or split.step_s < best[1].step_s):
            best = (cand, split)
    return best


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "gpipe"])
def test_search_finds_the_first_of_the_fastest_candidates_and_its_split(schedule):
    rng = np.random.default_rng({"1f1b": 11, "zb_h1": 12, "gpipe": 13}[schedule])
    for _ in range(6):
        ctx = _random_problem(rng, schedule)
        blocks = candidates.enumerate_blocks(ctx, None, schedule)
        expected = _first_of_the_fastest(ctx, blocks, schedule)
        got, _ = solver._search(ctx, blocks, None, schedule)
        assert (got is None) == (expected is None)
        if got is not None:
            assert got[0] == expected[0] and got[1] == expected[1]


def test_candidate_bounds_lie_below_each_splits_first_bound():
    """The search skips a candidate whose bound (candidate_bounds.py) reaches the
    best step: the bound must lie below best_split's own first bound."""
    rng = np.random.default_rng(21)
    checked = 0
    for schedule in ["1f1b", "zb_h1", "gpipe"] * 3:
        ctx = _random_problem(rng, schedule)
        tables = ContiguousBounds(ctx)
        for block in candidates.enumerate_blocks(ctx, None, schedule):
            bounds = tables.block(schedule, block, np.arange(len(block.stages)))
            for row, bound in enumerate(bounds):
                prob = ctx.problem(block.candidate(row), schedule)
                first = _first_bound(prob, block.num_microbatches)
                assert bound <= first + 1e-12 * abs(first) or not np.isfinite(first)
                checked += np.isfinite(first)
    assert checked > 500


def _first_bound(prob, num_microbatches):
    """split.best_split's first test: (M-1) max(min max t, c_max) + min sum p + 2 sum c + min max a."""
    N = prob.time.shape[1]
    valid = prob.feasible & np.triu(np.ones((N, N), dtype=bool), 1)
    t, a, p = (np.where(valid, x, np.inf) for x in (prob.time, prob.sync, prob.path))
    return (num_microbatches - 1) * max(minimax(t), max(prob.links, default=0.0)) + _min_sum(p)[0] \
        + 2 * sum(prob.links) + minimax(a)


def _stage_memory_bytes(solution, planner, train):
    """Each stage's memory per device, recomputed from the cost model's per-unit
    numbers (the stage's first recompute_num_layers layers recomputing)."""
    cand, P = solution.candidate, len(solution.stages)
    out = []
    for k, st in enumerate(solution.stages):
        g = [grp.name for grp in solution.cluster.groups].index(st.group)
        spec = device_spec(solution.cluster.groups[g].device_type, catalog_with(planner.catalog))
        prec = Precision.for_device(spec)

        def costs(mode):
            shape = StageShape(st.tp, cand.micro_batch_size, train.seq_length, mode)
            return unit_costs(solution.model, spec, shape, prec, planner.network)
        uc, rc = costs("none"), costs(st.recompute)
        i, j = st.units
        first = i + (i == 0)
        covered = st.layers if st.recompute_num_layers is None else st.recompute_num_layers
        act, transient = uc.activation_bytes.copy(), uc.transient_bytes.copy()
        act[first:first + covered] = rc.activation_bytes[first:first + covered]
        transient[first:first + covered] = rc.transient_bytes[first:first + covered]
        static = uc.params[i:j].sum() * prec.static_bytes_per_param(st.dp, planner.distributed_optimizer) \
            + 4 * uc.boundary_bytes
        # 1F1B's min(P - k, M) microbatches in flight, with the messages the
        # engine has sent by then (each held until the step ends).
        rows = memory_rows("1f1b", P, cand.num_microbatches)[k]
        assert max(r[0] for r in rows) == min(P - k, cand.num_microbatches)
        held = max(r[0] * act[i:j].sum() + r[-1] * uc.boundary_bytes for r in rows)
        out.append((static + held + transient[i:j].max(), spec.memory_gib * GIB * planner.memory_headroom))
    return out


def test_returned_plan_fits_memory_and_memory_moves_the_split():
    model = model_preset("llama8b")
    train = TrainConfig(micro_batch_size=1, global_batch_size=64, seq_length=8192)
    # 1f1b: _stage_memory_bytes counts 1F1B's microbatches in flight.
    fixed = dict(tp=1, dp=8, stages=[1, 1], group_order=["nvidia", "amd"], recompute="none", schedule="1f1b")
    roomy = solve(model, paper_cluster(), train, PlannerConfig(**fixed))
    for need, have in _stage_memory_bytes(roomy, PlannerConfig(**fixed), train):
        assert need <= have
    for st in roomy.stages:
        assert st.memory_gib <= st.usable_gib
    # Shrink the H200 below what its stage needed: the H200 stage must give layers away.
    tight_gib = roomy.stages[0].memory_gib / 0.9 * 0.93
    tight = PlannerConfig(**fixed, catalog={"H200": {"memory_gib": tight_gib}})
    squeezed = solve(model, paper_cluster(), train, tight)
    assert squeezed.stages[0].layers < roomy.stages[0].layers
    assert squeezed.step_s >= roomy.step_s
    for need, have in _stage_memory_bytes(squeezed, tight, train):
        assert need <= have


def test_same_inputs_same_plan_and_ranks_are_consistent():
    model = model_preset("qwen2_7b")
    train = TrainConfig(micro_batch_size=1, global_batch_size=128, seq_length=4096)
    plans = [plan_for(model, paper_cluster(), train) for _ in range(3)]
    assert plans[0].to_yaml() == plans[1].to_yaml() == plans[2].to_yaml()
    plan = plans[0]
    assert Plan.from_dict(__import__("yaml").safe_load(plan.to_yaml())) == plan
    cluster = paper_cluster()
    seen = set()
    # The default schedule is auto's choice; a V's second chunks sit on the first P stages' ranks.
    physical = plan.stages[:plan.pipeline_size]
    for st in physical:
        group = [g.name for g in cluster.groups].index(st.group)
        assert len(st.ranks) == st.tp * st.dp and set(st.ranks) <= set(cluster.group_ranks(group))
        assert not seen & set(st.ranks)
        seen |= set(st.ranks)
    assert all(st.ranks in [p.ranks for p in physical] for st in plan.stages)
    assert len({st.dp for st in plan.stages}) == 1  # Megatron: one DP degree
    assert plan.num_layers == model.num_layers
    assert plan.notes["num_microbatches"] * plan.notes["micro_batch_size"] * plan.stages[0].dp == 128


def test_pipeline_order_is_chosen_and_noted():
    model = model_preset("llama8b")
    train = TrainConfig(micro_batch_size=1, global_batch_size=128, seq_length=4096)
    # With an 88 GiB H200 the first stage (two microbatches in flight) belongs on
    # the roomy MI325X: NVIDIA first would have to give away layers (or recompute).
    small_h200 = {"H200": {"memory_gib": 88.0}}
    solution = solve(model, paper_cluster(), train, PlannerConfig(tp=1, dp=8, stages=[1, 1], catalog=small_h200,
                                                                 recompute="none"))
    plan = solution.to_plan()
    assert solution.group_order == ["amd", "nvidia"] == plan.notes["group_order"]
    assert "reordered" in plan.notes
    assert plan.stages[0].group == "amd" and plan.stages[0].ranks == list(range(8, 16))
    assert plan.stages[1].ranks == list(range(8))
    fixed = solve(model, paper_cluster(), train, PlannerConfig(tp=1, dp=8, stages=[1, 1], catalog=small_h200,
                                                              group_order=["nvidia", "amd"], recompute="none"))
    assert fixed.group_order == ["nvidia", "amd"] and "reordered" not in fixed.to_plan().notes
    assert fixed.stages[0].layers < solution.stages[1].layers and fixed.step_s > solution.step_s


def test_explicit_split_is_predicted_not_searched():
    model = model_preset("llama8b")
    train = TrainConfig(micro_batch_size=1, global_batch_size=128, seq_length=4096)
    planner = PlannerConfig(tp=1, dp=8, group_order=["nvidia", "amd"])
    best = solve(model, paper_cluster(), train, planner)
    paper = solve(model, paper_cluster(), train, planner, layers=[15, 17])
    assert [s.layers for s in paper.stages] == [15, 17]
    assert paper.step_s >= best.step_s
    with pytest.raises(ConfigError, match="plan splits 20 layers"):
        solve(model, paper_cluster(), train, planner, layers=[10, 10])
    with pytest.raises(ConfigError, match="cannot cover the cluster's 2 groups"):
        solve(model, paper_cluster(), train, planner, layers=[32])


def test_bad_input_says_what_does_not_fit_and_by_how_much():
    model = model_preset("llama8b")
    train = TrainConfig(micro_batch_size=1, global_batch_size=8, seq_length=8192)
    small = ClusterConfig(name="small", groups=[
        GroupConfig(name="nvidia", vendor="nvidia", device_type="H100", ranks_per_node=1),
        GroupConfig(name="amd", vendor="amd", device_type="MI250X", ranks_per_node=1)])
    tiny_mem = PlannerConfig(catalog={"MI250X": {"memory_gib": 32.0}})
    with pytest.raises(ConfigError) as err:
        solve(model, small, train, tiny_mem)
    message = str(err.value)
    assert message.startswith("llama8b does not fit on cluster 'small' under any plan")
    assert "GiB usable" in message and "short by" in message
    short = float(message.split("short by ")[1].split(" GiB")[0])
    assert short > 0

    with pytest.raises(ConfigError, match="unknown device type 'B300'"):
        solve(model, ClusterConfig(name="x", groups=[GroupConfig(name="n", device_type="B300")]), train)
    with pytest.raises(ConfigError, match=r"planner.tp=3 does not divide model.num_attention_heads=32 .*"
                                          r"32 = 10 x 3 \+ 2"):
        solve(model, paper_cluster(), train, PlannerConfig(tp=3))
    with pytest.raises(ConfigError, match="planner.tp=8 does not fit group 'amd'"):
        cluster = paper_cluster()
        cluster.groups[1].ranks_per_node = 4
        solve(model, cluster, train, PlannerConfig(tp=8))
    with pytest.raises(ConfigError, match="planner.dp=3 does not divide"):
        solve(model, paper_cluster(), train, PlannerConfig(dp=3))


def test_a_profile_replaces_the_analytic_costs(tmp_path):
    model = model_preset("tiny_llama")
    train = TrainConfig(micro_batch_size=2, global_batch_size=8, seq_length=64)
    cluster = ClusterConfig(name="cpu_mixed", emulate=True, groups=[
        GroupConfig(name="nvidia", vendor="nvidia", device_type="CPU"),
        GroupConfig(name="amd", vendor="amd", device_type="CPU")])
    analytic = solve(model, cluster, train)
    unit = {"forward_s": 0.01, "backward_s": 0.02, "activation_bytes": 1000, "peak_bytes": None}
    entry = {"shape": profile_shape(model, 64, "fp32"), "micro_batch_size": 1,
             "units": {"embedding": unit, "layer": unit, "head": unit}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "devices": {"CPU": [entry]}}))
    # 1f1b: one stage per rank, whose compute the per-unit profile gives below.
    measured = solve(model, cluster, train, PlannerConfig(profile=str(path), schedule="1f1b"))
    assert measured.cost_source == {"nvidia": "profile", "amd": "profile"}
    assert analytic.cost_source == {"nvidia": "analytic", "amd": "analytic"}
    # Per unit 0.03 s at microbatch 1, scaled to microbatch 2, times 4 microbatches.
    for st in measured.stages:
        units = st.units[1] - st.units[0]
        assert st.compute_s == pytest.approx(4 * units * 0.06)
    assert measured.step_s != pytest.approx(analytic.step_s)
    # A profile of other shapes is not used.
    other = solve(model, cluster, TrainConfig(micro_batch_size=2, global_batch_size=8, seq_length=128),
                  PlannerConfig(profile=str(path)))
    assert other.cost_source == {"nvidia": "analytic", "amd": "analytic"}


def test_a_noisy_profiles_negative_times_leave_the_search_exact(tmp_path):
    """A noisy CPU profile can make a unit's time negative; the bounds that
    assume otherwise step aside, and every schedule's search finds what
    solving every candidate (every zb_v start of the walk) finds."""
    model = model_preset("tiny_llama")
    train = TrainConfig(micro_batch_size=1, global_batch_size=8, seq_length=64)
    cluster = ClusterConfig(name="cpu_mixed", emulate=True, groups=[
        GroupConfig(name="nvidia", vendor="nvidia", device_type="CPU", nodes=2, ranks_per_node=2),
        GroupConfig(name="amd", vendor="amd", device_type="CPU", nodes=2, ranks_per_node=2)])
    unit = {"forward_s": 0.01, "backward_s": 0.02, "activation_bytes": 1000, "peak_bytes": None}
    noisy = {**unit, "forward_s": 0.002, "backward_s": -0.004}
    entry = {"shape": profile_shape(model, 64, "fp32"), "micro_batch_size": 1,
             "units": {"embedding": unit, "layer": noisy, "head": unit}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "devices": {"CPU": [entry]}}))
    ctx = CostContext(model, cluster, train, PlannerConfig(profile=str(path)))
    assert (ctx.unit_costs(0, 1, 1, "none", False).time_s < 0).any()
    for schedule in ("1f1b", "zb_h1", "gpipe"):
        blocks = candidates.enumerate_blocks(ctx, None, schedule)
        assert solver._search(ctx, blocks, None, schedule)[0] == _first_of_the_fastest(ctx, blocks, schedule)
    blocks = candidates.enumerate_blocks(ctx, None, "zb_v")
    every = v_search.plain_walk("zb_v", ctx, blocks, lambda cand: v_split.starts("zb_v", ctx, cand))
    walk = v_search._Walk("zb_v", ctx, blocks, VBounds(ctx, "zb_v"))
    walk.settle()
    assert v_search.finalists(*walk.results()[:2]) == v_search.finalists(*every[:2])
    # Water levels over layer counts would pass some starts' steps here: the bound steps aside.
    bounds = VBounds(ctx, "zb_v")
    for block in blocks:
        for row, bound in enumerate(bounds.blocks([(block, np.arange(len(block.stages)))])[0].sum(axis=0)):
            cand = block.candidate(row)
            for cuts in v_split.starts("zb_v", ctx, cand):
                split, _ = v_split.evaluate("zb_v", ctx, cand, cuts)
                assert split is None or bound <= split.step_s


def test_zb_v_search_below_a_step_finds_the_same_plan_or_rules_it_out():
    """A later context-parallel degree searches zb_v only below the best step
    so far: where the walk's plan beats it, the same plan; where every
    candidate's bound reaches it, no walk at all (no start simulated)."""
    rng = np.random.default_rng(31)
    skipped = 0
    for _ in range(8):
        ctx = _random_problem(rng, "zb_v")
        try:
            blocks = candidates.enumerate_blocks(ctx, None, "zb_v")
        except ConfigError:
            continue  # no V layout of this draw
        whole, _ = v_search.search("zb_v", ctx, blocks, None)
        if whole is None:
            continue
        step = whole[1].step_s
        assert v_search.search("zb_v", ctx, blocks, None, beat=step * 1.001)[0] == whole
        for beat in (step, step * 0.5, step * 0.01):
            got, simulated = v_search.search("zb_v", ctx, blocks, None, beat=beat)
            assert got is None or got == whole  # the walk's own plan, which the solver then drops
            skipped += got is None and simulated == 0
    assert skipped >= 3


def test_transport_choice_changes_boundary_cost():
    model = model_preset("llama8b")
    train = TrainConfig(micro_batch_size=1, global_batch_size=128, seq_length=4096)
    fixed = dict(tp=1, dp=8, stages=[1, 1], group_order=["nvidia", "amd"])
    forwarded = solve(model, paper_cluster(kind="tcp", streams_per_address=1), train, PlannerConfig(**fixed))
    direct = solve(model, paper_cluster(kind="tcp", streams_per_address=1), train,
                   PlannerConfig(**fixed, transport="direct"))
    assert forwarded.transport == "cpu_forwarding" and direct.transport == "direct"
    assert direct.stages[0].p2p_s < forwarded.stages[0].p2p_s
    slow_net = PlannerConfig(**fixed, network=NetworkConfig(tcp_stream_gbs=0.05))
    assert solve(model, paper_cluster(kind="tcp"), train, slow_net).step_s > forwarded.step_s
