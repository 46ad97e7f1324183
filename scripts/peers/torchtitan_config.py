"""torchtitan's job config (TOML) for one peer-bench run, and the model flavor it names.

torchtitan takes its model's shape from a named flavor of a registered train
spec, not from the TOML; scripts/peers/torchtitan_ext.py registers the spec
``hetpipe_llama3`` whose flavors are hetpipe's presets, built by
:func:`flavor_args` here, and whose dataset reads the Megatron .bin/.idx.
Each setting below carries, as a TOML comment, why it is torchtitan's best
documented choice (torchtitan 0.2.2: torchtitan/models/llama3/train_configs/llama3_8b.toml
and docs/performance.md of its repository). No torchtitan import: the CPU
tests parse the TOML back (tests/test_bench_peers.py).
"""
from __future__ import annotations

from typing import Any

from hetpipe.errors import ConfigError
from hetpipe.models.model_config import ModelConfig

from run_spec import RunSpec

SPEC_NAME = "hetpipe_llama3"
EXT_MODULE = "torchtitan_ext"  # scripts/peers/torchtitan_ext.py, on the run's PYTHONPATH
DATASET = "hetpipe_indexed"
# --peers name -> parallel layout. FSDP2 over all GPUs is torchtitan's LLaMA-3-8B
# recipe; the two PP layouts are its pipeline schedules, tried beside it.
LAYOUTS = {"torchtitan": "fsdp", "torchtitan_pp": "pp_interleaved", "torchtitan_zbv": "pp_zbv"}


def ffn_args(cfg: ModelConfig) -> tuple[None, int]:
    """(ffn_dim_multiplier, multiple_of) that make torchtitan's SwiGLU width
    (int(8 * dim / 3), times the multiplier, rounded up to multiple_of) equal ``ffn_hidden_size``."""
    base = int(8 * cfg.hidden_size / 3)
    if not 0 < base <= cfg.ffn_hidden_size:
        raise ConfigError(f"torchtitan cannot express ffn_hidden_size={cfg.ffn_hidden_size} for hidden "
                          f"{cfg.hidden_size} (its SwiGLU width starts at {base})")
    return None, cfg.ffn_hidden_size


def rope_scaling(cfg: ModelConfig) -> dict[str, float]:
    """torchtitan's llama3 always applies LLaMA-3.1's RoPE scaling; factor 1 is none."""
    if cfg.rope_scaling is None:
        return {"scaling_factor": 1.0}
    return {"scaling_factor": cfg.rope_scaling_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position_embeddings}


def flavor_args(cfg: ModelConfig) -> dict[str, Any]:
    """TransformerModelArgs' fields for ``cfg`` (a dense LLaMA: no QKV bias, untied, no QK-norm)."""
    if cfg.family != "llama" or cfg.add_qkv_bias or cfg.share_embeddings_and_output_weights:
        raise ConfigError(f"model {cfg.name!r}: the torchtitan peer runs untied LLaMA models only")
    multiplier, multiple_of = ffn_args(cfg)
    return {"dim": cfg.hidden_size, "n_layers": cfg.num_layers, "n_heads": cfg.num_attention_heads,
            "n_kv_heads": cfg.num_query_groups, "vocab_size": cfg.vocab_size, "ffn_dim_multiplier": multiplier,
            "multiple_of": multiple_of, "norm_eps": cfg.norm_epsilon, "rope_theta": cfg.rotary_base,
            "max_seq_len": cfg.max_position_embeddings}


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return repr(v)


def _parallelism(spec: RunSpec, layout: str) -> list[tuple[str, Any, str]]:
    if layout == "fsdp":
        return [("data_parallel_shard_degree", spec.gpus, "FSDP2 over every GPU: the llama3_8b.toml recipe "
                 "(data_parallel_shard_degree = -1); on one host PP only adds bubbles"),
                ("pipeline_parallel_degree", 1, "")]
    schedule = {"pp_interleaved": "Interleaved1F1B", "pp_zbv": "ZBVZeroBubble"}[layout]
    return [("data_parallel_shard_degree", 1, "all GPUs in the pipeline"),
            ("pipeline_parallel_degree", spec.gpus, "PP over every GPU, two stages per rank"),
            ("pipeline_parallel_schedule", schedule, "docs/performance.md: the looped schedules "
             "(Interleaved1F1B) and zero bubble (ZBVZeroBubble) are torchtitan's fastest PP"),
            ("pipeline_parallel_microbatch_size", spec.micro_batch_size, "hetpipe's micro batch")]


def _batch(spec: RunSpec, layout: str) -> list[tuple[str, Any, str]]:
    # FSDP: local batch = micro batch, gradient accumulation up to the global batch;
    # PP: the local batch is the global batch, cut into micro batches by the schedule.
    local = spec.micro_batch_size if layout == "fsdp" else spec.global_batch_size
    return [("local_batch_size", local, "per DP rank per forward (PP: split into micro batches)"),
            ("global_batch_size", spec.global_batch_size, "hetpipe's global batch"),
            ("seq_len", spec.seq_length, ""), ("steps", spec.steps, ""),
            ("max_norm", spec.optimizer().clip_grad, "hetpipe's clip_grad"),
            ("dataset", DATASET, "the Megatron .bin/.idx, registered by torchtitan_ext"),
            ("dataset_path", spec.data, ""),
            ("mixed_precision_param", "bfloat16", "bf16 compute over fp32 main weights (FSDP2 "
             "MixedPrecisionPolicy); gradients reduced in fp32"),
            ("mixed_precision_reduce", "float32", "")]


def sections(spec: RunSpec, layout: str = "fsdp") -> list[tuple[str, list[tuple[str, Any, str]]]]:
    """The TOML's sections as (name, [(key, value, why)])."""
    opt = spec.optimizer()
    compiled = layout != "pp_zbv"  # torch's input/weight backward split refuses compiled stages
    out = [
        ("job", [("description", f"hetpipe peer bench: {spec.model} seq {spec.seq_length}", ""),
                 ("dump_folder", "OUT", "replaced with the run's directory")]),
        ("metrics", [("log_freq", 1, "one line per step: the bench reads tps, memory and loss from it"),
                     ("disable_color_printing", True, "plain lines to parse")]),
        ("model", [("name", SPEC_NAME, "torchtitan's llama3 spec with hetpipe's flavors and dataset"),
                   ("flavor", spec.model, "the hetpipe preset's shape (torchtitan_ext.flavor_args)"),
                   *([("converters", ["float8"], "torchao float8 linears: torchtitan's fp8 training")]
                     if spec.precision == "fp8" else [])]),
        ("optimizer", [("name", "AdamW", ""), ("lr", opt.lr, ""), ("eps", opt.adam_eps, ""),
                       ("weight_decay", opt.weight_decay, ""), ("implementation", "fused", "fastest AdamW")]),
        ("lr_scheduler", [("warmup_steps", opt.lr_warmup_iters, "hetpipe's warmup (the bench's schedule)")]),
        ("training", _batch(spec, layout)),
        ("parallelism", _parallelism(spec, layout)),
        ("activation_checkpoint", [("mode", "selective", "llama3_8b.toml: selective AC by op, which keeps "
                                    "an 8B model's activations in memory at seq 8192"),
                                   ("selective_ac_option", "op", "")]),
        ("compile", [("enable", compiled, "docs/performance.md: compile on (ZBV: torch's split backward "
                      "refuses compiled stages)"), ("components", ["model", "loss"], "")]),
        ("checkpoint", [("enable", False, "no checkpoints in a throughput run")]),
        ("debug", [("seed", spec.seed, "")]),
        ("experimental", [("custom_import", EXT_MODULE, "registers the spec, its flavors and dataset")]),
    ]
    if spec.precision == "fp8":
        out.append(("quantize.linear.float8", [("filter_fqns", ["output"], "llama3_8b.toml: the output "
                                                "projection stays bf16"),
                                               ("enable_fsdp_float8_all_gather", layout == "fsdp", ""),
                                               ("precompute_float8_dynamic_scale_for_fsdp", layout == "fsdp", "")]))
    return out


def render(spec: RunSpec, layout: str = "fsdp", dump_folder: str = "OUT") -> str:
    """The job config TOML, each setting with the reason for it."""
    lines = [f"# torchtitan job config generated by scripts/peers/torchtitan_config.py: model {spec.model}, "
             f"seq {spec.seq_length}, global batch {spec.global_batch_size}, micro batch {spec.micro_batch_size}, "
             f"{spec.gpus} GPUs, layout {layout}, {spec.precision}."]
    for name, items in sections(spec, layout):
        lines.append(f"\n[{name}]")
        for key, value, why in items:
            value = dump_folder if key == "dump_folder" else value
            lines.append(f"{key} = {_value(value)}" + (f"  # {why}" if why else ""))
    return "\n".join(lines) + "\n"
