"""What one model family is, in one record: the :class:`FamilySpec`.

A family (``model.family``) is the shape of a decoder's layer beyond the
numbers of :class:`~hetpipe.models.model_config.ModelConfig`: which optional
parts it has (q/k/v biases, a norm on each query and key head), what its
released configs default to, and how Hugging Face names it. Everyone who
needs a family's facts reads them from its spec, never from the family's
name: the layers (:mod:`hetpipe.models.layers`), the parameter, FLOP and
activation arithmetic (:mod:`hetpipe.models.families.dense`, read by
``ModelConfig.num_parameters``, :mod:`hetpipe.models.flops` and the
partitioner's cost model), the TP plan (:mod:`hetpipe.models.parallelize`)
and the HF converter (:mod:`hetpipe.models.families.hf_mapping`).

The idea is torchtitan's (``torchtitan/models/<name>/``: model args, the
FLOP and parameter count, the parallelize plan and a state-dict adapter per
model, found through a registry); hetpipe's dense families share one decoder
implementation, so a spec states features and names instead of holding a
model of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from hetpipe.errors import ConfigError
import hetpipe.models.families.dense as dense

if TYPE_CHECKING:
    from hetpipe.models.model_config import ModelConfig

# add_qkv_bias under a family: any value, required for its HF export, or refused.
QKV_BIAS_RULES = ("optional", "hf_requires", "never")


class ElementSizes(Protocol):
    """What the activation arithmetic needs of a precision mode (the
    partitioner's ``Precision`` is one; models/ does not import it)."""
    matmul_bytes: int
    residual_bytes: int
    fused_elementwise: bool
    fused_linear_grads: bool


@dataclass(frozen=True)
class HFNames:
    """How transformers knows the family: config.json's ``model_type`` and
    ``architectures[0]``, and the config class ``to_hf_config`` builds."""
    model_type: str
    architecture: str
    config_class: str


@dataclass(frozen=True)
class TPPlan:
    """What the family adds to the dense decoder's Megatron split
    (:mod:`hetpipe.models.parallelize`): modules of the attention that stay
    whole on every TP rank although each rank runs them on its own heads
    only, so their weight gradients are partial and summed over the group."""
    per_head_norms: tuple[str, ...] = ()


@dataclass(frozen=True)
class FamilySpec:
    name: str
    # One line for docs and errors.
    description: str
    hf: HFNames
    qkv_bias: str = "optional"
    # RMSNorm over head_dim on every query and key head, before RoPE (Qwen3).
    qk_norm: bool = False
    # ModelConfig fields of the family's released models (ModelConfig.of_family).
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    tp: TPPlan = TPPlan()
    # Extra keyword arguments of the HF config class, and a check of an HF
    # config for features hetpipe does not implement (raises ConfigError).
    hf_config_extra: Callable[["ModelConfig"], dict] = lambda cfg: {}
    hf_config_check: Callable[[Any], None] = lambda hf_config: None
    # Per-layer tensors beyond the dense decoder's (models/hf.py's table),
    # one to one: (our name under layers.<i>., HF's under model.layers.<i>.).
    hf_layer_keys: tuple[tuple[str, str], ...] = ()
    # HF's attention_bias puts a bias on o_proj as well as on q/k/v (Llama);
    # hetpipe's output projection has none, so with q/k/v biases an export
    # writes zero o_proj biases (exactly our function, and nothing for
    # transformers to initialise) and an import accepts only zero ones.
    hf_out_bias_with_qkv: bool = False

    def __post_init__(self) -> None:
        if self.qkv_bias not in QKV_BIAS_RULES:
            raise ValueError(f"family {self.name}: qkv_bias={self.qkv_bias!r} is not one of {QKV_BIAS_RULES}")
        if self.qk_norm and not self.tp.per_head_norms:
            raise ValueError(f"family {self.name}: a QK-norm family must name its per-head norms in its TP plan")

    def check_config(self, cfg: "ModelConfig") -> None:
        """Refuse a ModelConfig field this family cannot have."""
        if self.qkv_bias == "never" and cfg.add_qkv_bias:
            raise ConfigError(f"model.add_qkv_bias=true is not part of model.family={self.name} "
                              f"({self.description})")

    def layer_shape_fields(self) -> dict[str, Any]:
        """What besides the numbers changes a layer's measured cost (a profile
        entry's shape): the optional parts only, so the entries measured for
        llama and qwen2 before families had specs still match."""
        return {"qk_norm": True} if self.qk_norm else {}

    # -- arithmetic (hetpipe.models.families.dense; a family of another layer
    # shape would bring its own module) ------------------------------------

    def layer_params(self, cfg: "ModelConfig") -> tuple[int, int]:
        return dense.layer_params(self, cfg)

    def num_parameters(self, cfg: "ModelConfig") -> int:
        return dense.num_parameters(self, cfg)

    def model_flops(self, cfg: "ModelConfig", batch_size: int, seq_length: int) -> float:
        return dense.model_flops(self, cfg, batch_size, seq_length)

    def layer_forward_flops(self, cfg: "ModelConfig", b: int, s: int) -> float:
        return dense.layer_forward_flops(self, cfg, b, s)

    def head_forward_flops(self, cfg: "ModelConfig", b: int, s: int) -> float:
        return dense.head_forward_flops(self, cfg, b, s)

    def layer_activation_bytes(self, cfg: "ModelConfig", b: int, s: int, tp: int, prec: ElementSizes) -> float:
        return dense.layer_activation_bytes(self, cfg, b, s, tp, prec)

    def head_activation_bytes(self, cfg: "ModelConfig", b: int, s: int, tp: int,
                              prec: ElementSizes) -> tuple[float, float]:
        return dense.head_activation_bytes(self, cfg, b, s, tp, prec)

    def layer_weight_pass_bytes(self, cfg: "ModelConfig", b: int, s: int, tp: int,
                                prec: ElementSizes) -> tuple[float, float, float]:
        return dense.layer_weight_pass_bytes(self, cfg, b, s, tp, prec)
