"""The planner's settings (``planner.*`` in ``pretrain`` and ``python -m hetpipe.plan``).

A config schema of its own, apart from the solver, so that the runtime's
config schemas (``hetpipe.schema.pretrain_config``, ``hetpipe.plan``) can hold a
``planner`` field without importing the search, and the search never imports
them back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import hetpipe.errors.value_checks as value_checks
from hetpipe.errors import ConfigError
from hetpipe.models.train_modes import RECOMPUTE_MODES
from hetpipe.partitioner.cost import NetworkConfig
from hetpipe.partitioner.schedule_model import schedules_for

TRANSPORT_MODELS = ("auto", "direct", "cpu_forwarding")
PLANNER_RECOMPUTE = ("auto",) + RECOMPUTE_MODES


@dataclass
class PlannerConfig:
    # Fraction of dense peak reached by every device's compute; None takes the
    # catalog's per-device figure. Ignored for devices with a profile.
    efficiency: Optional[float] = None
    # Profile JSON from `python -m hetpipe.plan profile`; measured costs replace
    # the analytic ones for the device types and shapes it covers.
    profile: Optional[str] = None
    # Also use the profiles measured on our machines (partitioner/profiles/:
    # H100 and H200, LLaMA-3-8B and Qwen2-7B at seq 4096 and 8192). With the
    # analytic costs alone the planner predicted 8-9 % long steps on two H100s
    # (docs/benchmarks.md); a profile entry for the device and shape replaces them.
    builtin_profiles: bool = True
    # Usable fraction of device memory (allocator fragmentation, the CUDA/HIP
    # context and communicator buffers take the rest).
    memory_headroom: float = 0.9
    # Shard Adam's state over DP (Megatron's --use-distributed-optimizer).
    distributed_optimizer: bool = False
    # Activation recomputation (hetpipe.models.recompute). auto: each stage
    # gets the cheapest that fits its devices' memory of none, selective, and
    # full recomputation of its first N layers (N as small as fits); none,
    # selective or full (every layer): that mode on every stage. Off
    # (none) under train.compile, which the runtime does not recompute with.
    recompute: str = "auto"
    # Pipeline schedule (partitioner/schedule_model.py): auto takes the one
    # with the shortest predicted step that fits memory, of 1f1b, zb_h1, zb_v
    # (two chunks per rank in a V, split by partitioner/v_split.py) and gpipe
    # (the zero-bubble ones never with full recomputation); or one of them.
    # auto by default, as measured: LLaMA-3-8B PP2 on two H100s (seq 4096,
    # 16 microbatches, bf16-pure) ran 1f1b at 552.5-554.2 TFLOP/s/GPU, zb_h1
    # at 572.9-574.4 (1.034-1.040x) and zb_v at the planner's own split
    # [9,11,6,6] at 575.6 (1.041x), and plan=auto under auto chose that zb_v
    # split (575.4); on two H200s (seq 8192, 32 microbatches) 1f1b 619.6,
    # zb_h1 628.4 and plan=auto (zb_v [8,8,9,7]) 628.1. `plan` prints every
    # schedule's predicted step either way.
    schedule: str = "auto"
    # Fix the TP degree of every group; None searches the divisors of the head
    # counts that fit in a node.
    tp: Optional[int] = None
    # Fix the DP degree; None searches it.
    dp: Optional[int] = None
    # Fix the context-parallel degree of every group; None searches the
    # divisors of the groups' ranks per node that cut train.seq_length into
    # 2 x CP equal chunks (partitioner/context_plan.py).
    cp: Optional[int] = None
    # Fix the pipeline stages per group, in the cluster's group order.
    stages: Optional[List[int]] = None
    # Fix the order of the groups along the pipeline (group names).
    group_order: Optional[List[str]] = None
    # Microbatch sizes to consider; None keeps train.micro_batch_size.
    micro_batch_sizes: Optional[List[int]] = None
    # How cross-vendor boundaries are costed: direct (device-direct), or
    # cpu_forwarding; auto follows cluster.transport.kind as the runtime
    # resolves it (auto and tcp are CPU-forwarding today).
    transport: str = "auto"
    # NIC, TCP and latency figures behind the boundary, TP and DP costs.
    network: NetworkConfig = field(default_factory=NetworkConfig)
    # Catalog overrides and extra devices: {H200: {efficiency: 0.6}, NEW: {...}}.
    catalog: Dict[str, Any] = field(default_factory=dict)
    # Device memory (GiB) of a group, by group name, in place of its catalog
    # entry's: for groups of one device type that differ in memory (an
    # A100-40GB node beside A100-80GB ones), or CPU ranks standing in for a
    # small GPU in an emulated cluster ({amd: 0.02}).
    memory_gib: Dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.memory_headroom <= 1:
            raise ConfigError(f"planner.memory_headroom={self.memory_headroom} must be in (0, 1]")
        if self.efficiency is not None and not 0 < self.efficiency <= 1:
            raise ConfigError(f"planner.efficiency={self.efficiency} must be in (0, 1]")
        if self.transport not in TRANSPORT_MODELS:
            raise ConfigError(f"planner.transport={self.transport!r} is not one of {TRANSPORT_MODELS}")
        if self.recompute not in PLANNER_RECOMPUTE:
            raise ConfigError(f"planner.recompute={self.recompute!r} is not one of {', '.join(PLANNER_RECOMPUTE)}")
        schedules_for(self.schedule, self.recompute)  # raises on an unknown or impossible choice
        for group, gib in (self.memory_gib or {}).items():
            value_checks.finite(f"planner.memory_gib.{group}", gib)
            if not gib > 0:
                raise ConfigError(f"planner.memory_gib.{group}={gib} must be a positive number of GiB")
        for name in ("tp", "dp", "cp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"planner.{name}={value} must be positive")
