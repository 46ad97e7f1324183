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

from dataclasses import dataclass

from hetpipe.models.families import spec_of
from hetpipe.models.model_config import ModelConfig


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
