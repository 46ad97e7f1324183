"""What the partitioner reads from the runtime's configs, named field by field.

The planner and the plan resolver need a handful of training and partition
settings. Naming exactly those here, as protocols, keeps the partitioner from
importing the runtime's config schemas (``hetpipe.schema.pretrain_config`` holds a
``PlannerConfig`` and so imports the partitioner); ``TrainConfig``,
``PartitionConfig`` and ``PretrainConfig`` satisfy them as they are, and a
caller without them (a benchmark, a test) can pass any object with these fields.
"""
from __future__ import annotations

from typing import Any, List, Optional, Protocol

from hetpipe.devices.cluster import ClusterConfig
from hetpipe.models.model_config import ModelConfig
from hetpipe.partitioner.planner_config import PlannerConfig


class TrainShape(Protocol):
    """The training settings that shape costs, memory and the batch arithmetic."""

    micro_batch_size: int
    global_batch_size: int
    seq_length: int
    # The trainer's precision mode, fusion and compilation set bytes per
    # weight and activation (cost.Precision.for_device).
    precision: str
    fuse_elementwise: Any  # null/true/false or auto/compile/liger/none (models/layers.py)
    compile: bool
    # What a zero-bubble W holds (cost.weight_pass_bytes); read with a
    # default of True (the trainer's) where an object lacks it.
    grad_accumulation_fusion: bool
    # Activation recomputation of a plan built from ``partition``: a mode or
    # one per stage, and the layers it covers (hetpipe.models.recompute).
    recompute: Any
    recompute_num_layers: Any


class PartitionRequest(Protocol):
    """Explicit parallelism and split overrides (``partition.*``)."""

    layers: Optional[List[int]]
    schedule: str
    num_chunks: int
    tp: int
    tp_per_group: Optional[List[int]]
    dp: int
    # Context parallelism (partition.cp, cp_per_group); read with getattr, default 1.
    cp: int
    cp_per_group: Optional[List[int]]


class PlanRequest(Protocol):
    """Everything a run's config says about its plan (``PretrainConfig`` has it)."""

    model: ModelConfig
    cluster: ClusterConfig
    train: TrainShape
    partition: PartitionRequest
    # None: from ``partition``; "auto": the planner; otherwise a plan.yaml path.
    plan: Optional[str]
    planner: PlannerConfig
