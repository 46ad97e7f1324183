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
import os
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import yaml
from omegaconf import OmegaConf

from hetpipe.checkpoint import CheckpointSaver, restore, should_save
from hetpipe.comm.factory import check_transport_available
from hetpipe.devices.vendor import accelerator_name, detect_vendor
from hetpipe.process.known_warnings import quiet_known_warnings
from hetpipe.schema.pretrain_config import OptimizerConfig, PretrainConfig, resolve
from hetpipe.data import MicrobatchLoader
from hetpipe.training.engine import PipelineEngine
from hetpipe.training.evaluate import build_validator, validation_loader
from hetpipe.checkpoint.export_tokenizer import tokenizer_record
from hetpipe.training.gradients import GradNormClipper, sync_tied_embedding_grads
from hetpipe.process import faults
from hetpipe.launch.local import launch
from hetpipe.launch.preemption import PreemptionWatch, write_marker
from hetpipe.process.rank_env import rank_env, restart_attempt, under_torchrun
from hetpipe.launch.restart import resume_setting
from hetpipe.training import determinism, host_memory_fit, memory_fit
from hetpipe.training.determinism import seed_everything
from hetpipe.observe.metrics import MetricsLogger, RunShape
from hetpipe.training.nonfinite import NonFiniteGuard
from hetpipe.observe.sample_log import SampleLog
from hetpipe.training.schedule_change import reconcile_schedule, schedule_record
from hetpipe.training.token_loss import TokenWeights, step_weights
from hetpipe.observe.straggler import StragglerReport
from hetpipe.models import build_model
from hetpipe.models.documents import DocumentRule
from hetpipe.models.transformer import set_document_masking
from hetpipe.models.context_hooks import use_context_parallel
from hetpipe.data.tokenizer import load_tokenizer
from hetpipe.models.flops import megatron_model_flops
from hetpipe.models.layers import elementwise_kernels, fuse_elementwise, set_attention_backend, use_liger
from hetpipe.models.parallelize import parallelize_tensor
from hetpipe.models.recompute import set_recompute
from hetpipe.models.split_backward import allow_retained_graphs
from hetpipe.checkpoint.tp_slices import shard_fn
from hetpipe.parallel.context import ContextShard
from hetpipe.parallel.grad_reducer import GradReducer
from hetpipe.parallel.tp_shards import finalize_tensor_parallel_grads
from hetpipe.parallel.zero1 import DistributedOptimizer
from hetpipe.devices.facts import check_local_devices, device_facts
from hetpipe.devices.catalog import catalog_with, detect_device_type, device_spec
from hetpipe.partitioner.plan_data import Plan
from hetpipe.partitioner.resolve import resolve_plan
from hetpipe.models.fp8 import compiles_layers, convert_to_fp8
from hetpipe.models.precision import (WORKING_COPY_MODES, Bf16Weights, activation_dtype, cast_parameters,
                                      fuse_linear_grads, resolve_precision)
from hetpipe.devices.group_precision import check_local_fp8, fp8_format, group_precision
from hetpipe.observe.memory_peak import memory_snapshot_step
from hetpipe.observe.profiling import profile_step
from hetpipe.pipeline.registry import schedule_spec
from hetpipe.pipeline.schedules import build_schedule
from hetpipe.training.topology import Topology, check_group_vendor


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


def build_optimizer(chunks: Sequence[torch.nn.Module], opt: OptimizerConfig, device: torch.device,
                    dp_group: Optional[dist.ProcessGroup] = None) -> torch.optim.Optimizer:
    """AdamW; matrices get weight decay, norms and biases do not (as in Megatron).

    With ``opt.distributed`` and a DP group, the ZeRO-1
    :class:`~hetpipe.parallel.zero1.DistributedOptimizer` shards the state over it.
    """
    named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters() if p.requires_grad]
    kwargs = dict(lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps)
    # The fused kernel is one launch per step instead of several per tensor.
    fused = device.type in ("cuda", "cpu")
    groups = [
        {"params": [(n, p) for n, p in named if p.ndim >= 2], "weight_decay": opt.weight_decay},
        {"params": [(n, p) for n, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]
    if opt.distributed and dp_group is not None:
        # Named, so its sharded state can be saved and loaded by parameter name.
        return DistributedOptimizer(groups, dp_group, weight_decay=opt.weight_decay, fused=fused, **kwargs)
    return torch.optim.AdamW([{**g, "params": [p for _, p in g["params"]]} for g in groups], fused=fused, **kwargs)


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
    _loader(cfg)
    validation_loader(cfg)
    cfg_dict = OmegaConf.to_container(OmegaConf.structured(cfg))
    # The ranks run the plan decided here (plan=auto solves once, not per rank).
    return launch(cfg.cluster, run_rank, cfg_dict, plan.to_yaml(), str(run_dir), max_restarts=cfg.train.max_restarts,
                  env=determinism.launch_env(cfg.train.deterministic))


def _loader(cfg: PretrainConfig, dp_rank: int = 0, dp_size: int = 1) -> MicrobatchLoader:
    t = cfg.train
    return MicrobatchLoader(cfg.data.path, cfg.data.tokenizer, seq_length=t.seq_length,
                            global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                            vocab_size=cfg.model.vocab_size, seed=t.seed, dp_rank=dp_rank, dp_size=dp_size,
                            split=cfg.data.split, eod_mask_loss=cfg.data.eod_mask_loss)


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


def _build_chunks(cfg: PretrainConfig, plan: Plan, topo: Topology, precision: str, fp8: Optional[str]) -> list:
    """This rank's model chunks: built whole from the seed, then cut to its TP shard.
    Chunk c holds the units of the virtual stage the plan's placement gives it.
    ``fp8``: the FP8 format its decoder linears compute in (train.precision=fp8)."""
    ranges = plan.unit_ranges()
    chunks = []
    if schedule_spec(plan.schedule).split_backward:
        allow_retained_graphs()
    for c in range(plan.num_chunks):
        v = plan.placement.stage(topo.pp_rank, c)
        chunk = build_model(cfg.model, seed=cfg.train.seed, units=ranges[v], device=topo.device)
        if topo.tp_size > 1:
            chunk = parallelize_tensor(chunk, topo.tp_group, topo.tp_size, topo.tp_rank,
                                       sequence_parallel=cfg.partition.sequence_parallel)
        set_attention_backend(chunk, cfg.train.attention_backend, cfg.train.deterministic, topo.device, topo.rank,
                              half=precision != "fp32")
        set_document_masking(chunk, _document_rule(cfg))
        use_context_parallel(chunk, ContextShard(topo.cp_size, topo.cp_rank, topo.cp_group, cfg.partition.cp_method))
        stage = plan.stages[v]
        set_recompute(chunk, stage.recompute, stage.recompute_num_layers)
        if fp8 is not None:
            _convert_to_fp8(chunk, cfg.train.fp8_recipe, fp8, topo, note=c == 0)
        compiled = compiles_layers(cfg.train.compile, fp8 is not None, topo.device.type)
        kernels = elementwise_kernels(cfg.train.fuse_elementwise, topo.device.type, compiled,
                                      device_kind=_device_kind(topo.device))
        if kernels != "none":
            fuse_elementwise(chunk)
            if kernels == "liger":
                use_liger(chunk)
            if c == 0 and topo.local_rank == 0 and detect_vendor() == "amd":
                print("hetpipe: note: fused elementwise kernels (Triton on ROCm) are not verified on AMD "
                      "hardware; train.fuse_elementwise=false runs the eager kernels", flush=True)
        if compiled:
            for layer in chunk.layers.values():
                layer.compile()
        chunks.append(chunk)
    return chunks


def _convert_to_fp8(chunk, recipe: str, fp8: str, topo: Topology, note: bool) -> None:
    """The chunk's decoder linears in FP8; a stage's first rank names those left bf16."""
    skipped = convert_to_fp8([chunk], recipe, fp8)
    if skipped and note and topo.rank == topo.stage.ranks[0]:
        print(f"hetpipe: note: train.precision=fp8 keeps {len(skipped)} decoder linear(s) of stage "
              f"{topo.pp_rank} in bf16, their dimensions not multiples of 16 (FP8 GEMM alignment): "
              f"{', '.join(skipped[:4])}{', ...' if len(skipped) > 4 else ''}", flush=True)


def _fp8_format(train_precision: str, topo: Topology) -> str:
    """The FP8 pair this rank's device computes in (its catalog entry's), or the one-line refusal."""
    kind = device_facts(topo.device, topo.catalog, free=False).device_type
    return fp8_format(train_precision, topo.group.precision, topo.group_index, topo.group.name, kind, topo.catalog)


def _device_kind(device: torch.device) -> Optional[str]:
    """The catalog's name for this rank's GPU (None on CPUs or an unknown GPU)."""
    return None if device.type == "cpu" else detect_device_type(accelerator_name())


def _document_rule(cfg: PretrainConfig) -> Optional[DocumentRule]:
    """data.reset_attention_mask / reset_position_ids, at the data's end-of-document id."""
    if not (cfg.data.reset_attention_mask or cfg.data.reset_position_ids):
        return None
    eod = load_tokenizer(cfg.data.tokenizer).eod
    return DocumentRule(eod, cfg.data.reset_attention_mask, cfg.data.reset_position_ids)


def _recv_ahead(cfg: PretrainConfig, topo: Topology) -> int:
    """partition.recv_ahead, or its automatic value (see PartitionConfig)."""
    if cfg.partition.recv_ahead is not None:
        return cfg.partition.recv_ahead
    return 1 if topo.device.type == "cuda" and topo.p2p_groups else 2


def _check_memory(cfg: PretrainConfig, plan: Plan, topo: Topology) -> None:
    """This rank's device against its stage's predicted memory, once the job's watch
    exists (a refusal then ends every rank with its line); the stage's first rank
    notes a tight fit."""
    capacity = memory_fit.rank_capacity(cfg, topo.group, topo.device)
    note = memory_fit.check_stage(plan, cfg, topo.pp_rank, topo.rank, capacity)
    if under_torchrun() and topo.device.type == "cpu" and topo.nodes is not None:  # no launcher checked it
        node_ranks = topo.nodes.ranks_on(topo.nodes.node_of[topo.rank])
        host_memory_fit.check_node_host_fit(plan, cfg, topo.rank, node_ranks)
    if note and topo.rank == topo.stage.ranks[0]:
        print(f"hetpipe: note: {note}", flush=True)


@dataclass
class _Rank:
    """What one rank's training steps use, built once by :func:`_set_up`."""
    cfg: PretrainConfig
    plan: Plan
    topo: Topology
    run_dir: Path
    progress: memory_fit.Progress
    precision: str
    chunks: list
    loader: MicrobatchLoader
    weights: Optional[Bf16Weights]
    engine: PipelineEngine
    reducer: Optional[GradReducer]
    optimizer: torch.optim.Optimizer
    clipper: GradNormClipper
    counts_loss: bool  # this rank's loss is part of the step's (last stage, TP rank 0)
    token_weights: Optional[TokenWeights]  # the last stage's, where labels can be masked
    validator: Any
    saver: CheckpointSaver
    fused: bool  # some layer runs fused elementwise kernels
    carveout: Optional[int]  # SMs the GEMMs leave to the NCCL boundary
    compiled: bool = False  # the decoder layers run compiled (train.compile, fp8 on GPUs)


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
    r = _set_up(cfg, plan, topo, run_dir, progress)
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


def _set_up(cfg: PretrainConfig, plan: Plan, topo: Topology, run_dir: Path,
            progress: memory_fit.Progress) -> _Rank:
    """Process groups, channels, this rank's chunks, the engine, the optimizer and the saver."""
    t = cfg.train
    device = topo.device
    precision = resolve_precision(group_precision(t.precision, topo.group.precision), device.type)
    fp8 = _fp8_format(t.precision, topo) if precision == "fp8" else None
    seed_everything(t.seed)
    topo.init_process_groups(tied_embeddings=cfg.model.share_embeddings_and_output_weights)
    _check_memory(cfg, plan, topo)
    carveout = determinism.gemm_sm_carveout(topo, t.deterministic)
    channels = topo.build_channels() if topo.pipeline_size > 1 else {}
    loader = _loader(cfg, topo.dp_rank, topo.dp_size)
    P = plan.pipeline_size
    chunks = _build_chunks(cfg, plan, topo, precision, fp8)
    compiled = compiles_layers(t.compile, fp8 is not None, device.type)
    if precision == "bf16-pure":
        cast_parameters(chunks, torch.bfloat16)  # before the reducer's buffers and the optimizer's state
        if t.grad_accumulation_fusion and not t.compile:
            fuse_linear_grads(chunks)
        if topo.rank == 0:
            print("hetpipe: note: train.precision=bf16-pure keeps no fp32 main weights (updates below a "
                  "weight's bf16 resolution are lost); it is for comparisons with pure-bf16 runs, "
                  "train.precision=bf16 is the mode for real pretraining", flush=True)
    fused = any(getattr(m, "fused", False) for chunk in chunks for m in chunk.modules())
    actions = build_schedule(plan.schedule, P, loader.num_microbatches, plan.num_chunks)[topo.pp_rank]
    # bf16, fp8: made after TP sharding and FP8 conversion (the copies are of the shards).
    weights = (Bf16Weights(chunks, fuse_linear_grads=t.grad_accumulation_fusion and not compiled)
               if precision in WORKING_COPY_MODES else None)
    engine = PipelineEngine(chunks, actions, channels, rank=topo.pp_rank, pipeline_size=P,
                            activation_shape=(t.micro_batch_size, t.seq_length // topo.cp_size, cfg.model.hidden_size),
                            activation_dtype=activation_dtype(precision), device=device, precision=precision,
                            weights=weights, recv_ahead=_recv_ahead(cfg, topo))
    if device.type == "cuda" and topo.world_size > 1 and not os.environ.get("HETPIPE_SKIP_WARMUP"):
        # Load every kernel before any receive is posted ahead (see warm_up;
        # HETPIPE_SKIP_WARMUP=1 is for reproducing the deadlock it prevents).
        # Before the DP reducer exists: its hooks would count these gradients.
        shape = (t.micro_batch_size, t.seq_length)
        engine.warm_up((torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long)),
                       forward_only=t.eval_interval is not None)
    reducer = None
    if topo.dp_size * topo.cp_size > 1:  # CP ranks hold the same parameters, partial gradients
        reducer = GradReducer(chunks, topo.dp_group, bucket_bytes=int(cfg.partition.grad_bucket_mb * 2**20),
                              microbatches_per_step=loader.num_microbatches)
    optimizer = build_optimizer(chunks, cfg.optimizer, device, topo.dp_group)
    world_group = dist.group.WORLD if topo.world_size > 1 else None
    clipper = GradNormClipper(cfg.model, chunks, world_group, contributes=topo.dp_rank == 0 and topo.cp_rank == 0)
    counts_loss = any(chunk.is_last for chunk in chunks) and topo.tp_rank == 0
    token_weights = step_weights(cfg.data.eod_mask_loss, any(c.is_last for c in chunks), topo.dp_group, device)
    validator = build_validator(cfg, plan, topo, engine, counts_loss, weights)
    saver = CheckpointSaver.for_topology(cfg.checkpoint, run_dir, topo, cfg.model, plan)
    return _Rank(cfg, plan, topo, run_dir, progress, precision, chunks, loader, weights, engine, reducer,
                 optimizer, clipper, counts_loss, token_weights, validator, saver, fused, carveout, compiled)


def _open_metrics(r: _Rank, start: int) -> MetricsLogger:
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
          f"{r.loader.num_microbatches} microbatches/step per DP rank, {r.loader.tokens_per_step} tokens/step, "
          f"run dir {run_dir}", flush=True)
    return logger


def _train_step(r: _Rank, step: int, guard: NonFiniteGuard, preemption: PreemptionWatch) -> _StepResult:
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


def _log_step(r: _Rank, logger: Optional[MetricsLogger], step: int, result: _StepResult,
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
    mean_loss = result.loss_sum / (r.loader.num_microbatches * r.topo.dp_size * r.topo.cp_size)
    if logger is not None:
        if logger.straggler is not None:
            logger.straggler.add(result.busy)
        logger.record(step, mean_loss, result.grad_norm, result.lr, consumed)
    return mean_loss


def _validate_if_due(r: _Rank, logger: Optional[MetricsLogger], step: int) -> None:
    if r.validator is None or not r.validator.due(step, r.cfg.train.train_iters):
        return
    if logger is not None:
        logger.flush()  # validation's time stays out of this interval's throughput
    val_loss, val_ppl = r.validator.run()
    if logger is not None:
        logger.record_validation(step, val_loss, val_ppl)


def _save_if_due(r: _Rank, logger: Optional[MetricsLogger], step: int, stopping: bool, skipped_steps: int) -> bool:
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
