"""What each pipeline schedule costs the planner: its bubble and its memory.

The split search (:mod:`hetpipe.partitioner.split`) prices a layout as

    T = (M - 1) * max(max_k t_k, max_l c_l) + sum_k p_k + 2 * sum_l c_l + max_k a_k

where ``t_k`` paces the steady state and ``p_k`` is stage k's share of the
fill/drain path. The schedules differ only in ``p_k`` and in what each
stage keeps in memory (:func:`memory_rows`: its microbatches in flight, and
more), which is all this module says:

* **1f1b**: ``p_k = t_k``, stage k keeps ``min(P - k, M)`` microbatches.
  Equal stages give the textbook ``(M + P - 1) t``: a bubble of
  ``(P - 1)(F + B + W)``.
* **zb_h1** (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024):
  the backward splits into B (input gradient, on the critical path) and W
  (weight gradients, which nobody waits for). The steady state is paced as
  1F1B's (every microbatch still costs F + B + W on every stage), but the
  last microbatch's backward crosses the pipeline as B alone and the Ws
  fill the warm-up's waits, so for ``M >= P`` the bubble shrinks to
  ``(P - 1)(F + B - W)``: ``p_k = t_k - 2 w_k`` for k > 0, while the first
  stage, whose last Ws end the step, keeps ``p_0 = t_0``. With fewer
  microbatches than stages there are fewer Ws to fill with: the simulator's
  unit-cost makespan (F = B = W = 1) is ``3M + P - 1`` for ``M >= P`` and
  ``2M + 2P - 1`` below, so the credit is scaled by
  ``(P - 2 + min(M, P)) / (2 (P - 1))`` and matches both exactly
  (``tests/test_partitioner_schedules.py``). Every stage holds up to
  ``min(P, M)`` microbatches between F and W (the simulator's
  ``max_in_flight``, :func:`in_flight`), each with its activations and the
  gradients its W needs; what the engine really holds, a little more, is
  :func:`memory_rows`'s. Full recomputation is refused (see
  :class:`hetpipe.partitioner.plan_data.Plan`).
* **gpipe**: all forwards, then all backwards. For equal stages its makespan
  equals 1F1B's (the simulator agrees); it keeps all M microbatches on every
  stage, so it only wins where nothing else is allowed. Its time is taken as
  1F1B's (for unequal stages GPipe's is a little longer: a lower estimate).

* **zb_v** (two chunks per rank in a V, :mod:`hetpipe.pipeline.schedule_zbv`): rank
  r holds virtual stages r and 2P - 1 - r, two unit ranges, which the formula
  above does not price: a V waits on each chunk in turn, not on a rank's
  total, so :mod:`hetpipe.partitioner.v_split` runs the zb_v order itself
  with each chunk's F, B and W times and each message's time
  (:mod:`hetpipe.partitioner.v_timing`). For equal chunks (a chunk's F = B =
  W = 1) that is the simulator's unit-cost makespan ``6M + max(P - 1, 4P - 2
  - 2M)``: one chunk forward per later rank once ``M >= 2P - 1``. Memory is
  counted per chunk: a rank
  keeps chunk c's activations from its F to its W, and :func:`v_chunk_counts`
  lists the (chunk 0, chunk 1) counts its order reaches at its peaks (2P
  chunks in all once full: P whole stages' worth for equal chunks, 1F1B's
  peak on its first stage); the planner prices the engine's own holdings
  per chunk (:func:`memory_rows`). Each boundary carries both chunks' messages; the
  tied embedding and head share rank 0 (summed there, no sync across ranks,
  each chunk keeping its own copy). The makespan and the counts equal the
  simulator's for every P <= 6 and M <= 13 (``tests/test_partitioner_schedules.py``).

Interleaved 1F1B is not modelled: its virtual stages need a split of
``P x num_chunks`` ranges with a different pacing, which the split search
does not solve.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import numpy as np

from hetpipe.errors import ConfigError
from hetpipe.models.model_config import ModelConfig
from hetpipe.pipeline.actions import BWD, BWD_INPUT, BWD_WEIGHT, FWD
from hetpipe.pipeline.placement import Placement
from hetpipe.pipeline.registry import SCHEDULES, V_SPLIT, Pricing, planned, schedule_spec
from hetpipe.pipeline.schedules import compute_orders, output_stage

# In the order the planner reports them and breaks ties by (least memory
# first): the registry's entries with a Pricing, by its preference.
PLANNED_SCHEDULES = tuple(s.name for s in planned())


def schedules_for(schedule: str, recompute: str) -> tuple[str, ...]:
    """The schedules ``planner.schedule`` lets the search consider."""
    if schedule == "auto":
        # Full recomputation everywhere leaves the zero-bubble schedules nothing they can run.
        return tuple(s for s in PLANNED_SCHEDULES if not (_splits_backward(s) and recompute == "full"))
    if schedule not in PLANNED_SCHEDULES:
        unmodelled = ", ".join(s for s in SCHEDULES if s not in PLANNED_SCHEDULES)
        raise ConfigError(f"planner.schedule={schedule!r} is not one of auto, {', '.join(PLANNED_SCHEDULES)} "
                          f"(the planner does not model {unmodelled})")
    if _splits_backward(schedule) and recompute == "full":
        raise ConfigError(f"planner.schedule={schedule} cannot run planner.recompute=full (its deferred weight "
                          "gradients would recompute the layer again); use auto, none or selective")
    return (schedule,)


def is_v_shaped(schedule: str) -> bool:
    """Whether ``schedule``'s ranks hold two unit ranges in a V (split by partitioner/v_split.py)."""
    pricing = schedule_spec(schedule).pricing
    return pricing is not None and pricing.split == V_SPLIT


def recompute_modes(schedule: str, modes: tuple[str, ...]) -> tuple[str, ...]:
    """The recomputation modes a stage may run under ``schedule``: a zero-bubble
    schedule's deferred W would rerun a fully recomputed layer's forward again."""
    return tuple(m for m in modes if not (_splits_backward(schedule) and m == "full"))


def _splits_backward(schedule: str) -> bool:
    return schedule_spec(schedule).split_backward


def _pricing(schedule: str) -> Pricing:
    """``schedule``'s planner facts; one line for a schedule the planner does not model."""
    pricing = schedule_spec(schedule).pricing
    if pricing is None:
        raise ConfigError(f"the planner does not model schedule {schedule}")
    return pricing


def in_flight(schedule: str, num_stages: int, num_microbatches: int) -> np.ndarray:
    """Per stage, the most microbatches between their F and their W (or
    whole backward) at once, as the schedule defines them (contiguous
    schedules, the entry's ``in_flight``; zb_v's chunks: :func:`v_chunk_counts`).
    Memory is priced with what the engine holds, :func:`memory_rows`."""
    return _pricing(schedule).in_flight(num_stages, num_microbatches)


@lru_cache(maxsize=64)
def v_chunk_counts(schedule: str, num_ranks: int, num_microbatches: int) -> tuple[np.ndarray, ...]:
    """Per rank under a V schedule (zb_v), the (chunk 0, chunk 1) counts of microbatches
    between their F and their W at the moments no other moment dominates
    (rows of an (n, 2) array): the rank's activation peak is the largest
    ``n0 * a0 + n1 * a1`` over these rows, whatever its chunks' sizes a0, a1."""
    counts = []
    for order in compute_orders(schedule, num_ranks, num_microbatches, 2):
        live, seen = [0, 0], set()
        for kind, _, chunk in order:
            if kind == FWD:
                live[chunk] += 1
                seen.add(tuple(live))
            elif kind == BWD_WEIGHT:
                live[chunk] -= 1
        peaks = [p for p in seen if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in seen)]
        counts.append(np.array(sorted(peaks), dtype=float))
    return tuple(counts)


@lru_cache(maxsize=128)
def memory_rows(schedule: str, num_ranks: int, num_microbatches: int) -> tuple[np.ndarray, ...]:
    """Per rank, what it holds at the moments its memory can peak, walking the
    engine's own action list (:func:`hetpipe.pipeline.schedules.build_schedule`'s
    computations, each send right after the one that produced it) as
    :meth:`hetpipe.training.engine.PipelineEngine.run_step` runs it.

    Each row, one per computation, counts for each of the rank's C chunks
    (1, or 2 under zb_v) the microbatches whose activations are alive, those
    whose B has run and W not (each keeps its W's inputs,
    :func:`hetpipe.partitioner.cost.weight_pass_bytes`), whether the
    computation is that chunk's W, and last the messages sent so far:
    columns ``[act_0.., kept_0.., weight_0.., sends]``. A row is the largest
    moment of its computation (a forward's activations complete, a B's kept
    gradients too). Rows another row dominates are left out, so the rank's
    peak is the largest of :func:`peak_bytes` over them whatever the chunks'
    sizes (beyond ``MAX_MEMORY_ROWS``, a bound a little above it).

    Three things the engine does, beyond the schedule's own counts
    (``in_flight``, ``v_chunk_counts``), and why the zero-bubble schedules'
    peaks were 7-16 % above the older closed form on 2xH200 (LLaMA-3-8B,
    seq 8192, 16 microbatches, docs/partitioner.md):

    * B keeps the graph (``retain_graph``), so activations stay until W,
      with W's input gradients on top (zb_h1 rank 1 holds two such
      microbatches at its Ws: 120.4 GiB measured).
    * The graph of the last microbatch that ran B stays referenced by the
      engine's ``out`` until the next forward has finished or the next B
      starts, even after its W: on zb_h1's first rank, whose W directly
      follows its B, a forward then runs with three microbatches' activations
      alive instead of two (126.6 GiB measured, 1F1B's 108.8; on CPU the
      previous microbatch's saved tensors are still alive, after its W, when
      a forward returns). 1F1B's backward frees the saved tensors itself.
    * Sends are waited for only at the end of the step, and each holds its
      tensor until then: a rank's peak late in the step carries up to M
      boundary messages per direction it sends (1 GiB at seq 8192, M = 16).
    """
    chunks = schedule_spec(schedule).chunks or 1
    placement = Placement(schedule, num_ranks, chunks)
    last = placement.num_stages - 1
    out = []
    for rank, order in enumerate(compute_orders(schedule, num_ranks, num_microbatches, chunks)):
        # Whether a computation's product goes to another rank: a send right after it.
        sending = {}
        for kind in (FWD, BWD, BWD_INPUT):
            for chunk in range(chunks):
                target = output_stage(kind, placement.stage(rank, chunk), last)
                sending[kind, chunk] = target is not None and placement.rank_of(target) != rank
        live: set = set()
        done: set = set()
        counts = [0] * (3 * chunks)  # alive, kept (B run, W not), a W running; per chunk
        holder = None
        sends = 0
        best: dict[tuple, int] = {}  # counts -> most messages sent at them

        def note() -> None:
            key = tuple(counts)
            best[key] = max(best.get(key, 0), sends)

        def drop(key) -> None:
            live.discard(key)
            counts[key[1]] -= 1

        def release(key) -> None:
            """``out`` no longer holds ``key``'s graph: freed if its W has run."""
            if key in done and key in live:
                drop(key)

        for kind, microbatch, chunk in order:
            key = (microbatch, chunk)
            if kind == FWD:
                live.add(key)
                counts[chunk] += 1
                note()
                release(holder)  # ``out`` is rebound once the forward returns
                holder = key
            elif kind == BWD:  # a whole backward frees its saved tensors
                release(holder)
                holder = None
                note()
                drop(key)
            elif kind == BWD_INPUT:
                release(holder)  # ``out`` is rebound as B starts
                holder = key
                counts[chunks + chunk] += 1
                note()
            else:  # BWD_WEIGHT
                counts[2 * chunks + chunk] = 1
                note()
                counts[2 * chunks + chunk] = 0
                counts[chunks + chunk] -= 1
                done.add(key)
                if key != holder:
                    drop(key)
            if kind != BWD_WEIGHT:
                sends += sending[kind, chunk]
        out.append(_undominated([k + (n,) for k, n in best.items()]))
    return tuple(out)


# More rows than this (GPipe's last stages with many microbatches: each
# backward trades one microbatch's activations for one more message sent)
# are merged, neighbours by messages sent, into their column-wise maxima:
# a bound above the peak by at most a few messages per merged row.
MAX_MEMORY_ROWS = 64


def _undominated(rows: list[tuple]) -> np.ndarray:
    """The rows no other row is at least as large as in every column, by
    messages sent; beyond ``MAX_MEMORY_ROWS``, neighbours merged."""
    rows = np.array(rows, dtype=float)
    rows = rows[np.lexsort(rows.T[::-1])]
    rows = rows[np.argsort(rows[:, -1], kind="stable")]
    if len(rows) > 4 * MAX_MEMORY_ROWS:  # merged first too, so that the pruning stays cheap
        rows = _merged(rows, 4 * MAX_MEMORY_ROWS)
    covers = (rows[None] >= rows[:, None]).all(axis=2) & (rows[None] > rows[:, None]).any(axis=2)
    kept = rows[~covers.any(axis=1)]
    return _merged(kept, MAX_MEMORY_ROWS) if len(kept) > MAX_MEMORY_ROWS else kept


def _merged(rows: np.ndarray, groups: int) -> np.ndarray:
    """``rows`` (in order of messages sent) as ``groups`` runs of
    neighbours, each its column-wise maximum."""
    return np.stack([run.max(axis=0) for run in np.array_split(rows, groups)])


def peak_bytes(rows: np.ndarray, act: list, kept: list, weight: list, boundary: float):
    """The largest of a rank's :func:`memory_rows` priced with each chunk's
    activation, kept and W bytes (numbers, or arrays alike in shape: every
    unit range at once) and one boundary message's bytes."""
    C = len(act)
    best = None
    for row in rows:
        total = row[3 * C] * boundary
        for c in range(C):
            total = total + row[c] * act[c] + row[C + c] * kept[c] + row[2 * C + c] * weight[c]
        best = total if best is None else np.maximum(best, total)
    return best


def weight_credit(schedule: str, num_stages: int, num_microbatches: int) -> float:
    """kappa in ``p_k = t_k - 2 kappa w_k`` (k > 0) of the contiguous schedules
    (the entry's ``weight_credit``): 1 for zb_h1 with M >= P, 0 for 1f1b and
    gpipe (zb_v is simulated: v_split)."""
    return _pricing(schedule).weight_credit(num_stages, num_microbatches)


def max_weight_credit(schedule: str) -> Optional[float]:
    """The largest :func:`weight_credit` of ``schedule``, for the search's lower bounds (None: no credit)."""
    return _pricing(schedule).max_weight_credit


def boundary_messages(schedule: str) -> int:
    """Messages each way over a boundary per microbatch: both chunks' in a V."""
    return _pricing(schedule).boundary_messages


def weight_backward_s(model: ModelConfig, micro_batch_size: int, seq_length: int, forward_s: np.ndarray,
                      backward_s: np.ndarray) -> np.ndarray:
    """Per unit, the weight-gradient part (W) of its backward, from its forward time.

    A linear layer's backward is two GEMMs of its forward's size, dX (in B)
    and dW (in W), so W takes as long as the forward's GEMMs: half of their
    backward. The attention core has no weights, so its backward is all B,
    and a layer's W is its forward time scaled by the GEMMs' share of its
    forward FLOPs (90 % for LLaMA-8B at 4096 tokens: W is 45 % of the
    backward). The head is one GEMM (W = its forward); the embedding's
    backward is only its table's gradient (W = all of it). Profiles record one
    backward per unit, not its split, so the same shares apply to measured
    forwards; a recomputing layer's rerun belongs to B (it rebuilds what dX
    needs), which is why W is derived from the forward, not the backward.
    """
    b, s, h = micro_batch_size, seq_length, model.hidden_size
    a, g, d, f = model.num_attention_heads, model.num_query_groups, model.head_dim, model.ffn_hidden_size
    gemm = 4.0 * b * s * (h * a * d + h * g * d + 1.5 * h * f)
    core = 4.0 * b * s * s * a * d
    weight = forward_s * gemm / (gemm + core)
    weight[0], weight[-1] = backward_s[0], forward_s[-1]
    return weight
