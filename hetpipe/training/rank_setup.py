"""One rank's training set-up, by named builders: the model chunks (TP shards,
precision, FP8, attention, recomputation), the engine over the plan's
schedule and the rank's channels, the optimizer with its DP x CP reducer and
clipper, the validator and the saver; :func:`set_up` runs them in order and
returns the :class:`Rank` the step loop (hetpipe.training.trainer) uses.
"""
from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from hetpipe.checkpoint import CheckpointSaver
from hetpipe.devices.vendor import accelerator_name, detect_vendor
from hetpipe.schema.pretrain_config import OptimizerConfig, PretrainConfig
from hetpipe.data import MicrobatchLoader
from hetpipe.training.engine import PipelineEngine
from hetpipe.training.evaluate import build_validator
from hetpipe.training.gradients import GradNormClipper
from hetpipe.process.rank_env import under_torchrun
from hetpipe.training import determinism, host_memory_fit, memory_fit
from hetpipe.training.determinism import seed_everything
from hetpipe.training.token_loss import TokenWeights, step_weights
from hetpipe.models import build_model
from hetpipe.models.documents import DocumentRule
from hetpipe.models.transformer import set_document_masking
from hetpipe.models.context_hooks import use_context_parallel
from hetpipe.data.tokenizer import load_tokenizer
from hetpipe.models.layers import elementwise_kernels, fuse_elementwise, set_attention_backend, use_liger
from hetpipe.models.parallelize import parallelize_tensor
from hetpipe.models.recompute import set_recompute
from hetpipe.models.split_backward import allow_retained_graphs
from hetpipe.parallel.context import ContextShard
from hetpipe.parallel.grad_reducer import GradReducer
from hetpipe.parallel.zero1 import DistributedOptimizer
from hetpipe.devices.facts import device_facts
from hetpipe.devices.catalog import detect_device_type
from hetpipe.partitioner.plan_data import Plan
from hetpipe.models.fp8 import compiles_layers, convert_to_fp8
from hetpipe.models.precision import (WORKING_COPY_MODES, Bf16Weights, activation_dtype, cast_parameters,
                                      fuse_linear_grads, resolve_precision)
from hetpipe.devices.group_precision import fp8_format, group_precision
from hetpipe.pipeline.schedules import build_schedule
from hetpipe.training.topology import Topology


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


def loader_for(cfg: PretrainConfig, dp_rank: int = 0, dp_size: int = 1) -> MicrobatchLoader:
    """The microbatches of DP rank ``dp_rank`` of ``dp_size`` (the launcher builds
    one too, to check the data before any rank starts)."""
    t = cfg.train
    return MicrobatchLoader(cfg.data.path, cfg.data.tokenizer, seq_length=t.seq_length,
                            global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                            vocab_size=cfg.model.vocab_size, seed=t.seed, dp_rank=dp_rank, dp_size=dp_size,
                            split=cfg.data.split, eod_mask_loss=cfg.data.eod_mask_loss)


def _build_chunks(cfg: PretrainConfig, plan: Plan, topo: Topology, precision: str, fp8: Optional[str]) -> list:
    """This rank's model chunks: built whole from the seed, then cut to its TP shard.
    Chunk c holds the units of the virtual stage the plan's placement gives it.
    ``fp8``: the FP8 format its decoder linears compute in (train.precision=fp8)."""
    ranges = plan.unit_ranges()
    chunks = []
    if plan.spec.split_backward:
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
class Rank:
    """What one rank's training steps use, built once by :func:`set_up`."""
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


def set_up(cfg: PretrainConfig, plan: Plan, topo: Topology, run_dir: Path,
            progress: memory_fit.Progress) -> Rank:
    """Process groups and channels, then the named builders: the model chunks,
    the engine, the optimizer with its DP reducer, the validator and the saver."""
    t = cfg.train
    precision = resolve_precision(group_precision(t.precision, topo.group.precision), topo.device.type)
    fp8 = _fp8_format(t.precision, topo) if precision == "fp8" else None  # or its refusal, before any group forms
    seed_everything(t.seed)
    topo.init_process_groups(tied_embeddings=cfg.model.share_embeddings_and_output_weights)
    _check_memory(cfg, plan, topo)
    carveout = determinism.gemm_sm_carveout(topo, t.deterministic)
    channels = topo.build_channels() if topo.pipeline_size > 1 else {}
    loader = loader_for(cfg, topo.dp_rank, topo.dp_size)
    model = _build_model(cfg, plan, topo, precision, fp8)
    engine = _build_engine(cfg, plan, topo, model, channels)
    reducer, optimizer, clipper = _build_optimizer(cfg, plan, topo, model.chunks)
    is_last = any(chunk.is_last for chunk in model.chunks)
    counts_loss = is_last and topo.tp_rank == 0
    token_weights = step_weights(cfg.data.eod_mask_loss, is_last, topo.dp_group, topo.device)
    validator = build_validator(cfg, plan, topo, engine, counts_loss, model.weights)
    saver = CheckpointSaver.for_topology(cfg.checkpoint, run_dir, topo, cfg.model, plan)
    return Rank(cfg, plan, topo, run_dir, progress, model.precision, model.chunks, loader, model.weights, engine,
                 reducer, optimizer, clipper, counts_loss, token_weights, validator, saver, model.fused, carveout,
                 model.compiled)


@dataclass
class _Model:
    """This rank's model chunks and how they compute."""
    chunks: list
    precision: str  # train.precision as this rank's group and device run it
    weights: Optional[Bf16Weights]  # bf16 working copies of fp32 main weights (bf16, fp8)
    fused: bool  # some layer runs fused elementwise kernels
    compiled: bool  # the decoder layers run compiled


def _build_model(cfg: PretrainConfig, plan: Plan, topo: Topology, precision: str, fp8: Optional[str]) -> _Model:
    """The chunks in ``precision`` (``fp8``: the FP8 format their linears compute in),
    and their bf16 working copies where it keeps fp32 main weights."""
    t, device = cfg.train, topo.device
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
    # bf16, fp8: made after TP sharding and FP8 conversion (the copies are of the shards).
    weights = (Bf16Weights(chunks, fuse_linear_grads=t.grad_accumulation_fusion and not compiled)
               if precision in WORKING_COPY_MODES else None)
    return _Model(chunks, precision, weights, fused, compiled)


def _build_engine(cfg: PretrainConfig, plan: Plan, topo: Topology, model: _Model, channels: dict) -> PipelineEngine:
    """This rank's engine: its actions of the plan's schedule over its channels,
    and on GPUs every kernel loaded before any receive is posted ahead."""
    t, device, P = cfg.train, topo.device, plan.pipeline_size
    actions = build_schedule(plan.schedule, P, plan.microbatches(t), plan.num_chunks)[topo.pp_rank]
    engine = PipelineEngine(model.chunks, actions, channels, rank=topo.pp_rank, pipeline_size=P,
                            activation_shape=(t.micro_batch_size, t.seq_length // topo.cp_size, cfg.model.hidden_size),
                            activation_dtype=activation_dtype(model.precision), device=device, precision=model.precision,
                            weights=model.weights, recv_ahead=_recv_ahead(cfg, topo))
    if device.type == "cuda" and topo.world_size > 1 and not os.environ.get("HETPIPE_SKIP_WARMUP"):
        # Load every kernel before any receive is posted ahead (see warm_up;
        # HETPIPE_SKIP_WARMUP=1 is for reproducing the deadlock it prevents).
        # Before the DP reducer exists: its hooks would count these gradients.
        shape = (t.micro_batch_size, t.seq_length)
        engine.warm_up((torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long)),
                       forward_only=t.eval_interval is not None)
    return engine


def _build_optimizer(cfg: PretrainConfig, plan: Plan, topo: Topology,
                     chunks: list) -> tuple[Optional[GradReducer], torch.optim.Optimizer, GradNormClipper]:
    """The DP x CP gradient reducer (where there is more than one replica), AdamW
    (ZeRO-1 sharded where asked) and the global gradient-norm clipper."""
    reducer = None
    if topo.dp_size * topo.cp_size > 1:  # CP ranks hold the same parameters, partial gradients
        reducer = GradReducer(chunks, topo.dp_group, bucket_bytes=int(cfg.partition.grad_bucket_mb * 2**20),
                              microbatches_per_step=plan.microbatches(cfg.train))
    optimizer = build_optimizer(chunks, cfg.optimizer, topo.device, topo.dp_group)
    world_group = dist.group.WORLD if topo.world_size > 1 else None
    clipper = GradNormClipper(cfg.model, chunks, world_group, contributes=topo.dp_rank == 0 and topo.cp_rank == 0)
    return reducer, optimizer, clipper
