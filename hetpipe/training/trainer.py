"""The training step loop: data, forward/backward with accumulation, clipping,
AdamW with warmup + cosine decay, metrics.

One optimizer step consumes one global batch, split into microbatches whose
gradients accumulate (each microbatch loss is scaled by 1/num_microbatches, so
the step's gradient is that of the mean loss over the global batch, Megatron's
convention; with masked labels, of the mean over its tokens: hetpipe.training.token_loss).
GPUs run bf16 working copies of fp32 main weights (Megatron's bf16 mode, see
hetpipe.models.precision); CPUs run fp32.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Optional

import torch
import yaml
from omegaconf import OmegaConf

from hetpipe.checkpoint import restore, should_save
from hetpipe.comm.factory import check_transport_available
from hetpipe.devices.vendor import accelerator_name
from hetpipe.process.known_warnings import quiet_known_warnings
from hetpipe.schema.pretrain_config import OptimizerConfig, PretrainConfig, resolve
from hetpipe.training.evaluate import validation_loader
from hetpipe.checkpoint.export_tokenizer import tokenizer_record
from hetpipe.training.gradients import sync_tied_embedding_grads
from hetpipe.process import faults
from hetpipe.launch.local import launch
from hetpipe.launch.preemption import PreemptionWatch, write_marker
from hetpipe.process.rank_env import rank_env, restart_attempt, under_torchrun
from hetpipe.launch.restart import resume_setting
from hetpipe.training import determinism, host_memory_fit, memory_fit
from hetpipe.observe.metrics import MetricsLogger, RunShape
from hetpipe.training.nonfinite import NonFiniteGuard
from hetpipe.observe.sample_log import SampleLog
from hetpipe.training.schedule_change import reconcile_schedule, schedule_record
from hetpipe.observe.straggler import StragglerReport
from hetpipe.models.flops import megatron_model_flops
from hetpipe.checkpoint.tp_slices import shard_fn
from hetpipe.parallel.tp_shards import finalize_tensor_parallel_grads
from hetpipe.devices.facts import check_local_devices
from hetpipe.devices.catalog import catalog_with, detect_device_type, device_spec
from hetpipe.partitioner.plan_data import Plan
from hetpipe.partitioner.resolve import resolve_plan
from hetpipe.devices.group_precision import check_local_fp8
from hetpipe.observe.memory_peak import memory_snapshot_step
from hetpipe.observe.profiling import profile_step
from hetpipe.training.topology import Topology, check_group_vendor

from hetpipe.training.rank_setup import Rank, loader_for, set_up


def lr_at(step: int, opt: OptimizerConfig, train_iters: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based, i.e. the steps already
    taken): linear warmup, then decay to ``min_lr``.

    Megatron-LM's OptimizerParamScheduler.get_lr (megatron/core/optimizer_param_scheduler.py),
    with its num_steps = ``step``: warmup while ``step <= W`` (``lr_warmup_iters``), from
    ``lr_warmup_init`` at step 0 to ``lr`` at step W; then, over D = ``lr_decay_iters``
    (train_iters when unset), ratio (step - W) / (D - W) through the cosine or linear
    coefficient, and ``min_lr`` past D. ``lr_warmup_style=one_ahead`` is hetpipe's
    earlier warmup, one step ahead (its first step at (lr - init) / W above init).
    """
    warmup = opt.lr_warmup_iters
    if warmup > 0 and step <= warmup:
        return _warmup_lr(step, opt)
    if opt.lr_decay_style == "constant":
        return opt.lr
    decay_iters = opt.lr_decay_iters or train_iters
    if step > decay_iters:  # also every step after warmup when D <= W (a run shorter than its warmup)
        return opt.min_lr
    ratio = (step - warmup) / (decay_iters - warmup)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if opt.lr_decay_style == "cosine" else 1.0 - ratio
    return opt.min_lr + coeff * (opt.lr - opt.min_lr)


def _warmup_lr(step: int, opt: OptimizerConfig) -> float:
    """Warmup's line from ``lr_warmup_init`` to ``lr``; ``step`` <= ``lr_warmup_iters``."""
    done = step if opt.lr_warmup_style == "megatron" else min(step + 1, opt.lr_warmup_iters)
    return opt.lr_warmup_init + (opt.lr - opt.lr_warmup_init) * done / opt.lr_warmup_iters


def _trainer_state(cfg: PretrainConfig, skipped_steps: int) -> dict[str, Any]:
    """What the trainer keeps in a checkpoint's trainer_state.json ("extra"): the warmup
    convention its steps followed, how many steps were skipped (the learning rate counts
    applied updates only), whether they ran train.deterministic, the tokenizer (for the
    HF export), the learning-rate schedule (checked on resume). A checkpoint without the
    convention predates Megatron's: it was written by a run that warmed up one step ahead."""
    return {"lr_warmup_style": cfg.optimizer.lr_warmup_style, "skipped_steps": skipped_steps,
            "deterministic": cfg.train.deterministic, "tokenizer": tokenizer_record(cfg.data.tokenizer),
            "schedule": schedule_record(cfg)}


def _resume_trainer_state(saved: Any, cfg: PretrainConfig, rank: int, guard: NonFiniteGuard) -> None:
    """The trainer's own state from a checkpoint: the skipped steps (none recorded
    before they were kept), a line where the warmup convention changed, and a
    changed schedule stopped, noted or undone (checkpoint.schedule)."""
    guard.total = int(saved.get("skipped_steps", 0))
    _note_warmup_change(saved, cfg.optimizer, rank)
    reconcile_schedule(saved.get("schedule"), cfg, rank, lr_at)


def _note_warmup_change(saved: Any, opt: OptimizerConfig, rank: int) -> None:
    """One line when the resumed run's warmup convention is not the checkpoint's."""
    before = saved.get("lr_warmup_style", "one_ahead")
    if rank != 0 or before == opt.lr_warmup_style:
        return
    old = "predates hetpipe's switch to Megatron's warmup (it warmed up one step ahead)" \
        if "lr_warmup_style" not in saved else f"was written with optimizer.lr_warmup_style={before}"
    print(f"hetpipe: note: the warmup convention changed: this checkpoint {old}; the run goes on with "
          f"optimizer.lr_warmup_style={opt.lr_warmup_style} (steps past optimizer.lr_warmup_iters are "
          f"unaffected; optimizer.lr_warmup_style={before} keeps the old one)", flush=True)


def peak_tflops(cfg: PretrainConfig, device: torch.device) -> float | None:
    """Dense peak for MFU: the override, else the catalog's for a known GPU."""
    if cfg.train.peak_tflops is not None:
        return cfg.train.peak_tflops
    if device.type == "cpu":
        return None  # no meaningful tensor-core peak
    kind = detect_device_type(accelerator_name())
    return device_spec(kind).peak_bf16_tflops if kind else None


def train(cfg: PretrainConfig, run_dir: Path) -> list[float]:
    """Pretrain ``cfg.model`` on ``cfg.cluster``; returns the step losses (from rank 0).

    Checks the plan, the data and (for ranks started here) the vendors before
    any process starts, so bad input fails once, in one line; then runs
    :func:`run_rank` on every rank (in-process for a one-rank cluster).
    """
    if not under_torchrun():  # a torchrun rank checks its own device at the roll call
        check_local_devices(cfg.cluster, catalog_with(dict(cfg.planner.catalog or {})))  # before planning for them
        check_local_fp8(cfg.cluster, cfg.train.precision, catalog_with(dict(cfg.planner.catalog or {})))
    plan = memory_fit.with_prediction(resolve_plan(cfg), cfg)
    check_transport_available(cfg.cluster)
    if not under_torchrun():
        for group in cfg.cluster.groups:
            check_group_vendor(cfg.cluster, group)
        memory_fit.check_local_fit(plan, cfg)  # every local rank's device, before any rank starts
        host_memory_fit.check_local_host_fit(plan, cfg)  # its CPU ranks together, in the host's memory
    loader_for(cfg)
    validation_loader(cfg)
    cfg_dict = OmegaConf.to_container(OmegaConf.structured(cfg))
    # The ranks run the plan decided here (plan=auto solves once, not per rank).
    return launch(cfg.cluster, run_rank, cfg_dict, plan.to_yaml(), str(run_dir), max_restarts=cfg.train.max_restarts,
                  env=determinism.launch_env(cfg.train.deterministic))


def run_rank(cfg_dict: dict, plan_yaml: str, run_dir: str) -> list[float]:
    """One rank's training loop: its stage(s), its channels, the shared step loop."""
    quiet_known_warnings()
    cfg = resolve(cfg_dict)
    rank, world, local_rank = rank_env()
    determinism.apply(cfg.train.deterministic, rank)  # before this rank's first device work
    plan = Plan.from_dict(yaml.safe_load(plan_yaml))
    topo = Topology(cfg.cluster, plan, rank, world, local_rank, catalog_with(dict(cfg.planner.catalog or {})))
    progress = memory_fit.Progress()
    try:
        # Out of memory: start-up's (the loop reports its own); an op with no deterministic variant: any.
        with memory_fit.out_of_memory_reported(topo, progress, plan, cfg), determinism.refusals_reported():
            return _train_loop(cfg, plan, topo, Path(run_dir), progress)
    finally:
        topo.close()


@dataclass
class _StepResult:
    lr: float
    loss_sum: torch.Tensor  # summed over the global batch's microbatches
    grad_norm: torch.Tensor
    busy: torch.Tensor  # every rank's busy seconds (the step less its waits on neighbours)
    skipped: Optional[str]  # why no update was applied, or None
    stopping: bool  # some rank received a preemption signal


def _train_loop(cfg: PretrainConfig, plan: Plan, topo: Topology, run_dir: Path,
                progress: memory_fit.Progress) -> list[float]:
    """Set up this rank, resume, then the steps: train, log, validate, save."""
    r = set_up(cfg, plan, topo, run_dir, progress)
    guard = NonFiniteGuard(cfg.train.max_skipped_steps)
    start = restore(resume_setting(cfg.checkpoint, run_dir, r.saver.node), run_dir, r.chunks, r.optimizer,
                    r.loader, topo.rank, topo.world_size, cfg.model, shard=shard_fn(r.chunks), node=r.saver.node,
                    on_resume=lambda saved: _resume_trainer_state(saved, cfg, topo.rank, guard))
    logger = _open_metrics(r, start) if topo.rank == 0 else None
    losses = []
    preemption = PreemptionWatch(cfg.train.preemption_signals)
    try:
        for step in range(start + 1, cfg.train.train_iters + 1):
            result = _train_step(r, step, guard, preemption)
            loss = _log_step(r, logger, step, result, guard)
            if loss is not None:
                losses.append(loss)
            _validate_if_due(r, logger, step)
            if _save_if_due(r, logger, step, result.stopping, guard.total):
                _stop_for_preemption(preemption, step, topo.rank, r.saver.wait(), logger)  # committed first
                break
        if logger is not None:
            logger.summary()
    except torch.OutOfMemoryError as exc:  # the job's cause is posted before the cleanup below
        raise memory_fit.out_of_memory(exc, topo, progress, plan, cfg) from None
    finally:
        preemption.close()
        if logger is not None:
            logger.close()
        if topo.device.type == "cuda":
            memory_fit.write_peak_memory(run_dir, topo.rank, topo.device)
        # The last checkpoint is committed before the job ends (a failed background write
        # is raised here); after a failure elsewhere an unfinished save is abandoned.
        r.saver.close()
    return [float(x) for x in losses]


def _open_metrics(r: Rank, start: int) -> MetricsLogger:
    """Rank 0's record of the run: its config and plan, metrics.jsonl and its mirrors, the banner."""
    cfg, t, topo, run_dir = r.cfg, r.cfg.train, r.topo, r.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    (run_dir / "config.yaml").write_text(resolved)
    (run_dir / "plan.yaml").write_text(r.plan.to_yaml())
    peak = peak_tflops(cfg, topo.device)
    shape = RunShape(total_steps=t.train_iters, tokens_per_step=r.loader.tokens_per_step,
                     flops_per_step=megatron_model_flops(cfg.model, t.global_batch_size, t.seq_length),
                     num_devices=topo.world_size, peak_tflops=peak, log_interval=t.log_interval,
                     reports_flops=topo.device.type != "cpu" or peak is not None, deterministic=t.deterministic)
    logger = MetricsLogger(run_dir, shape, cfg.logging, start_step=start,
                           wandb_config=OmegaConf.to_container(OmegaConf.create(resolved)),
                           straggler=StragglerReport(_stage_of_ranks(topo)) if cfg.logging.straggler else None,
                           samples=SampleLog(run_dir, r.loader, t.seed, start) if cfg.logging.sample_log else None)
    attempt = restart_attempt()
    if attempt:
        logger.record_event(start, "restart", f"hetpipe: restart {attempt} of {t.max_restarts}: resumed "
                            f"after step {start}", restart=attempt, resumed_from_step=start)
    layers = [s.layers for s in r.plan.stages]
    parallel = ", ".join(f"TP{tp} x DP{dp}" for tp, dp in sorted({(s.tp, s.dp) for s in r.plan.stages}))
    print(f"hetpipe: {cfg.model.name} ({cfg.model.num_parameters() / 1e6:.1f}M parameters) on "
          f"cluster {cfg.cluster.name} ({topo.world_size} rank(s), {accelerator_name()}), "
          f"layers per stage {layers}, {parallel}, {r.plan.schedule}, {r.precision}"
          f"{' (compiled layers)' if r.compiled else ' (fused elementwise)' if r.fused else ''}, "
          f"{determinism.describe(t.deterministic)}"
          f"{f'GEMMs leave {r.carveout} SMs to the NCCL boundary, ' if r.carveout else ''}"
          f"{r.plan.microbatches(t)} microbatches/step per DP rank, {r.loader.tokens_per_step} tokens/step, "
          f"run dir {run_dir}", flush=True)
    return logger


def _train_step(r: Rank, step: int, guard: NonFiniteGuard, preemption: PreemptionWatch) -> _StepResult:
    """One optimizer step (1-based ``step``): the schedule's forwards and backwards, the DP/TP
    gradient reductions, one norm exchange that also carries every rank's preemption flag and
    busy time, and the update unless the step is non-finite."""
    t, topo = r.cfg.train, r.topo
    r.progress.step = step
    # The schedule counts applied updates, as Megatron-LM's train_step advances its
    # OptimizerParamScheduler only when the update succeeded: a skipped step leaves it.
    lr = lr_at(step - 1 - guard.total, r.cfg.optimizer, t.train_iters)
    for group in r.optimizer.param_groups:
        group["lr"] = lr
    if r.weights is not None:
        r.weights.refresh()  # the main weights changed (optimizer step, checkpoint load)
    started = time.perf_counter()
    faults.hit("step", topo.rank, step)
    with profile_step(t.profile_step == step, r.run_dir, topo.rank, step), \
            memory_snapshot_step(t.memory_snapshot_step == step, r.run_dir, topo.rank, step):
        batch = r.loader.next_step()
        loss_sum = r.engine.run_step(batch, r.token_weights(batch) if r.token_weights is not None else None)
        if r.reducer is not None:
            r.reducer.finish()  # every .grad is now the DP average
        if topo.tp_size > 1:
            for chunk in r.chunks:
                finalize_tensor_parallel_grads(chunk)
        sync_tied_embedding_grads(r.chunks, topo.embedding_group)
        faults.hit("grads", topo.rank, step, lambda: [p.grad for c in r.chunks for p in c.parameters()])
        busy = time.perf_counter() - started - r.engine.wait_s
        side = torch.tensor([float(preemption.requested), busy])
        grad_norm, total_loss, sides = r.clipper.clip(r.cfg.optimizer.clip_grad, extra=loss_sum,
                                                      extra_contributes=r.counts_loss, side=side)
        skipped = guard.check(step, grad_norm, total_loss)
        if skipped is None:
            r.optimizer.step()
        if r.reducer is not None:
            r.reducer.zero_grad()
        else:
            r.optimizer.zero_grad(set_to_none=True)
    return _StepResult(lr, total_loss, grad_norm, sides[:, 1], skipped, bool(sides[:, 0].any()))


def _log_step(r: Rank, logger: Optional[MetricsLogger], step: int, result: _StepResult,
              guard: NonFiniteGuard) -> Optional[torch.Tensor]:
    """The step's row (or its skipped event) on rank 0; returns its mean loss unless skipped."""
    consumed = r.loader.state_dict()["consumed_samples"]
    if logger is not None and logger.samples is not None:
        logger.samples.record(step, applied=result.skipped is None)
    if result.skipped is not None:
        if logger is not None:
            logger.record_event(
                step, "skipped", f"hetpipe: step {step} skipped: {result.skipped} (no update applied; "
                f"{guard.consecutive} in a row, train.max_skipped_steps={r.cfg.train.max_skipped_steps})",
                reason=result.skipped, lr=result.lr, consumed_samples=consumed,
                consecutive_skips=guard.consecutive, skipped_steps=guard.total)
        return None
    # Each CP rank's loss is its share of the sequence's mean times CP (hetpipe.models.context_hooks).
    mean_loss = result.loss_sum / (r.plan.microbatches(r.cfg.train) * r.topo.dp_size * r.topo.cp_size)
    if logger is not None:
        if logger.straggler is not None:
            logger.straggler.add(result.busy)
        logger.record(step, mean_loss, result.grad_norm, result.lr, consumed)
    return mean_loss


def _validate_if_due(r: Rank, logger: Optional[MetricsLogger], step: int) -> None:
    if r.validator is None or not r.validator.due(step, r.cfg.train.train_iters):
        return
    if logger is not None:
        logger.flush()  # validation's time stays out of this interval's throughput
    val_loss, val_ppl = r.validator.run()
    if logger is not None:
        logger.record_validation(step, val_loss, val_ppl)


def _save_if_due(r: Rank, logger: Optional[MetricsLogger], step: int, stopping: bool, skipped_steps: int) -> bool:
    """Saves at the configured interval, or now for a preemption; True when stopping."""
    if should_save(r.cfg.checkpoint, step, r.cfg.train.train_iters) or stopping:
        if logger is not None:
            logger.flush()  # metrics up to the checkpoint are on disk with it
        # Each rank writes its own shards in the background; the step waits for a host copy.
        r.saver.save(step, r.chunks, r.optimizer, r.loader.state_dict(), _trainer_state(r.cfg, skipped_steps))
    return stopping


def _stage_of_ranks(topo: Topology) -> list[int]:
    """Global rank -> its pipeline stage."""
    stage = {r: s for s, st in enumerate(topo.stages) for r in st.ranks}
    return [stage[r] for r in range(topo.world_size)]


def _stop_for_preemption(preemption: PreemptionWatch, step: int, rank: int, checkpoint: Optional[Path],
                         logger: Optional[MetricsLogger]) -> None:
    """The checkpoint of ``step`` is committed: say so, and let the launcher know."""
    signal_name = preemption.received or "a signal on another rank"
    write_marker(rank, restart_attempt(), step, checkpoint, signal_name)
    if logger is not None:
        logger.record_event(step, "preempted", signal=signal_name)
        print(f"hetpipe: preempted by {signal_name} after step {step}: checkpoint {checkpoint} saved; "
              "exiting 0", flush=True)
