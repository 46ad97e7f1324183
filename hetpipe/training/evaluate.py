"""Validation: the loss on held-out data, forward only, through the training pipeline.

Every ``train.eval_interval`` optimizer steps, and after the last one, every
rank runs the forward-only schedule (:func:`hetpipe.pipeline.schedules.forward_only`)
over ``train.eval_iters`` global batches of the validation data: no autograd
graph, no backward, no optimizer. The batches are the same at every
validation (the reader restarts from the first), so successive values differ
only by the weights and a resumed run validates on what an uninterrupted one
would. Each DP replica takes its share of every batch as in training.

The last stage's per-microbatch losses are gathered over the world group and
summed one by one in fp32 in the global microbatch order (batch by batch, DP
rank by DP rank), then divided by their count, as a training step's loss is.
With masked labels (``data.eod_mask_loss``) each loss is first weighted by
its microbatch's counted tokens (hetpipe.training.token_loss), so ``val_loss`` is the
mean over every counted token, as the training loss is; unmasked, every
weight is 1 and nothing is multiplied.
The value therefore depends on the weights and the data only, not on the
split, the vendors, TP or DP: on CPU in fp32 it is bitwise the
single-process value whenever the weights are.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hetpipe.data import MicrobatchLoader
from hetpipe.training.engine import PipelineEngine
from hetpipe.errors import ConfigError
from hetpipe.partitioner.plan_data import Plan
from hetpipe.models.precision import Bf16Weights
from hetpipe.schema.pretrain_config import PretrainConfig
from hetpipe.pipeline.schedules import Action, forward_only
from hetpipe.training.token_loss import counted_tokens, token_weights
from hetpipe.training.topology import Topology


def validation_loader(cfg: PretrainConfig, dp_rank: int = 0, dp_size: int = 1) -> Optional[MicrobatchLoader]:
    """The validation data of this DP rank; None when the run does not validate."""
    t, data = cfg.train, cfg.data
    if t.eval_interval is None:
        return None
    if data.valid_path is None and data.split is None:
        raise ConfigError(f"train.eval_interval={t.eval_interval} needs validation data: set data.split "
                          "(e.g. data.split=\"'969,30,1'\") or data.valid_path")
    path, split = (data.valid_path, None) if data.valid_path is not None else (data.path, data.split)
    return MicrobatchLoader(path, data.tokenizer, seq_length=t.seq_length, global_batch_size=t.global_batch_size,
                            micro_batch_size=t.micro_batch_size, vocab_size=cfg.model.vocab_size, dp_rank=dp_rank,
                            dp_size=dp_size, seed=t.seed, split=split, part="valid",
                            eod_mask_loss=data.eod_mask_loss)


class Validator:
    """Runs one validation on every rank and returns (val_loss, val_ppl) on every rank."""

    def __init__(self, interval: int, eval_iters: int, loader: MicrobatchLoader, engine: PipelineEngine,
                 actions: Sequence[Action], contributes: bool, dp_rank: int, dp_size: int,
                 group: Optional[dist.ProcessGroup], weights: Optional[Bf16Weights],
                 cp_group: Optional[dist.ProcessGroup] = None) -> None:
        self.interval = interval
        self.eval_iters = eval_iters
        self.loader = loader
        self.engine = engine
        self.actions = list(actions)
        # Last-stage TP rank 0 of each DP replica reports (other TP ranks hold copies).
        self.contributes = contributes
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.group = group
        self.weights = weights
        # CP ranks each hold a share of a microbatch's loss (hetpipe.models.context_hooks).
        self.cp_group = cp_group

    def due(self, completed_steps: int, train_iters: int) -> bool:
        """Whether to validate after ``completed_steps`` optimizer steps."""
        return completed_steps % self.interval == 0 or completed_steps == train_iters

    def run(self) -> tuple[float, float]:
        if self.weights is not None:
            self.weights.refresh()  # the bf16 copies lag the optimizer step just taken
        self.loader.restart()
        losses: list[torch.Tensor] = []
        counts: list[int] = []
        for _ in range(self.eval_iters):
            batch = self.loader.next_step()
            counts += counted_tokens(batch)
            step_losses = self.engine.run_forward(self.actions, batch)
            if step_losses is not None and self.contributes:
                losses += step_losses
        width = self.eval_iters * self.loader.num_microbatches
        local = torch.stack(losses).double().cpu() if losses else torch.zeros(width, dtype=torch.float64)
        if self.cp_group is not None:  # the mean of the CP ranks' shares is the microbatch's loss
            dist.all_reduce(local, group=self.cp_group)
            local /= dist.get_world_size(self.cp_group)
        rows = self._by_dp_rank(torch.cat([local, torch.tensor(counts, dtype=torch.float64)]))
        values = self._global_order(rows[:, :width]).astype(np.float32)
        val_loss = _token_mean(values, self._global_order(rows[:, width:]))
        try:
            return val_loss, math.exp(val_loss)
        except OverflowError:  # a diverged run; its loss says so anyway
            return val_loss, math.inf

    def _global_order(self, rows: torch.Tensor) -> np.ndarray:
        """[DP rank, batch x microbatch] -> [batch, DP rank, microbatch], flat: the
        global microbatch order."""
        return rows.reshape(self.dp_size, self.eval_iters, -1).transpose(0, 1).reshape(-1).numpy()

    def _by_dp_rank(self, local: torch.Tensor) -> torch.Tensor:
        """Every DP replica's row (its losses, then its counts), one each in DP-rank order."""
        if self.group is None:
            return local.reshape(1, -1)
        row = torch.cat([torch.tensor([float(self.contributes), float(self.dp_rank)], dtype=local.dtype), local])
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(rows, row, group=self.group)
        reported = sorted(((int(r[1]), r[2:]) for r in rows if r[0] == 1), key=lambda item: item[0])
        if [dp for dp, _ in reported] != list(range(self.dp_size)):
            raise RuntimeError(f"validation losses came from DP ranks {[dp for dp, _ in reported]}, "
                               f"expected one report from each of {self.dp_size}")
        return torch.stack([values for _, values in reported])


def _token_mean(values: np.ndarray, counts: np.ndarray) -> float:
    """The fp32 mean of the microbatch losses ``values``, each weighted by its
    counted tokens (hetpipe.training.token_loss); all weights 1 without masked labels,
    and then nothing is multiplied. cumsum adds one after another (a plain sum
    may pair them up)."""
    weights = np.asarray(token_weights([int(c) for c in counts], int(counts.sum())), dtype=np.float32)
    if not np.all(weights == 1.0):
        values = np.where(weights == 0.0, np.float32(0.0), values * weights)
    return float(np.cumsum(values, dtype=np.float32)[-1] / np.float32(values.size))


def build_validator(cfg: PretrainConfig, plan: Plan, topo: Topology, engine: PipelineEngine, contributes: bool,
                    weights: Optional[Bf16Weights]) -> Optional[Validator]:
    """This rank's validator, or None when the run does not validate."""
    loader = validation_loader(cfg, topo.dp_rank, topo.dp_size)
    if loader is None:
        return None
    actions = forward_only(plan.pipeline_size, plan.microbatches(cfg.train), plan.num_chunks,
                           plan.schedule)[topo.pp_rank]
    return Validator(cfg.train.eval_interval, cfg.train.eval_iters, loader, engine, actions,
                     contributes and topo.cp_rank == 0, topo.dp_rank, topo.dp_size,
                     dist.group.WORLD if topo.world_size > 1 else None, weights, topo.cp_group)
