"""The exact split: the dynamic program against brute force over every contiguous split."""
import itertools

import numpy as np
import pytest

from hetpipe.partitioner.split import best_split, evaluate_split

INF = float("inf")


def brute_force(time, sync, feasible, M, links):
    """Every split of U units into P non-empty contiguous stages, scored by the 1F1B formula."""
    P, N = time.shape[0], time.shape[1]
    best = None
    for cuts in itertools.combinations(range(1, N - 1), P - 1):
        b = (0, *cuts, N - 1)
        if not all(feasible[k, b[k], b[k + 1]] for k in range(P)):
            continue
        t = [time[k, b[k], b[k + 1]] for k in range(P)]
        a = [sync[k, b[k], b[k + 1]] for k in range(P)]
        step = (M - 1) * max(max(t), max(links, default=0.0)) + sum(t) + 2 * sum(links) + max(a)
        if best is None or step < best[0]:
            best = (step, b)
    return best


def ranges(x):
    c = np.concatenate([[0.0], np.cumsum(x)])
    return c[None, :] - c[:, None]


def range_max(x):
    n = len(x) + 1
    out = np.zeros((n, n))
    for i in range(n - 1):
        out[i, i + 1:] = np.maximum.accumulate(x[i:])
    return out


def random_problem(rng, integer=False):
    """A pipeline of 2-3 device groups over U units with random per-unit costs,
    parameter counts and activation sizes, and random memory capacities."""
    U = int(rng.integers(3, 10))
    G = int(rng.integers(2, 4))
    stages_per_group = rng.integers(1, 3, size=G)
    while stages_per_group.sum() > U:
        stages_per_group[np.argmax(stages_per_group)] -= 1
    P = int(stages_per_group.sum())
    M = int(rng.integers(1, 9))
    draw = (lambda lo, hi, n: rng.integers(lo, hi, size=n).astype(float)) if integer else \
        (lambda lo, hi, n: rng.uniform(lo, hi, size=n))
    params = draw(1, 5, U)
    per_group = []
    for _ in range(G):
        cost = draw(1, 10, U)
        act = draw(1, 4, U)
        transient = draw(0, 3, U)
        per_group.append((ranges(cost), ranges(params) * rng.uniform(0.01, 0.5), ranges(params),
                          ranges(act), range_max(transient), rng.uniform(8, 40)))
    time, sync, feasible = [], [], []
    for g, n in enumerate(stages_per_group):
        t, a, static, act, transient, capacity = per_group[g]
        for _ in range(n):
            k = len(time)
            time.append(t)
            sync.append(a)
            feasible.append(static + min(P - k, M) * act + transient <= capacity)
    links = list(draw(0, 6, P - 1)) if rng.random() < 0.7 else [0.0] * (P - 1)
    return np.stack(time), np.stack(sync), np.stack(feasible), M, links


@pytest.mark.parametrize("integer", [False, True], ids=["real", "ties"])
def test_dynamic_program_matches_brute_force(integer):
    rng = np.random.default_rng(7 + integer)
    checked = infeasible = 0
    for _ in range(400):
        time, sync, feasible, M, links = random_problem(rng, integer)
        expected = brute_force(time, sync, feasible, M, links)
        got = best_split(time, sync, feasible, M, links)
        if expected is None:
            assert got is None
            infeasible += 1
            continue
        assert got is not None
        assert got.step_s == pytest.approx(expected[0], rel=1e-12)
        # The returned split is a real, feasible split with the claimed step time.
        again = evaluate_split(time, sync, feasible, M, links, got.bounds)
        assert again is not None and again.step_s == pytest.approx(got.step_s, rel=1e-12)
        checked += 1
    assert checked > 200 and infeasible > 10  # both outcomes exercised


def test_arbitrary_stage_costs_and_single_stage():
    """Costs need not be sums over units: any per-range matrix works."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        P, N = int(rng.integers(1, 5)), int(rng.integers(6, 10))
        if P > N - 1:
            continue
        time = rng.uniform(0, 10, size=(P, N, N))
        sync = rng.uniform(0, 3, size=(P, N, N))
        feasible = rng.random((P, N, N)) < 0.8
        M = int(rng.integers(1, 12))
        links = list(rng.uniform(0, 8, size=P - 1))
        expected = brute_force(time, sync, feasible, M, links)
        got = best_split(time, sync, feasible, M, links)
        assert (got is None) == (expected is None)
        if got is not None:
            assert got.step_s == pytest.approx(expected[0], rel=1e-12)


def test_deterministic_and_memory_respected():
    rng = np.random.default_rng(11)
    time, sync, feasible, M, links = random_problem(rng)
    first = best_split(time, sync, feasible, M, links)
    assert all(best_split(time, sync, feasible, M, links) == first for _ in range(3))
    # Forbid the chosen first stage: the answer moves and never uses a forbidden range.
    if first is not None:
        feasible = feasible.copy()
        feasible[0, 0, first.bounds[1]] = False
        second = best_split(time, sync, feasible, M, links)
        assert second is None or (second.bounds[1] != first.bounds[1] and second.step_s >= first.step_s)


@pytest.mark.parametrize("integer", [False, True], ids=["real", "ties"])
def test_a_step_to_beat_keeps_the_split_that_beats_it(integer):
    """The search passes its best plan's step as ``beat``: a split faster than it
    is the very one found without it (ties included), and none faster is missed."""
    rng = np.random.default_rng(19 + integer)
    kept = cut = 0
    for _ in range(300):
        time, sync, feasible, M, links = random_problem(rng, integer)
        free = best_split(time, sync, feasible, M, links)
        if free is None:
            continue
        for beat in (free.step_s * 1.05, free.step_s, free.step_s * 0.95):
            got = best_split(time, sync, feasible, M, links, beat=beat)
            if free.step_s < beat:
                assert got == free
                kept += 1
            else:
                assert got is None or got.step_s >= beat
                cut += 1
    assert kept > 100 and cut > 200
