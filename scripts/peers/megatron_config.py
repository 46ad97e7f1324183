"""Megatron-Core's arguments for one peer-bench run, as Megatron-LM's
``pretrain_gpt.py`` flags, one per line with why it is Megatron's best choice.

The megatron-core 0.16.1 wheel ships no ``megatron.training`` (no
``pretrain_gpt.py`` loop), so scripts/peers/megatron_train.py reads these
flags and runs a minimal loop over megatron.core's public API (GPTModel with
the local spec, DDP, the distributed optimizer, get_forward_backward_func,
GPTDataset). The flags are Megatron-LM's own names, so the same file reads as
a Megatron-LM command line. Sources: Megatron-LM's examples/llama
(train_llama3_8b_*.sh: TP1 PP1 over all GPUs with the distributed optimizer,
--overlap-grad-reduce, --overlap-param-gather) and docs/source/user-guide
(performance flags). Without Transformer Engine there is no fused or flash
attention: the local spec's attention materialises the scores, so selective
recomputation of core attention is on. No megatron import here.
"""
from __future__ import annotations

import shlex

from run_spec import RunSpec

# --peers name -> layout: the recipe's data parallelism, or a pipeline over every GPU
# (where the data-parallel replicas' unsharded bf16 weights and gradients do not fit).
LAYOUTS = {"megatron": "dp", "megatron_pp": "pp"}


def _model(spec: RunSpec) -> list[tuple[str, object, str]]:
    cfg = spec.model_config()
    why = f"hetpipe's configs/model/{spec.model}.yaml"
    return [("--num-layers", cfg.num_layers, why), ("--hidden-size", cfg.hidden_size, ""),
            ("--ffn-hidden-size", cfg.ffn_hidden_size, ""), ("--num-attention-heads", cfg.num_attention_heads, ""),
            ("--group-query-attention", None, ""), ("--num-query-groups", cfg.num_query_groups, ""),
            ("--kv-channels", cfg.head_dim, ""), ("--vocab-size", cfg.vocab_size, "NullTokenizer: pre-tokenised data"),
            ("--max-position-embeddings", cfg.max_position_embeddings, ""),
            ("--position-embedding-type", "rope", ""), ("--rotary-base", int(cfg.rotary_base), ""),
            ("--normalization", "RMSNorm", ""), ("--norm-epsilon", cfg.norm_epsilon, ""),
            ("--swiglu", None, ""), ("--disable-bias-linear", None, ""),
            ("--untie-embeddings-and-output-weights", None, ""),
            ("--attention-dropout", 0.0, "LLaMA trains without dropout"), ("--hidden-dropout", 0.0, ""),
            ("--init-method-std", cfg.init_method_std, "")]


def _parallel(spec: RunSpec, layout: str) -> list[tuple[str, object, str]]:
    pp = spec.gpus if layout == "pp" else 1
    return [("--tensor-model-parallel-size", 1, "examples/llama: TP1 for 8B on H100/H200"),
            ("--pipeline-model-parallel-size", pp, "dp: the recipe's PP1; pp: 1F1B over every GPU"),
            ("--use-distributed-optimizer", None, "shards fp32 main weights and Adam state over DP"),
            ("--overlap-grad-reduce", None, "gradient reduce-scatter under the backward"),
            ("--overlap-param-gather", None, "parameter all-gather under the next forward")]


def _fusions() -> list[tuple[str, object, str]]:
    return [("--transformer-impl", "local", "Transformer Engine's torch extension is a source package: "
             "not installed, so the local (non-TE) spec"),
            ("--recompute-granularity", "selective", "recompute core attention: the local spec's unfused "
             "attention keeps [heads, s, s] scores otherwise"),
            ("--cross-entropy-loss-fusion", None, "Megatron's fused cross-entropy (native implementation)"),
            ("--bias-swiglu-fusion", None, "its jit-fused SwiGLU"),
            ("--no-masked-softmax-fusion", None, "the fused softmax kernels come with apex/TE: not here"),
            ("--no-gradient-accumulation-fusion", None, "needs apex's fused_weight_gradient_mlp_cuda: not here"),
            ("--bf16", None, "bf16 compute and weights, fp32 main weights in the optimizer")]


def _training(spec: RunSpec) -> list[tuple[str, object, str]]:
    opt = spec.optimizer()
    return [("--seq-length", spec.seq_length, ""), ("--micro-batch-size", spec.micro_batch_size, ""),
            ("--global-batch-size", spec.global_batch_size, ""), ("--train-iters", spec.steps, ""),
            ("--lr", opt.lr, "hetpipe's optimizer defaults"), ("--min-lr", opt.min_lr, ""),
            ("--lr-warmup-iters", opt.lr_warmup_iters, ""), ("--lr-decay-style", opt.lr_decay_style, ""),
            ("--weight-decay", opt.weight_decay, ""), ("--adam-beta1", opt.adam_beta1, ""),
            ("--adam-beta2", opt.adam_beta2, ""), ("--adam-eps", opt.adam_eps, ""),
            ("--clip-grad", opt.clip_grad, ""), ("--tokenizer-type", "NullTokenizer", ""),
            ("--data-path", spec.data, "the same .bin/.idx as hetpipe"), ("--split", "100,0,0", ""),
            ("--seed", spec.seed, ""), ("--log-interval", 1, "")]


def flags(spec: RunSpec, layout: str = "dp") -> list[tuple[str, object, str]]:
    """(flag, value or None for a switch, why) in command-line order."""
    return [*_model(spec), *_parallel(spec, layout), *_fusions(), *_training(spec)]


def render(spec: RunSpec, layout: str = "dp") -> str:
    """The arguments file: one flag per line, its reason after '#'."""
    lines = [f"# Megatron-Core arguments generated by scripts/peers/megatron_config.py: model {spec.model}, "
             f"seq {spec.seq_length}, global batch {spec.global_batch_size}, micro batch {spec.micro_batch_size}, "
             f"{spec.gpus} GPUs, layout {layout}, {spec.precision}."]
    for flag, value, why in flags(spec, layout):
        text = flag if value is None else f"{flag} {shlex.quote(str(value))}"
        lines.append(f"{text}  # {why}" if why else text)
    return "\n".join(lines) + "\n"


def parse(text: str) -> list[str]:
    """An arguments file back to argv (comments dropped)."""
    return [word for line in text.splitlines() for word in shlex.split(line, comments=True)]
