"""Structured configs for ``python -m hetpipe.pretrain`` (hydra ConfigStore).

Each dataclass is a config group's schema: hydra refuses unknown keys and
values of the wrong type while composing, and ``__post_init__`` checks value
ranges and cross-field rules when the composed config is turned into objects
(:func:`resolve`). Field names follow Megatron-LM where it has the concept.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from hetpipe.checkpoint.settings import CheckpointConfig
from hetpipe.devices.cluster import ClusterConfig
from hetpipe.schema.config_help import register_help_resolver
from hetpipe.data.sources import parse_data_path
from hetpipe.data.split import parse_split
from hetpipe.errors import ConfigError, config_error_from
from hetpipe.models.model_config import ModelConfig, preset_names
from hetpipe.models.train_modes import (FP8_RECIPES, PRECISIONS, check_attention_backend, check_recompute,
                                        elementwise_mode)
from hetpipe.partitioner.planner_config import PlannerConfig
from hetpipe.pipeline.registry import DEFAULT_SCHEDULE
import hetpipe.errors.value_checks as value_checks

# Microbatches per step at most (global_batch_size / micro_batch_size): each rank
# holds its step as a list of a few actions per microbatch, and the memory check
# walks every rank's list before anything runs (docs/architecture.md, "Odd values").
MAX_MICROBATCHES = 2**16


@dataclass
class TrainConfig:
    # Sequences per microbatch on one data-parallel rank.
    micro_batch_size: int = 4
    # Sequences per optimizer step over all data-parallel ranks; the rest of
    # the batch comes from gradient accumulation over microbatches.
    global_batch_size: int = 16
    # Tokens per sequence (each sample holds seq_length + 1 tokens).
    seq_length: int = 128
    # Optimizer steps to run.
    train_iters: int = 100
    # Seeds weights (per model unit) and the data order.
    seed: int = 1234
    # bf16 (bf16 working copies of fp32 main weights, Megatron's --bf16),
    # fp8 (bf16 with the decoder layers' linears in FP8, torchao),
    # bf16-autocast (fp32 weights under torch.autocast), fp32, or auto: bf16
    # on GPUs, fp32 on CPUs. A group may override it (cluster.groups[i].precision).
    # See models/precision.py.
    precision: str = "auto"
    # fp8's scaling: tensorwise (one scale per tensor) or rowwise (per row).
    fp8_recipe: str = "tensorwise"
    # Steps between console log lines (metrics.jsonl gets every step).
    log_interval: int = 10
    # Dense peak TFLOP/s for MFU; None takes the device catalog's figure.
    peak_tflops: Optional[float] = None
    # bf16 and bf16-pure: the decoder layers' weight-gradient GEMMs accumulate
    # straight into the gradients, fp32 or bf16 (Megatron's
    # --gradient-accumulation-fusion); off under train.compile. Without it a
    # bf16-pure step ran an add kernel per weight per microbatch: 4.8 % of a
    # LLaMA-3-8B stage's kernel time on 2xH100 (zb_v, seq 4096).
    grad_accumulation_fusion: bool = True
    # torch.compile each decoder layer (Module.compile).
    compile: bool = False
    # Fused kernels for the elementwise work (RMSNorm, residual add + norm,
    # RoPE, SwiGLU, the loss's per-chunk math); GEMMs and attention stay as
    # they are. compile (or true): torch.compile of those functions; liger:
    # liger-kernel's Triton kernels for RMSNorm, SwiGLU and the head's
    # cross-entropy (package liger-kernel, the hetpipe[kernels] extra; CUDA
    # and ROCm GPUs), RoPE compiled; none (or false): eager. auto (or null):
    # none on CPUs and under train.compile, else per device from the table in
    # hetpipe/models/train_modes.py (LIGER_AUTO_DEVICES, measured in
    # docs/benchmarks.md): compile everywhere until liger is measured faster.
    fuse_elementwise: Any = None
    # The attention kernel of the decoder layers (issue 42's
    # model.attention_backend; Megatron's --attention-backend; see
    # hetpipe/models/attention.py): fa4 (FlashAttention-4, package
    # flash-attn-4, the hetpipe[kernels] extra: SM90/SM100 GPUs only; a rank
    # without it stops before step 1), or the SDPA backend preferred: cudnn,
    # flash, efficient or math, the others allowed behind it so that a rank
    # lacking it (cuDNN on ROCm) falls back rather than failing. auto: FA4
    # where it is installed and the GPU is SM90/SM100, else torch's SDPA
    # choice (cuDNN on H100/H200 with torch 2.11); ROCm runs SDPA's backends.
    attention_backend: str = "auto"
    # Two runs of one configuration on one machine give the same bits:
    # deterministic kernels (torch.use_deterministic_algorithms; an op without
    # one fails in one line), cuBLAS's fixed workspace, NCCL/RCCL fixed to Ring
    # and Simple, SDPA backends with a deterministic backward (flash, not
    # cuDNN), no GEMM SM carveout; hetpipe/training/determinism.py says why each. Two
    # NCCL runs on 2xH100 (0.75B LLaMA-3 shape, bf16, 200 steps) otherwise
    # differed by up to 1.8e-2 relative in loss, which hides a channel's
    # parity (issue 31). Costs speed: on 2xH100 (that shape) steps took
    # 1.16x (NCCL boundary), 1.12x (direct) and 1.11x (tcp) as long, and
    # NCCL, direct and tcp were then bitwise identical over 200 steps
    # (scripts/determinism_check.sh, docs/benchmarks.md).
    deterministic: bool = False
    # Profile this optimizer step (1-based) on GPU ranks: each writes
    # profile_rank<r>.txt (busy time, kernel time by class, top kernels).
    profile_step: Optional[int] = None
    # Record this optimizer step's (1-based) device allocations on GPU ranks:
    # each writes memory_snapshot_rank<r>.pickle (for pytorch.org/memory_viz)
    # and memory_peak_rank<r>.txt (the peak, and what was alive at it by the
    # engine action and hetpipe frame that made it; hetpipe/observe/memory_peak.py).
    # For a peak above the planner's prediction: the tcp boundary's 1.7-3.3
    # GiB over it at seq 8192 on 2xH100 (docs/benchmarks.md) was found so.
    memory_snapshot_step: Optional[int] = None
    # Activation recomputation (Megatron's --recompute-granularity; see
    # hetpipe/models/recompute.py): none; selective (the attention core, SDPA,
    # reruns in the backward); full (a layer keeps only its input and reruns
    # its forward); or one mode per pipeline stage, [full, none]: only stage 0
    # recomputes. For LLaMA-3-8B at seq 8192 on one H100 (bench_layer) a layer
    # keeps 1090 MiB per microbatch: full keeps 65 MiB for 32 % more time,
    # selective 1 MiB less (the log-sum-exp; SDPA's fused kernels keep no
    # scores) for 5 % more. Applies to plans built from partition.*; null:
    # none there, and plan=auto or a plan file brings its own per stage.
    recompute: Any = None
    # The first N decoder layers of each stage recompute (Megatron's
    # --recompute-method block), or a list per stage; null: all of them.
    recompute_num_layers: Any = None
    # Validate every this many optimizer steps and after the last one:
    # forward only, through the same pipeline, on data.split's validation
    # documents or data.valid_path (Megatron's --eval-interval). None never
    # validates.
    eval_interval: Optional[int] = None
    # Global batches (global_batch_size sequences each) one validation reads.
    # Every validation reads the same ones, from the start of the validation
    # data, so successive val_loss values differ only by the weights.
    # Megatron's --eval-iters, and its default.
    eval_iters: int = 100
    # A step whose global loss or gradient norm is not finite is skipped on
    # every rank (no weight or optimizer-state change; logged in
    # metrics.jsonl). After this many consecutive skips the run stops with an
    # error naming the step; the last checkpoint stays the last good one
    # (Megatron's --check-for-nan-in-loss-and-grad stops at the first).
    max_skipped_steps: int = 5
    # Restarts of the whole job after a rank dies (torchrun's --max-restarts;
    # the local launcher's elastic agent takes it from here, a multi-node job
    # from launch_cluster.sh's HETPIPE_MAX_RESTARTS). Each restart resumes
    # from the latest complete checkpoint of checkpoint.save_dir. A device
    # that ran out of memory is not restarted: it would run out again.
    max_restarts: int = 0
    # Refuse, before step 1, a plan whose predicted memory per device does not
    # fit the device a stage's ranks got (hetpipe/training/memory_fit.py). The
    # prediction is the planner's model, which has so far under-predicted
    # measured peaks; false runs such a plan anyway.
    memory_check: bool = True
    # Signals that preempt the run: every rank finishes its step, a
    # checkpoint is written and the job exits 0. SIGTERM is what Slurm sends
    # before killing a preempted job (after KillWait, 30 s by default);
    # add SIGUSR1 for `sbatch --signal=USR1@<seconds>`.
    preemption_signals: List[str] = field(default_factory=lambda: ["SIGTERM"])

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "global_batch_size", "seq_length", "train_iters", "log_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be positive")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}")
        self._check_microbatches()
        value_checks.seed("train.seed", self.seed)
        if self.peak_tflops is not None:
            value_checks.positive("train.peak_tflops", self.peak_tflops)
        for name in ("profile_step", "memory_snapshot_step"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be a step number (1-based)")
        if self.eval_interval is not None and self.eval_interval < 1:
            raise ConfigError(f"train.eval_interval={self.eval_interval} must be positive (null never validates)")
        if self.eval_iters < 1:
            raise ConfigError(f"train.eval_iters={self.eval_iters} must be positive")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"train.precision={self.precision!r} must be one of {', '.join(PRECISIONS)}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ConfigError(f"train.fp8_recipe={self.fp8_recipe!r} must be one of {', '.join(FP8_RECIPES)}")
        check_attention_backend(self.attention_backend)
        elementwise_mode(self.fuse_elementwise)
        check_recompute(self.recompute, self.recompute_num_layers)
        if self.max_skipped_steps < 1:
            raise ConfigError(f"train.max_skipped_steps={self.max_skipped_steps} must be positive")
        if self.max_restarts < 0:
            raise ConfigError(f"train.max_restarts={self.max_restarts} must be >= 0")
        allowed = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")
        for name in self.preemption_signals:
            if name not in allowed:
                raise ConfigError(f"train.preemption_signals lists {name!r}; allowed: {', '.join(allowed)}")

    def _check_microbatches(self) -> None:
        count = self.global_batch_size // self.micro_batch_size
        if count > MAX_MICROBATCHES:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} is {count} microbatches of "
                f"train.micro_batch_size={self.micro_batch_size} per step; hetpipe runs at most {MAX_MICROBATCHES} "
                "(a rank holds its step as a list of actions per microbatch): a smaller global batch, or larger "
                "microbatches")


# How warmup counts its steps (OptimizerConfig.lr_warmup_style).
LR_WARMUP_STYLES = ("megatron", "one_ahead")


@dataclass
class OptimizerConfig:
    # AdamW peak learning rate, reached after warmup.
    lr: float = 3e-4
    # Floor of the decay.
    min_lr: float = 3e-5
    # Steps of linear warmup from lr_warmup_init to lr.
    lr_warmup_iters: int = 10
    # Learning rate of the first warmup step (Megatron's --lr-warmup-init):
    # warmup climbs linearly from it to `lr` over lr_warmup_iters steps.
    lr_warmup_init: float = 0.0
    # megatron: optimizer step s (0-based) of warmup trains at
    #   lr_warmup_init + (lr - lr_warmup_init) * s / lr_warmup_iters,
    # so the first step trains at lr_warmup_init and step lr_warmup_iters at lr
    # (OptimizerParamScheduler.get_lr in Megatron-LM's
    # megatron/core/optimizer_param_scheduler.py, whose num_steps counts the steps
    # already taken), and a hetpipe curve lines up with a Megatron one step for step.
    # one_ahead: hetpipe's convention before it matched Megatron's, one step ahead:
    #   lr_warmup_init + (lr - lr_warmup_init) * (s + 1) / lr_warmup_iters.
    # Decay is the same in both (from step lr_warmup_iters on).
    lr_warmup_style: str = "megatron"
    # Steps over which LR decays to min_lr; None means train_iters.
    lr_decay_iters: Optional[int] = None
    # cosine | linear | constant (Megatron's lr_decay_style)
    lr_decay_style: str = "cosine"
    # Decays every parameter with two or more dims - the linear layers' weights and the
    # embedding (the head too when untied) - as Megatron does; norms and biases are not decayed.
    weight_decay: float = 0.1
    # AdamW's decay of its first moment (the gradient's running mean).
    adam_beta1: float = 0.9
    # AdamW's decay of its second moment (the squared gradient's running mean).
    adam_beta2: float = 0.95
    # AdamW's epsilon, added to the denominator.
    adam_eps: float = 1e-8
    # Global gradient-norm clipping threshold; 0 disables.
    clip_grad: float = 1.0
    # ZeRO-1: shard AdamW's state over each stage's data-parallel ranks
    # (Megatron's --use-distributed-optimizer); no effect without DP.
    distributed: bool = False

    def __post_init__(self) -> None:
        for name in ("lr", "min_lr", "lr_warmup_init", "weight_decay", "clip_grad"):
            value_checks.in_range(f"optimizer.{name}", getattr(self, name), 0)
        for name in ("adam_beta1", "adam_beta2"):
            value_checks.in_range(f"optimizer.{name}", getattr(self, name), 0, 1)
            if getattr(self, name) == 1:
                raise ConfigError(f"optimizer.{name}=1.0 must be below 1: Adam's bias correction divides by 1 - beta")
        value_checks.positive("optimizer.adam_eps", self.adam_eps)
        # lr=0 (with min_lr=0) is a run that updates nothing: evaluation, or a check of a set-up.
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"optimizer: need 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if not 0 <= self.lr_warmup_init <= self.lr:
            raise ConfigError(f"optimizer.lr_warmup_init={self.lr_warmup_init} must be between 0 and "
                              f"optimizer.lr={self.lr}")
        if self.lr_warmup_style not in LR_WARMUP_STYLES:
            raise ConfigError(f"optimizer.lr_warmup_style={self.lr_warmup_style!r} must be one of "
                              f"{', '.join(LR_WARMUP_STYLES)}")
        if self.lr_decay_style not in ("cosine", "linear", "constant"):
            raise ConfigError(
                f"optimizer.lr_decay_style={self.lr_decay_style!r} must be cosine, linear or constant")
        if self.lr_warmup_iters < 0 or self.clip_grad < 0:
            raise ConfigError("optimizer.lr_warmup_iters and optimizer.clip_grad must be >= 0")


@dataclass
class DataConfig:
    # Prefix of a Megatron .bin/.idx pair, "demo" for the built-in corpus
    # (the Python standard library's source, tokenized on first use), or
    # Megatron's weighted blend "w1 prefix1 w2 prefix2 ..." so that a
    # Megatron --data-path carries over as it is. Weights are relative; each
    # global sample goes to the source furthest below its share (Megatron's
    # rule, no randomness), and each source keeps its own shuffled epochs.
    path: str = "demo"
    # "byte" (built-in byte-level tokenizer) or a local HF tokenizer directory;
    # must be the tokenizer the data was preprocessed with.
    tokenizer: str = "byte"
    # Megatron's --split "train,valid,test" weights, e.g. "969,30,1": each
    # source's documents are cut into contiguous ranges in that proportion,
    # train first, so validation never sees a training document; validation
    # reads the second range, nothing reads the third yet. None trains on
    # every document (the sample order of runs from before splits existed).
    # Quote it on the command line, data.split="'969,30,1'": hydra reads a
    # bare comma list as a sweep.
    split: Optional[str] = None
    # Validation data of its own instead of a split: a prefix or a blend, as
    # `path`, read whole; training then reads every document of `path`.
    valid_path: Optional[str] = None
    # Megatron's --eod-mask-loss: positions whose input token is the
    # tokenizer's end of document get no loss (the model is not asked for the
    # next document's first token), in training and validation. The loss is
    # then the mean over the global batch's counted tokens (hetpipe/training/token_loss.py):
    # the last stage counts its labels and all-reduces one integer over its DP
    # group per step. Off by default, as in Megatron; off, nothing is counted and
    # runs are bitwise what they were. scripts/bench_data_step.py, one rank
    # reading a whole 1024 x 4096 global batch in microbatches of 1 on the
    # shared 2-core machine (loaded, so inflated): the mask took the loader's
    # step from 43 to 54 ms and the count took 11 ms (per microbatch, so a
    # rank of DP 8 pays an eighth).
    eod_mask_loss: bool = False
    # Megatron's --reset-attention-mask: each packed document attends only
    # within itself (block-causal; an end-of-document token belongs to the
    # document it ends), through FlashAttention-4's varlen kernel or SDPA with
    # a block-causal mask (hetpipe/models/documents.py, models/attention.py).
    reset_attention_mask: bool = False
    # Megatron's --reset-position-ids: positions (RoPE) restart at 0 after
    # each end-of-document token. LLaMA 3 pretrained with both.
    reset_position_ids: bool = False

    def __post_init__(self) -> None:
        parse_data_path(self.path, "data.path")
        if self.split is not None:
            parse_split(self.split)
        if self.valid_path is not None:
            parse_data_path(self.valid_path, "data.valid_path")
            if self.split is not None:
                raise ConfigError("data.split and data.valid_path both choose the validation data; set one of them")


@dataclass
class LoggingConfig:
    # Mirror metrics to a wandb run (needs the wandb package).
    wandb: bool = False
    # The wandb project the run is filed under.
    wandb_project: str = "hetpipe"
    # offline: the run is written under the run directory (`wandb sync` uploads
    # it later). The default because training nodes often cannot reach wandb's
    # servers, where an online run would stall or fail at start. online:
    # streamed as it trains (needs `wandb login` or WANDB_API_KEY).
    wandb_mode: str = "offline"
    # Write training and validation scalars to <run dir>/tensorboard/ (needs
    # the tensorboard package).
    tensorboard: bool = False
    # Show a rich progress bar where the rank's output is a terminal (a torchrun
    # rank's; the local launcher's ranks print through pretrain.log's tee,
    # hetpipe/observe/console_log.py, and their lines carry the elapsed time and ETA).
    progress: bool = True
    # Each log line names the slowest rank's busy time per step (time not
    # spent waiting on pipeline neighbours) against its stage's median, so
    # a slow node in a mixed cluster shows (Megatron's straggler detector
    # reports min/max per rank the same way). Rides on the step's gradient-norm
    # exchange: no extra collective.
    straggler: bool = False
    # Rank 0 appends each step's global batch - the step, whether its update
    # was applied, every sample's global index and, for a blend, its source -
    # to <run dir>/samples.bin (header samples.json; hetpipe/observe/sample_log.py).
    # On by default because it is cheap: at a global batch of 1024 (seq 4096)
    # a record is 4105 bytes (5129 for a blend: 4 + 1 per sample), 0.4 GB per
    # 100k steps, and writing and flushing it took 0.08 ms per step
    # (scripts/bench_data_step.py on the shared 2-core machine, loaded, so
    # inflated), against 28-43 ms for the loader to read that batch and
    # seconds for such a step (LLaMA-3-8B: 2e17 model FLOPs, about 5 s on 64
    # GPUs at the 620 TFLOP/s each measured in docs/benchmarks.md).
    sample_log: bool = True

    def __post_init__(self) -> None:
        if self.wandb_mode not in ("offline", "online"):
            raise ConfigError(f"logging.wandb_mode={self.wandb_mode!r} must be offline or online")


@dataclass
class PartitionConfig:
    # Decoder layers per (virtual) stage in pipeline order, e.g. [15, 17];
    # the embedding joins the first stage and the head the last. A stage may
    # have 0: [31, 0] leaves the last stage the final norm, head and loss
    # (LLaMA-3-8B's head, forward and backward, costs about 2.2 layers on an
    # H100 at seq 8192: partitioner/profiles/h100.json). None splits the
    # layers evenly over the cluster's ranks.
    layers: Optional[List[int]] = None
    # gpipe | 1f1b | interleaved_1f1b | zb_h1 (zero bubble: backward split
    # into input and weight gradients, weights deferred into the bubbles;
    # 1F1B's peak memory, a third of its bubble; see hetpipe.pipeline.schedules) |
    # zb_v (zero bubble with two chunks per rank in a V, num_chunks=2: rank 0
    # holds the first and the last stage; 1F1B's peak memory on every rank,
    # a sixth of its bubble; see hetpipe.pipeline.schedule_zbv)
    schedule: str = DEFAULT_SCHEDULE
    # Model chunks per rank (virtual stages) for interleaved_1f1b; 2 for zb_v.
    num_chunks: int = 1
    # Tensor-parallel degree of every vendor group, or one per group in the
    # cluster's group order (tp_per_group=[2,1]: TP2 on the first group, TP1
    # on the second). A group's pipeline stages = its ranks / (TP x DP).
    tp: int = 1
    # One TP degree per group, in the cluster's group order (see tp); None: tp for every group.
    tp_per_group: Optional[List[int]] = None
    # Data-parallel degree: the same for every stage (each stage is replicated
    # dp times inside its vendor group).
    dp: int = 1
    # Context-parallel degree of every vendor group: each microbatch's sequence
    # split over cp ranks of a stage (rank i holds chunks i and 2cp-1-i of 2cp,
    # which balances causal attention; hetpipe.parallel.context). A stage has
    # TP x CP x DP ranks (TP fastest, then CP, then DP, Megatron's order).
    # train.seq_length must be a multiple of 2 x cp.
    cp: int = 1
    # One CP degree per group, in the cluster's group order (see tp_per_group);
    # None: cp for every group. The stage boundary carries CP rank i's slice to
    # CP rank i of the next stage, so every group must use the same degree.
    cp_per_group: Optional[List[int]] = None
    # How attention reaches the other CP ranks' keys: allgather (K/V gathered
    # once per layer, the LLaMA 3 paper's choice) or ring (K/V blocks passed
    # round the group, softmax merged by log-sum-exp; blocks in plain torch).
    cp_method: str = "allgather"
    # Megatron sequence parallelism inside TP groups (norms on sequence shards).
    sequence_parallel: bool = False
    # Gradient-reduction bucket size for DP (MiB), reduced while backward runs.
    grad_bucket_mb: float = 25.0
    # Boundary receives the engine keeps posted ahead of use (1: each receive
    # is posted when the schedule reaches it, as Megatron does). None (auto): 1
    # on ranks with an NCCL/RCCL boundary - a posted NCCL receive is a kernel
    # holding SMs until its data arrives, which slows the stage's GEMMs
    # (docs/benchmarks.md, "bf16 mode, LLaMA-3-8B PP2 on 2x NVIDIA H200") - and
    # 2 elsewhere (hetpipe's channels move bytes by copy engine or host
    # threads, so receiving early costs no SMs).
    recv_ahead: Optional[int] = None

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1 or (self.tp_per_group is not None and min(self.tp_per_group, default=0) < 1):
            raise ConfigError(f"partition.tp={self.tp}, tp_per_group={self.tp_per_group} and dp={self.dp} "
                              "must be positive")
        if self.cp < 1 or (self.cp_per_group is not None and min(self.cp_per_group, default=0) < 1):
            raise ConfigError(f"partition.cp={self.cp} and cp_per_group={self.cp_per_group} must be positive")
        if self.sequence_parallel and max(self.cp_per_group or [self.cp]) > 1:
            raise ConfigError("partition.sequence_parallel=true with partition.cp > 1 is not supported: "
                              "CP already splits the sequence; set partition.sequence_parallel=false")
        if self.cp_method not in ("allgather", "ring"):
            raise ConfigError(f"partition.cp_method={self.cp_method!r} must be allgather or ring")
        if self.recv_ahead is not None and self.recv_ahead < 1:
            raise ConfigError(f"partition.recv_ahead={self.recv_ahead} must be at least 1")
        value_checks.positive("partition.grad_bucket_mb", self.grad_bucket_mb)


@dataclass
class PretrainConfig:
    model: ModelConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    # None: the plan comes from `partition`; "auto": the cost-model planner
    # picks the split (with `planner` settings); a path: a plan.yaml written by
    # `python -m hetpipe.plan`.
    plan: Optional[str] = None
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        if self.train.seq_length > self.model.max_position_embeddings:
            raise ConfigError(
                f"train.seq_length={self.train.seq_length} exceeds model {self.model.name!r}'s "
                f"max_position_embeddings={self.model.max_position_embeddings}")
        for i, group in enumerate(self.cluster.groups):
            if group.precision is not None and group.precision not in PRECISIONS:
                raise ConfigError(f"cluster.groups.{i}.precision={group.precision!r} must be one of "
                                  f"{', '.join(PRECISIONS)} (or null: train.precision)")
        decay = self.optimizer.lr_decay_iters
        if decay is not None and decay < self.optimizer.lr_warmup_iters:
            raise ConfigError(
                f"optimizer.lr_decay_iters={decay} is shorter than lr_warmup_iters="
                f"{self.optimizer.lr_warmup_iters}")


def register_configs() -> None:
    """Put the schemas into hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="pretrain_schema", node=PretrainConfig)
    register_help_resolver()
    if not OmegaConf.has_resolver("hetpipe.model_name"):
        # Names run directories; tolerates a config without a model so that
        # hydra can still report that problem cleanly.
        OmegaConf.register_new_resolver("hetpipe.model_name", _model_name)


def _model_name(*, _root_: DictConfig) -> str:
    """The model's name for the run directory; without a preset, the name of
    the checkpoint.load_hf directory the model will be read from."""
    if not OmegaConf.is_missing(_root_, "model"):
        return _root_.model.name
    load_hf = OmegaConf.select(_root_, "checkpoint.load_hf", default=None)
    return Path(load_hf).name if load_hf else "no-model"


def _model_from_hf(cfg: DictConfig) -> DictConfig:
    """``cfg`` with its model read from checkpoint.load_hf's config.json, where
    one is set: the HF directory names the model, so a preset is optional and,
    when given too, must describe the same model (first differing field named)."""
    load_hf = OmegaConf.select(cfg, "checkpoint.load_hf", default=None)
    if load_hf is None:
        return cfg
    # torch and transformers: imported only here, for a run that reads HF weights.
    from hetpipe.checkpoint.compat import config_differences
    from hetpipe.checkpoint.hf_import import read_hf_config

    hf_model = read_hf_config(Path(load_hf))
    if OmegaConf.is_missing(cfg, "model"):
        return OmegaConf.merge(cfg, {"model": hf_model.to_dict()})
    try:
        given = OmegaConf.to_object(cfg.model)
    except Exception as exc:  # noqa: BLE001 - OmegaConf wraps errors raised in __post_init__
        raise config_error_from(exc) from None
    differences = config_differences(hf_model.to_dict(), given)
    if differences:
        raise ConfigError(f"model={given.name} differs from checkpoint.load_hf={load_hf}'s config.json: "
                          f"{differences[0]} (drop +model to take the HF config)")
    return cfg


def resolve(cfg: DictConfig | dict[str, Any], schema: type = PretrainConfig) -> Any:
    """Turn a composed config into checked ``schema`` objects, or raise ConfigError."""
    if isinstance(cfg, dict):
        cfg = OmegaConf.merge(OmegaConf.structured(schema), cfg)
    if schema is PretrainConfig:
        cfg = _model_from_hf(cfg)
    if OmegaConf.is_missing(cfg, "model"):
        raise ConfigError(f"no model chosen: add +model=NAME (one of {', '.join(preset_names())}) "
                          "or checkpoint.load_hf=DIR")
    try:
        return OmegaConf.to_object(cfg)
    except Exception as exc:  # noqa: BLE001 - OmegaConf wraps errors raised in __post_init__
        raise config_error_from(exc) from None
