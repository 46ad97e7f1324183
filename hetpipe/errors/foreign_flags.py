"""Megatron-LM's and torchtitan's flags, answered with hetpipe's overrides.

A user coming from either types their flags first (``--tensor-model-parallel-size 2``);
hydra would answer with its argparse usage and "unrecognized arguments". The
entry points (hetpipe.errors.run_hydra_cli) read the command line before hydra
does and answer every such flag in one line with the override that does the
same, or say what hetpipe lacks. :data:`FLAGS` is the one place the mapping
lives: docs/coming_from_megatron.md holds :func:`markdown_table` (a test keeps
the two equal).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from hetpipe.errors.suggest import did_you_mean

DOC = "docs/coming_from_megatron.md"
# Hydra's own flags (hydra/_internal/utils.py's parser) and those that take a value.
HYDRA_FLAGS = ("--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--resolve", "--package", "-p",
               "--run", "-r", "--multirun", "-m", "--shell-completion", "-sc", "--config-path", "-cp",
               "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun", "--info", "-i")
HYDRA_VALUED = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                "--config-dir", "-cd", "--experimental-rerun", "--info", "-i")
VALUE = "X"


@dataclass(frozen=True)
class Flag:
    flag: str
    source: str  # "Megatron-LM" or "torchtitan"
    # The override(s), "X" standing for the flag's value; "" where hetpipe has none.
    override: str
    # Takes a value (--lr 1e-3) or is a switch (--bf16).
    valued: bool = True
    # What the user should know beyond the override (shown after it).
    note: str = ""

    def answer(self, value: Optional[str]) -> str:
        """``--flag value`` is ``override``, with the value filled in."""
        typed = f"{self.flag} {value}" if value is not None else self.flag
        if not self.override:
            return f"{typed}: {self.note}"
        override = self.override.replace(VALUE, value) if value is not None else self.override
        return f"{typed} is {override}" + (f" ({self.note})" if self.note else "")


_M, _T = "Megatron-LM", "torchtitan"
_PP_NOTE = "pipeline stages = the cluster's ranks / (TP x DP); or a cluster preset, or plan=auto"
FLAGS: tuple[Flag, ...] = (
    Flag("--pipeline-model-parallel-size", _M, "cluster.groups.0.ranks_per_node=X", note=_PP_NOTE),
    Flag("--tensor-model-parallel-size", _M, "partition.tp=X"),
    Flag("--context-parallel-size", _M, "", note="hetpipe has no context parallelism yet"),
    Flag("--expert-model-parallel-size", _M, "", note="hetpipe trains dense models only (no MoE)"),
    Flag("--sequence-parallel", _M, "partition.sequence_parallel=true", valued=False),
    Flag("--use-distributed-optimizer", _M, "optimizer.distributed=true", valued=False),
    Flag("--num-virtual-stages-per-pipeline-rank", _M, "partition.schedule=interleaved_1f1b partition.num_chunks=X"),
    Flag("--micro-batch-size", _M, "train.micro_batch_size=X"),
    Flag("--global-batch-size", _M, "train.global_batch_size=X"),
    Flag("--seq-length", _M, "train.seq_length=X"),
    Flag("--train-iters", _M, "train.train_iters=X"),
    Flag("--seed", _M, "train.seed=X"),
    Flag("--bf16", _M, "train.precision=bf16", valued=False),
    Flag("--fp16", _M, "", valued=False, note="hetpipe has no fp16 mode: train.precision=bf16"),
    Flag("--no-gradient-accumulation-fusion", _M, "train.grad_accumulation_fusion=false", valued=False),
    Flag("--recompute-granularity", _M, "train.recompute=X"),
    Flag("--recompute-num-layers", _M, "train.recompute_num_layers=X"),
    Flag("--deterministic-mode", _M, "train.deterministic=true", valued=False),
    Flag("--log-interval", _M, "train.log_interval=X"),
    Flag("--eval-interval", _M, "train.eval_interval=X"),
    Flag("--eval-iters", _M, "train.eval_iters=X"),
    Flag("--num-layers", _M, "model.num_layers=X", note="after +model=NAME"),
    Flag("--hidden-size", _M, "model.hidden_size=X", note="after +model=NAME"),
    Flag("--ffn-hidden-size", _M, "model.ffn_hidden_size=X", note="after +model=NAME"),
    Flag("--num-attention-heads", _M, "model.num_attention_heads=X", note="after +model=NAME"),
    Flag("--num-query-groups", _M, "model.num_query_groups=X", note="after +model=NAME"),
    Flag("--max-position-embeddings", _M, "model.max_position_embeddings=X", note="after +model=NAME"),
    Flag("--rotary-base", _M, "model.rotary_base=X", note="after +model=NAME"),
    Flag("--norm-epsilon", _M, "model.norm_epsilon=X", note="after +model=NAME"),
    Flag("--untie-embeddings-and-output-weights", _M, "model.share_embeddings_and_output_weights=false",
         valued=False),
    Flag("--lr", _M, "optimizer.lr=X"),
    Flag("--min-lr", _M, "optimizer.min_lr=X"),
    Flag("--lr-warmup-iters", _M, "optimizer.lr_warmup_iters=X"),
    Flag("--lr-warmup-init", _M, "optimizer.lr_warmup_init=X"),
    Flag("--lr-decay-iters", _M, "optimizer.lr_decay_iters=X"),
    Flag("--lr-decay-style", _M, "optimizer.lr_decay_style=X"),
    Flag("--weight-decay", _M, "optimizer.weight_decay=X"),
    Flag("--clip-grad", _M, "optimizer.clip_grad=X"),
    Flag("--adam-beta1", _M, "optimizer.adam_beta1=X"),
    Flag("--adam-beta2", _M, "optimizer.adam_beta2=X"),
    Flag("--adam-eps", _M, "optimizer.adam_eps=X"),
    Flag("--data-path", _M, "data=megatron data.path=X", note="a blend in quotes: data.path='0.7 a 0.3 b'"),
    Flag("--split", _M, "data.split=\"'X'\""),
    Flag("--valid-data-path", _M, "data.valid_path=X"),
    Flag("--tokenizer-model", _M, "data.tokenizer=X", note="a local Hugging Face tokenizer directory"),
    Flag("--eod-mask-loss", _M, "data.eod_mask_loss=true", valued=False),
    Flag("--save", _M, "checkpoint.save_dir=X"),
    Flag("--save-interval", _M, "checkpoint.save_interval=X"),
    Flag("--load", _M, "checkpoint.resume=X", note="the save directory's newest checkpoint"),
    Flag("--override-opt_param-scheduler", _M, "checkpoint.schedule=config", valued=False),
    Flag("--use-checkpoint-opt_param-scheduler", _M, "checkpoint.schedule=checkpoint", valued=False),
    Flag("--tensorboard-dir", _M, "logging.tensorboard=true", note="written under the run directory"),
    Flag("--wandb-project", _M, "logging.wandb=true logging.wandb_project=X"),
    Flag("--parallelism.pipeline_parallel_degree", _T, "cluster.groups.0.ranks_per_node=X", note=_PP_NOTE),
    Flag("--parallelism.tensor_parallel_degree", _T, "partition.tp=X"),
    Flag("--parallelism.data_parallel_replicate_degree", _T, "partition.dp=X"),
    Flag("--parallelism.data_parallel_shard_degree", _T, "partition.dp=X optimizer.distributed=true",
         note="ZeRO-1: AdamW's state sharded, not the parameters (no FSDP)"),
    Flag("--parallelism.context_parallel_degree", _T, "", note="hetpipe has no context parallelism yet"),
    Flag("--parallelism.pipeline_parallel_schedule", _T, "partition.schedule=X",
         note="gpipe, 1f1b, interleaved_1f1b, zb_h1 or zb_v"),
    Flag("--parallelism.pipeline_parallel_microbatch_size", _T, "train.micro_batch_size=X"),
    Flag("--training.steps", _T, "train.train_iters=X"),
    Flag("--training.local_batch_size", _T, "train.global_batch_size=X",
         note="times the DP degree: hetpipe's batch is global"),
    Flag("--training.global_batch_size", _T, "train.global_batch_size=X"),
    Flag("--training.seq_len", _T, "train.seq_length=X"),
    Flag("--training.max_norm", _T, "optimizer.clip_grad=X"),
    Flag("--training.seed", _T, "train.seed=X"),
    Flag("--debug.seed", _T, "train.seed=X"),
    Flag("--training.dataset_path", _T, "data=megatron data.path=X", note="a Megatron .bin/.idx prefix"),
    Flag("--training.mixed_precision_param", _T, "train.precision=bf16", note="bfloat16 is hetpipe's bf16"),
    Flag("--training.compile", _T, "train.compile=true", valued=False),
    Flag("--compile.enable", _T, "train.compile=true", valued=False),
    Flag("--optimizer.lr", _T, "optimizer.lr=X"),
    Flag("--optimizer.eps", _T, "optimizer.adam_eps=X"),
    Flag("--optimizer.weight_decay", _T, "optimizer.weight_decay=X"),
    Flag("--lr_scheduler.warmup_steps", _T, "optimizer.lr_warmup_iters=X"),
    Flag("--lr_scheduler.decay_type", _T, "optimizer.lr_decay_style=X", note="cosine, linear or constant"),
    Flag("--lr_scheduler.min_lr_factor", _T, "optimizer.min_lr=<X x optimizer.lr>"),
    Flag("--activation_checkpoint.mode", _T, "train.recompute=X"),
    Flag("--checkpoint.folder", _T, "checkpoint.save_dir=X"),
    Flag("--checkpoint.interval", _T, "checkpoint.save_interval=X"),
    Flag("--metrics.log_freq", _T, "train.log_interval=X"),
    Flag("--metrics.enable_tensorboard", _T, "logging.tensorboard=true", valued=False),
    Flag("--metrics.enable_wandb", _T, "logging.wandb=true", valued=False),
    Flag("--model.name", _T, "+model=NAME", note="a preset of configs/model/, e.g. llama8b"),
    Flag("--model.flavor", _T, "+model=NAME", note="a preset of configs/model/, e.g. llama8b"),
    Flag("--model.tokenizer_path", _T, "data.tokenizer=X"),
    Flag("--model.hf_assets_path", _T, "data.tokenizer=X"),
    Flag("--job.config_file", _T, "", note="hetpipe composes +model=NAME cluster=NAME with key=value overrides"),
)
BY_FLAG = {f.flag: f for f in FLAGS}


def _split(arg: str) -> tuple[str, Optional[str]]:
    flag, eq, value = arg.partition("=")
    return flag, (value if eq else None)


def _unknown_flags(argv: Sequence[str]) -> list[tuple[str, Optional[str]]]:
    """(flag, its value or None) for every dashed argument that is not hydra's."""
    found, i = [], 0
    while i < len(argv):
        flag, value = _split(argv[i])
        i += 1
        if not flag.startswith("-") or flag in HYDRA_FLAGS:
            i += flag in HYDRA_VALUED and value is None and i < len(argv) and not argv[i].startswith("-")
            continue
        entry = BY_FLAG.get(flag)
        if value is None and entry is not None and entry.valued and i < len(argv) and not argv[i].startswith("-"):
            value, i = argv[i], i + 1
        found.append((flag, value))
    return found


def foreign_flags_line(argv: Sequence[str]) -> Optional[str]:
    """One line answering every flag hydra would not take, or None when there is none."""
    flags = _unknown_flags(argv)
    if not flags:
        return None
    known = [BY_FLAG[f].answer(v) for f, v in flags if f in BY_FLAG]
    unknown = [f for f, _ in flags if f not in BY_FLAG]
    if unknown:
        names = [*BY_FLAG, *(f for f in HYDRA_FLAGS if f.startswith("--"))]
        # Compared without their dashes, which every flag shares.
        hint = did_you_mean(unknown[0].lstrip("-"), [n.lstrip("-") for n in names], "--{}")
        return (f"unknown flag {unknown[0]}{hint}: hetpipe takes hydra overrides, key=value "
                f"(--help lists them; {DOC} translates Megatron-LM's and torchtitan's flags)")
    sources = " and ".join(dict.fromkeys(BY_FLAG[f].source for f, _ in flags))
    return f"hetpipe takes hydra overrides, not {sources} flags: {'; '.join(known)} ({DOC})"


def markdown_table() -> str:
    """:data:`FLAGS` as the table in docs/coming_from_megatron.md."""
    rows = ["| flag | from | hetpipe | note |", "| --- | --- | --- | --- |"]
    for f in FLAGS:
        typed = f"`{f.flag} X`" if f.valued else f"`{f.flag}`"
        override = f"`{f.override}`" if f.override else "-"
        rows.append(f"| {typed} | {f.source} | {override} | {f.note} |")
    return "\n".join(rows)
