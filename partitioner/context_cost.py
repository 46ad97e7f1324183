"""What context parallelism (``partition.cp``) costs a decoder layer, per CP rank.

Three numbers, each conservative (never under the run's):

* compute: a layer's forward FLOPs are ``4bs(...)`` for the projections and
  MLP, linear in the tokens, plus ``4bs^2ad`` for attention, quadratic
  (:func:`hetpipe.models.families.dense.layer_forward_flops`). CP divides the
  tokens by C; the load-balanced chunks (rank i holds chunks i and 2C-1-i)
  divide the causal attention work by C too, so a rank's share is 1/C of
  both terms. The split costs the kernels efficiency on short blocks, which
  ``efficiency`` (default 1) lets a caller charge.
* traffic: per layer, forward and backward, each rank receives the other
  ranks' K and V (all-gather; the ring passes the same blocks round in C-1
  shifts) and, in the backward, sends their gradients back (reduce-scatter;
  the ring sends them with the blocks, twice the K/V bytes), on the
  group's links.
* memory: a layer's saved activations scale with the rank's tokens (1/C);
  under ``allgather`` a layer also keeps the gathered K and V of the whole
  sequence for its backward (the ring keeps only its own, but its fp32
  blocks are a transient of ``b * heads * (s/C)^2 * 4`` bytes).

:func:`smallest_fitting_cp` is what a planner asks: the least CP degree (a
divisor of the group's ranks, with the sequence in 2C chunks) whose
activations fit beside the weights.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hetpipe.models.families import spec_of
from hetpipe.models.model_config import ModelConfig

if TYPE_CHECKING:
    from hetpipe.partitioner.cost import UnitCosts


@dataclass(frozen=True)
class CpLayerCost:
    """One decoder layer on one CP rank, per microbatch."""
    forward_flops: float  # this rank's share
    attention_share: float  # the quadratic part's fraction of the whole layer's FLOPs
    traffic_bytes: float  # forward + backward, received by this rank
    comm_s: float  # traffic on the group's links, with one latency per message
    activation_bytes: float  # kept for the backward


def kv_bytes(model: ModelConfig, b: int, s: int, element_bytes: int) -> float:
    """K and V of ``s`` tokens (all KV heads)."""
    return 2.0 * b * s * model.num_query_groups * model.head_dim * element_bytes


def attention_share(model: ModelConfig, s: int) -> float:
    """The quadratic term's share of a layer's forward FLOPs at sequence ``s``."""
    quadratic = 4.0 * s * s * model.num_attention_heads * model.head_dim
    return quadratic / spec_of(model).layer_forward_flops(model, 1, s)


def cp_layer_cost(model: ModelConfig, b: int, s: int, cp: int, method: str, layer_activation_bytes: float,
                  element_bytes: int, link_gbs: float, latency_us: float, efficiency: float = 1.0) -> CpLayerCost:
    """One layer's cost on one of ``cp`` ranks; ``layer_activation_bytes`` is
    the layer's saved bytes at the whole sequence (cost.layer_activation_bytes)."""
    others = kv_bytes(model, b, s, element_bytes) * (cp - 1) / cp
    traffic = 2.0 * others if method == "allgather" else 3.0 * others  # ring: K/V twice, grads once
    messages = 2 if method == "allgather" else 3 * (cp - 1)
    comm = traffic / (link_gbs * 1e9) + messages * latency_us * 1e-6 if cp > 1 else 0.0
    kept = layer_activation_bytes / cp
    if method == "allgather" and cp > 1:
        kept += kv_bytes(model, b, s, element_bytes) * (cp - 1) / cp
    flops = spec_of(model).layer_forward_flops(model, b, s) / cp / efficiency
    return CpLayerCost(flops, attention_share(model, s), traffic if cp > 1 else 0.0, comm, kept)


def cp_degrees(group_ranks: int, seq_length: int) -> list[int]:
    """CP degrees a group of ``group_ranks`` can run at ``seq_length``: divisors, 2C | s."""
    return [c for c in range(1, group_ranks + 1) if group_ranks % c == 0 and seq_length % (2 * c) == 0]


def smallest_fitting_cp(model: ModelConfig, b: int, s: int, group_ranks: int, layers_per_rank: int,
                        layer_activation_bytes: float, static_bytes: float, capacity_bytes: float,
                        element_bytes: int, method: str = "allgather") -> int:
    """The least CP degree whose ``layers_per_rank`` layers' activations fit in
    ``capacity_bytes`` beside ``static_bytes`` (weights, gradients, optimizer);
    0 when none does."""
    for cp in cp_degrees(group_ranks, s):
        kept = cp_layer_cost(model, b, s, cp, method, layer_activation_bytes, element_bytes, 1.0, 0.0)
        if static_bytes + layers_per_rank * kept.activation_bytes <= capacity_bytes:
            return cp
    return 0


# -- a CP rank's unit costs (what the solver prices: hetpipe.partitioner.cost_context) ------------

@dataclass(frozen=True)
class CpShape:
    """What a CP rank's extra costs depend on: the whole sequence, the degree and
    the method, the analytic compute rate and the CP group's link."""
    seq_length: int
    cp: int
    method: str
    rate_flops: float  # dense peak x efficiency
    link_gbs: float
    latency_us: float


def context_unit_costs(rank: "UnitCosts", model: ModelConfig, b: int, tp: int, recompute: str,
                       element_bytes: int, shape: CpShape) -> "UnitCosts":
    """A CP rank's unit costs from ``rank``, the costs of its ``s / C`` tokens
    priced as a whole sequence: the layers add the attention their queries pay
    for the other ranks' keys, the K/V exchange (blocking) and its memory."""
    s, c = shape.seq_length, shape.cp
    layers = slice(1, model.num_layers + 1)
    extra = _missing_attention_s(model, b, s, c, tp, shape.rate_flops)
    reruns = {"full": 1.0, "selective": 1.0}.get(recompute, 0.0)
    fwd, bwd, comm = rank.forward_s.copy(), rank.backward_s.copy(), rank.tp_comm_s.copy()
    fwd[layers] += extra
    bwd[layers] += (2.0 + reruns) * extra
    exchange = cp_layer_cost(model, b, s, c, shape.method, 0.0, element_bytes, shape.link_gbs, shape.latency_us)
    comm[layers] += exchange.comm_s * (2.0 if recompute == "full" else 1.0) / tp
    act, transient = rank.activation_bytes.copy(), rank.transient_bytes.copy()
    kept, working = _exchange_bytes(model, b, s, c, tp, shape.method, element_bytes)
    act[layers] += kept if recompute != "full" else 0.0
    transient[layers] += working + (kept if recompute == "full" else 0.0)
    flops = rank.flops.copy()
    flops[layers] += 3.0 * extra * shape.rate_flops
    return replace(rank, forward_s=fwd, backward_s=bwd, tp_comm_s=comm, flops=flops,
                   activation_bytes=act, transient_bytes=transient)


def _missing_attention_s(model: ModelConfig, b: int, s: int, c: int, tp: int, rate: float) -> float:
    """Forward seconds of the attention a rank's ``s / C`` queries pay beyond
    a sequence of ``s / C`` tokens: its share of the whole is ``1 / C`` of
    ``4 b s^2 a d`` (load-balanced chunks), the short sequence's ``1 / C^2``."""
    whole = 4.0 * b * s * s * model.num_attention_heads * model.head_dim / tp
    return whole * (1.0 / c - 1.0 / (c * c)) / rate


def _exchange_bytes(model: ModelConfig, b: int, s: int, c: int, tp: int, method: str,
                    element_bytes: int) -> tuple[float, float]:
    """(kept for the backward, working) bytes per layer of the K/V exchange.

    allgather: SDPA keeps the gathered K and V of the whole sequence (the
    rank's own share is already in the layer's activations); while it runs
    the gathered copy and its reordering both exist, and the backward's K/V
    gradients of the whole sequence. ring: the fp32 output and log-sum-exp
    are kept; the fp32 blocks of scores, probabilities and their gradient
    (``b x heads x (s/C)^2`` each) are working memory."""
    whole_kv = kv_bytes(model, b, s, element_bytes) / tp
    if method == "allgather":
        return whole_kv * (c - 1) / c, 2.0 * whole_kv
    heads, local = model.num_attention_heads / tp, s / c
    return b * heads * local * (4.0 * model.head_dim + 4.0), 3.0 * 4.0 * b * heads * local * local
