"""What each pipeline schedule costs the planner: its bubble and its memory.

The split search (:mod:`hetpipe.partitioner.split`) prices a layout as

    T = (M - 1) * max(max_k t_k, max_l c_l) + sum_k p_k + 2 * sum_l c_l + max_k a_k

where ``t_k`` paces the steady state and ``p_k`` is stage k's share of the
fill/drain path. The schedules differ only in ``p_k`` and in how many
microbatches each stage keeps in flight, which is all this module says:

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
  ``max_in_flight``), and the model keeps a unit's activations until its W
  (W needs the inputs of the weight GEMMs): 1F1B's peak on the first stage,
  more than 1F1B on the others. Full recomputation is refused (see
  :class:`hetpipe.partitioner.plan.Plan`).
* **gpipe**: all forwards, then all backwards. For equal stages its makespan
  equals 1F1B's (the simulator agrees); it keeps all M microbatches on every
  stage, so it only wins where nothing else is allowed. Its time is taken as
  1F1B's (for unequal stages GPipe's is a little longer: a lower estimate).

Interleaved 1F1B is not modelled: its virtual stages need a split of
``P x num_chunks`` ranges with a different pacing, which the split search
does not solve.
"""
from __future__ import annotations

import numpy as np

from hetpipe.errors import ConfigError
from hetpipe.models.model_config import ModelConfig

# In the order the planner reports them and breaks ties by (least memory first).
PLANNED_SCHEDULES = ("1f1b", "zb_h1", "gpipe")


def schedules_for(schedule: str, recompute: str) -> tuple[str, ...]:
    """The schedules ``planner.schedule`` lets the search consider."""
    if schedule == "auto":
        # Full recomputation everywhere leaves zb_h1 nothing it can run.
        return tuple(s for s in PLANNED_SCHEDULES if not (s == "zb_h1" and recompute == "full"))
    if schedule not in PLANNED_SCHEDULES:
        raise ConfigError(f"planner.schedule={schedule!r} is not one of auto, {', '.join(PLANNED_SCHEDULES)} "
                          "(the planner does not model interleaved_1f1b)")
    if schedule == "zb_h1" and recompute == "full":
        raise ConfigError("planner.schedule=zb_h1 cannot run planner.recompute=full (its deferred weight "
                          "gradients would recompute the layer again); use auto, none or selective")
    return (schedule,)


def recompute_modes(schedule: str, modes: tuple[str, ...]) -> tuple[str, ...]:
    """The recomputation modes a stage may run under ``schedule``: zb_h1's
    deferred W would rerun a fully recomputed layer's forward again."""
    return tuple(m for m in modes if not (schedule == "zb_h1" and m == "full"))


def in_flight(schedule: str, num_stages: int, num_microbatches: int) -> np.ndarray:
    """Per stage, the most microbatches whose activations it holds at once."""
    P, M = num_stages, num_microbatches
    if schedule == "gpipe":
        return np.full(P, M)
    if schedule == "zb_h1":
        return np.full(P, min(P, M))
    return np.minimum(P - np.arange(P), M)


def weight_credit(schedule: str, num_stages: int, num_microbatches: int) -> float:
    """kappa in ``p_k = t_k - 2 kappa w_k`` (k > 0): 1 for zb_h1 with M >= P, 0 for the others."""
    P, M = num_stages, num_microbatches
    if schedule != "zb_h1" or P == 1:
        return 0.0
    return (P - 2 + min(M, P)) / (2 * (P - 1))


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
