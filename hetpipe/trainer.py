"""The training step loop: data, forward/backward with accumulation, clipping,
AdamW with warmup + cosine decay, metrics.

One optimizer step consumes one global batch, split into microbatches whose
gradients accumulate (each microbatch loss is scaled by 1/num_microbatches, so
the step's gradient is that of the mean loss over the global batch, Megatron's
convention). GPUs run bf16 autocast over fp32 master weights; CPUs run fp32.
"""
from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from hetpipe.comm.vendor import accelerator_name
from hetpipe.config import OptimizerConfig, PretrainConfig
from hetpipe.data import MicrobatchLoader
from hetpipe.errors import ConfigError
from hetpipe.metrics import MetricsLogger
from hetpipe.models import build_model
from hetpipe.models.flops import megatron_model_flops
from hetpipe.partitioner.catalog import detect_device_type, device_spec


def lr_at(step: int, opt: OptimizerConfig, train_iters: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then decay."""
    warmup = opt.lr_warmup_iters
    if step < warmup:
        return opt.lr * (step + 1) / warmup
    if opt.lr_decay_style == "constant":
        return opt.lr
    decay_iters = opt.lr_decay_iters or train_iters
    if step >= decay_iters:
        return opt.min_lr
    ratio = (step - warmup) / max(1, decay_iters - warmup)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if opt.lr_decay_style == "cosine" else 1.0 - ratio
    return opt.min_lr + coeff * (opt.lr - opt.min_lr)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no GPU is visible to torch")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def build_optimizer(model: torch.nn.Module, opt: OptimizerConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; matrices get weight decay, norms and biases do not (as in Megatron)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": opt.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    kwargs = dict(lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps)
    # The fused kernel is one launch per step instead of several per tensor.
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, fused=fused, **kwargs)


def peak_tflops(cfg: PretrainConfig, device: torch.device) -> float | None:
    """Dense peak for MFU: the override, else the catalog's for a known GPU."""
    if cfg.train.peak_tflops is not None:
        return cfg.train.peak_tflops
    if device.type == "cpu":
        return None  # no meaningful tensor-core peak
    kind = detect_device_type(accelerator_name())
    return device_spec(kind).peak_bf16_tflops if kind else None


def train(cfg: PretrainConfig, run_dir: Path) -> list[float]:
    """Pretrain ``cfg.model`` for ``cfg.train.train_iters`` steps; returns the step losses."""
    t = cfg.train
    device = resolve_device(t.device)
    bf16 = t.precision == "bf16" or (t.precision == "auto" and device.type == "cuda")
    seed_everything(t.seed)
    loader = MicrobatchLoader(cfg.data.path, cfg.data.tokenizer, seq_length=t.seq_length,
                              global_batch_size=t.global_batch_size,
                              micro_batch_size=t.micro_batch_size,
                              vocab_size=cfg.model.vocab_size, seed=t.seed)
    model = build_model(cfg.model, seed=t.seed, device=device)
    optimizer = build_optimizer(model, cfg.optimizer, device)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    clip = cfg.optimizer.clip_grad or math.inf

    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    (run_dir / "config.yaml").write_text(resolved)
    logger = MetricsLogger(
        run_dir=run_dir, total_steps=t.train_iters, tokens_per_step=loader.tokens_per_step,
        flops_per_step=megatron_model_flops(cfg.model, t.global_batch_size, t.seq_length),
        num_devices=1, peak_tflops=peak_tflops(cfg, device), log_interval=t.log_interval,
        progress=cfg.logging.progress,
        wandb_project=cfg.logging.wandb_project if cfg.logging.wandb else None,
        wandb_config=OmegaConf.to_container(OmegaConf.create(resolved)))
    print(f"hetpipe: {cfg.model.name} ({cfg.model.num_parameters() / 1e6:.1f}M parameters) on "
          f"{accelerator_name()}, {'bf16' if bf16 else 'fp32'}, {loader.num_microbatches} "
          f"microbatches/step, {loader.tokens_per_step} tokens/step, run dir {run_dir}", flush=True)

    losses = []
    try:
        for step in range(t.train_iters):
            lr = lr_at(step, cfg.optimizer, t.train_iters)
            for group in optimizer.param_groups:
                group["lr"] = lr
            microbatches = loader.next_step()
            total = torch.zeros((), device=device)
            for tokens, labels in microbatches:
                tokens = tokens.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = model(tokens, labels)
                (loss / len(microbatches)).backward()
                total += loss.detach()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mean_loss = total / len(microbatches)
            losses.append(mean_loss)
            logger.record(step + 1, mean_loss, grad_norm, lr, loader.state_dict()["consumed_samples"])
    finally:
        logger.close()
    return [float(x) for x in losses]
