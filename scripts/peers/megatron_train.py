#!/usr/bin/env python3
"""Megatron-Core's GPT training loop for the peer bench, one process per GPU under torchrun:
``torchrun --nproc-per-node N scripts/peers/megatron_train.py --args-file F --out DIR``.

The megatron-core 0.16.1 wheel has no ``megatron.training`` (Megatron-LM's
``pretrain_gpt.py`` loop lives in the Megatron-LM repository, not the wheel), so
this is that loop's minimum over megatron.core's public API, in its order:
model-parallel groups, GPTModel with the local (non-Transformer-Engine) layer
spec in bf16 (Float16Module), DistributedDataParallel with overlapped grad
reduce and param gather, the distributed optimizer (fp32 main weights),
GPTDataset over the .bin/.idx, and each step ``get_forward_backward_func()``
(no pipelining, or 1F1B with PP) then ``optimizer.step()``. The flags are
Megatron-LM's names, written by scripts/peers/megatron_config.py.

Each step, rank 0 writes one JSON line to DIR/metrics.jsonl: step, loss
(the last stage's, averaged over DP), step time, tokens/s and every rank's
peak allocated memory. GPU only.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import OrderedDict
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

# Its arguments file format sits beside this script (sys.path[0] when run as a script).
from megatron_config import parse  # noqa: E402

GIB = 2**30
SWITCHES = ("group-query-attention", "swiglu", "disable-bias-linear", "untie-embeddings-and-output-weights",
            "use-distributed-optimizer", "overlap-grad-reduce", "overlap-param-gather", "cross-entropy-loss-fusion",
            "bias-swiglu-fusion", "no-masked-softmax-fusion", "no-gradient-accumulation-fusion", "bf16")
VALUES = {"num-layers": int, "hidden-size": int, "ffn-hidden-size": int, "num-attention-heads": int,
          "num-query-groups": int, "kv-channels": int, "vocab-size": int, "max-position-embeddings": int,
          "position-embedding-type": str, "rotary-base": int, "normalization": str, "norm-epsilon": float,
          "attention-dropout": float, "hidden-dropout": float, "init-method-std": float,
          "tensor-model-parallel-size": int, "pipeline-model-parallel-size": int, "transformer-impl": str,
          "recompute-granularity": str, "seq-length": int, "micro-batch-size": int, "global-batch-size": int,
          "train-iters": int, "lr": float, "min-lr": float, "lr-warmup-iters": int, "lr-decay-style": str,
          "weight-decay": float, "adam-beta1": float, "adam-beta2": float, "adam-eps": float, "clip-grad": float,
          "tokenizer-type": str, "data-path": str, "split": str, "seed": int, "log-interval": int}


def megatron_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron_train")
    for name in SWITCHES:
        p.add_argument(f"--{name}", action="store_true")
    for name, kind in VALUES.items():
        p.add_argument(f"--{name}", type=kind, required=True)
    return p.parse_args(argv)


class PretokenizedData:
    """The two facts GPTDataset reads from a tokenizer (as Megatron-LM's NullTokenizer
    gives them): the vocabulary size and the end-of-document id."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.eod = vocab_size, vocab_size - 1

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(cls=type(self).__name__, vocab_size=self.vocab_size)


def transformer_config(a: argparse.Namespace) -> TransformerConfig:
    return TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
        num_attention_heads=a.num_attention_heads, num_query_groups=a.num_query_groups, kv_channels=a.kv_channels,
        normalization=a.normalization, layernorm_epsilon=a.norm_epsilon, gated_linear_unit=a.swiglu,
        activation_func=F.silu, add_bias_linear=not a.disable_bias_linear, attention_dropout=a.attention_dropout,
        hidden_dropout=a.hidden_dropout, init_method_std=a.init_method_std, bf16=a.bf16,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=a.tensor_model_parallel_size,
        pipeline_model_parallel_size=a.pipeline_model_parallel_size,
        recompute_granularity=a.recompute_granularity, bias_activation_fusion=a.bias_swiglu_fusion,
        masked_softmax_fusion=not a.no_masked_softmax_fusion,
        gradient_accumulation_fusion=not a.no_gradient_accumulation_fusion,
        cross_entropy_loss_fusion=a.cross_entropy_loss_fusion, cross_entropy_fusion_impl="native")


def build_model(a: argparse.Namespace, config: TransformerConfig) -> DistributedDataParallel:
    gpt = GPTModel(config, get_gpt_layer_local_spec(normalization=a.normalization), vocab_size=a.vocab_size,
                   max_sequence_length=a.max_position_embeddings,
                   pre_process=parallel_state.is_pipeline_first_stage(),
                   post_process=parallel_state.is_pipeline_last_stage(),
                   share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
                   position_embedding_type=a.position_embedding_type, rotary_base=a.rotary_base)
    gpt.cuda(torch.cuda.current_device())
    ddp = DistributedDataParallelConfig(overlap_grad_reduce=a.overlap_grad_reduce,
                                        overlap_param_gather=a.overlap_param_gather,
                                        use_distributed_optimizer=a.use_distributed_optimizer)
    return DistributedDataParallel(config, ddp, Float16Module(config, gpt))


def build_optimizer(a: argparse.Namespace, model: DistributedDataParallel):
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay, adam_beta1=a.adam_beta1,
        adam_beta2=a.adam_beta2, adam_eps=a.adam_eps, clip_grad=a.clip_grad, bf16=a.bf16,
        params_dtype=torch.bfloat16, use_distributed_optimizer=a.use_distributed_optimizer), [model])
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=a.lr, min_lr=a.min_lr, lr_warmup_steps=a.lr_warmup_iters,
        lr_decay_steps=max(a.train_iters, a.lr_warmup_iters + 1), lr_decay_style=a.lr_decay_style,
        start_wd=a.weight_decay, end_wd=a.weight_decay, wd_incr_steps=a.train_iters, wd_incr_style="constant")
    return opt, sched


def train_data(a: argparse.Namespace, cache: Path):
    config = GPTDatasetConfig(
        random_seed=a.seed, sequence_length=a.seq_length, blend=([a.data_path], None), split=a.split,
        tokenizer=PretokenizedData(a.vocab_size), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False, path_to_cache=str(cache))
    samples = a.train_iters * a.global_batch_size
    built = BlendedMegatronDatasetBuilder(GPTDataset, [samples, 0, 0], lambda: True, config).build()
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    loader = torch.utils.data.DataLoader(built[0], batch_size=a.micro_batch_size,
                                         sampler=DataParallelOrder(len(built[0]), a.micro_batch_size, rank, dp))
    return iter(loader)


class DataParallelOrder(torch.utils.data.Sampler):
    """Megatron's pretraining sampler: consecutive micro batches of the global order, this DP rank's share."""

    def __init__(self, total: int, micro: int, rank: int, dp: int):
        self.total, self.micro, self.rank, self.dp = total, micro, rank, dp

    def __iter__(self):
        step = self.micro * self.dp
        for start in range(0, self.total - step + 1, step):
            yield from range(start + self.rank * self.micro, start + (self.rank + 1) * self.micro)

    def __len__(self):
        return self.total // self.dp


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    averaged = loss.detach().clone()
    torch.distributed.all_reduce(averaged, group=parallel_state.get_data_parallel_group())
    return loss, {"lm loss": averaged / parallel_state.get_data_parallel_world_size()}


def forward_step(data_iterator, model):
    batch = {k: v.cuda(non_blocking=True) for k, v in next(data_iterator).items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def wire_overlap(config: TransformerConfig, model: DistributedDataParallel, optimizer) -> None:
    """What Megatron-LM's training loop sets on the config for overlapped communication."""
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads


def train_step(a, model, optimizer, sched, data, microbatches: int) -> float | None:
    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=[model], num_microbatches=microbatches,
        seq_length=a.seq_length, micro_batch_size=a.micro_batch_size, forward_only=False)
    optimizer.step()
    sched.step(increment=1)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return float(torch.stack([x["lm loss"] for x in losses]).mean())


def step_record(step: int, loss, seconds: float, a: argparse.Namespace) -> dict:
    """This step's loss (from the last stage) and every rank's peak memory, gathered to rank 0."""
    mine = [loss if loss is not None else float("nan"), torch.cuda.max_memory_allocated() / GIB]
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    last = [x[0] for x in gathered if x[0] == x[0]]
    return {"step": step, "loss": last[-1] if last else None, "step_time_s": seconds,
            "tokens_per_s": a.global_batch_size * a.seq_length / seconds,
            "peak_mem_gib": [x[1] for x in gathered]}


def main() -> None:
    p = argparse.ArgumentParser(prog="megatron_train")
    p.add_argument("--args-file", required=True)
    p.add_argument("--out", required=True)
    opts = p.parse_args()
    a = megatron_args(parse(Path(opts.args_file).read_text()))
    out = Path(opts.out)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl")
    parallel_state.initialize_model_parallel(a.tensor_model_parallel_size, a.pipeline_model_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(a.seed)
    config = transformer_config(a)
    model = build_model(a, config)
    optimizer, sched = build_optimizer(a, model)
    wire_overlap(config, model, optimizer)
    data = train_data(a, out / "megatron_cache")
    microbatches = a.global_batch_size // (a.micro_batch_size * parallel_state.get_data_parallel_world_size())
    for step in range(1, a.train_iters + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = train_step(a, model, optimizer, sched, data, microbatches)
        torch.cuda.synchronize()
        record = step_record(step, loss, time.perf_counter() - start, a)
        if torch.distributed.get_rank() == 0:
            print(json.dumps(record), flush=True)
            with (out / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
