"""LLaMA-2/3 (``LlamaForCausalLM``): the plain dense decoder; q/k/v biases
optional (HF's attention_bias, which biases o_proj too: only zero o_proj
biases import, see FamilySpec.hf_out_bias_with_qkv), head size free (HF's
head_dim)."""
from hetpipe.models.families.spec import FamilySpec, HFNames


def _hf_extra(cfg) -> dict:
    return dict(head_dim=cfg.head_dim, attention_bias=cfg.add_qkv_bias, mlp_bias=False)


SPEC = FamilySpec(
    name="llama",
    description="LLaMA-2/3: RMSNorm, RoPE, GQA, SwiGLU",
    hf=HFNames(model_type="llama", architecture="LlamaForCausalLM", config_class="LlamaConfig"),
    qkv_bias="optional",
    # Meta-Llama-3-8B's config.json (configs/model/llama8b.yaml is the whole preset).
    config_defaults={"rotary_base": 500000.0, "norm_epsilon": 1e-5, "add_qkv_bias": False},
    hf_config_extra=_hf_extra,
    hf_out_bias_with_qkv=True,
)
