"""Device memory: a plan that will not fit is refused before step 1; an out-of-memory that still happens is one line.

Before step 1, each pipeline stage's predicted peak (the planner's memory
model applied to the plan as it will run, :mod:`hetpipe.partitioner.plan_memory`)
is compared with the memory of the device each of its ranks got. The local
launcher checks every rank's GPU before starting any rank; each rank checks
its own device again once the job's watch exists, which is what covers ranks
started by torchrun on other nodes. A plan that does not fit is refused with
one line naming the stage, both figures and what would fit (exit 2, every
rank ending with the same line: :mod:`hetpipe.launch.job_watch`).

CPU ranks use host RAM: a group given a capacity, ``planner.memory_gib.<group>``
(the planner's stand-in for the small GPU an emulated group plays), is checked
against it here, so an emulated cluster can rehearse the refusal; the others
are checked together against the host's available memory
(:mod:`hetpipe.training.host_memory_fit`).

An out-of-memory error that still happens (torch's OutOfMemoryError) becomes
one line naming the rank, stage, step and the device's allocated and total
GiB, posted as the job's cause and printed *before* the rank unwinds
(``JobWatch.announce``): a rank whose teardown then blocks (an NCCL
communicator of a peer mid-transfer) can no longer leave its neighbour
waiting on the pipeline boundary with nothing printed - the watch threads of
every rank, this one included, read the cause within a poll (0.25 s) and end
their rank with it. It exits with its own status, 4
(``errors.EXIT_OUT_OF_MEMORY``), which the launcher does not restart: the
same plan runs out again at the same step.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from hetpipe.errors import EXIT_OUT_OF_MEMORY, ConfigError, OutOfDeviceMemory
from hetpipe.partitioner.plan_data import Plan
from hetpipe.partitioner.plan_memory import planned_capacity_gib, predicted_memory_gib

GIB = 2**30
NOTE_KEY = "predicted_memory_gib"
# The planner's memory model (partitioner/schedule_model.py memory_rows) predicts
# every peak measured so far at or above it: 0.1 % to 4.7 % over the allocated
# peaks of 1f1b, zb_h1 and zb_v on two H200s (LLaMA-3-8B, seq 8192) and two
# H100s (seq 4096; docs/partitioner.md, "Measured against predicted"). What it
# does not count is the CUDA context (518 MiB on an H200, seen through
# mem_get_info), NCCL's buffers and the allocator's fragmentation (reserved
# above allocated). So a stage is refused when its prediction plus a 3 %
# margin for those exceeds the device; one within 10 % of the device gets a
# note: there is little room left for them.
ALLOCATOR_MARGIN = 1.03
NOTE_MARGIN = 1.10
# torch's CUDA/HIP message: "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of ...".
_TRIED = re.compile(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)")


@dataclass(frozen=True)
class Capacity:
    """A device's memory, and what to call it in a line."""
    gib: float
    device: str


def fits(predicted_gib: float, capacity_gib: float) -> bool:
    """Whether a stage predicted to need ``predicted_gib`` fits a device of ``capacity_gib``."""
    return predicted_gib * ALLOCATOR_MARGIN <= capacity_gib


def may_not_fit(predicted_gib: float, capacity_gib: float) -> bool:
    """Fits, but with less than 10 % of the device to spare."""
    return fits(predicted_gib, capacity_gib) and predicted_gib * NOTE_MARGIN > capacity_gib


# -- predictions ---------------------------------------------------------------------------
def with_prediction(plan: Plan, cfg: Any) -> Plan:
    """``plan`` carrying each pipeline stage's predicted peak GiB per device in its notes
    (``predicted_memory_gib``), for the ranks and the run's plan.yaml; unchanged
    where the cost model cannot price it."""
    predicted = predict(plan, cfg)
    if predicted is None:
        return plan
    notes = {**plan.notes, NOTE_KEY: [float(f"{g:.4g}") for g in predicted]}
    return dataclasses.replace(plan, notes=notes)


def predict(plan: Plan, cfg: Any) -> Optional[list[float]]:
    return predicted_memory_gib(plan, cfg.model, cfg.cluster, cfg.train, cfg.planner, cfg.partition.cp_method)


def predicted_of(plan: Plan, stage: int) -> Optional[float]:
    """The prediction the plan carries for pipeline stage ``stage``, if any."""
    predicted = plan.notes.get(NOTE_KEY) if plan.notes else None
    return None if predicted is None else float(predicted[stage])


# -- capacities ----------------------------------------------------------------------------
def declared_capacity(cfg: Any, group: Any) -> Optional[Capacity]:
    """The memory declared for an emulated (CPU) group's devices, if any."""
    gib = (cfg.planner.memory_gib or {}).get(group.name)
    return Capacity(gib, f"emulated device (planner.memory_gib.{group.name})") if gib else None


def local_capacity(cfg: Any, rank: int) -> Optional[Capacity]:
    """Rank ``rank``'s device as the local launcher sees it (local rank = rank on one node).
    Device properties, not mem_get_info: on an H200 the properties left no process on
    the GPU, mem_get_info a 518 MiB context the launcher would hold all run long."""
    group = cfg.cluster.group_of(rank)[1]
    if group.on_cpu:
        return declared_capacity(cfg, group)
    if not torch.cuda.is_available() or rank >= torch.cuda.device_count():
        return None  # the rank itself says it has no GPU (Topology)
    props = torch.cuda.get_device_properties(rank)
    return Capacity(props.total_memory / GIB, props.name)


def rank_capacity(cfg: Any, group: Any, device: torch.device) -> Optional[Capacity]:
    """This rank's device. (Later from the roll call's detected device, hetpipe/devices/facts.py.)"""
    if device.type == "cpu":
        return declared_capacity(cfg, group)
    total = torch.cuda.mem_get_info(device)[1]
    return Capacity(total / GIB, torch.cuda.get_device_name(device))


# -- the check -------------------------------------------------------------------------------
def check_local_fit(plan: Plan, cfg: Any) -> None:
    """The local launcher's check of every rank's device, before any rank starts."""
    for stage, st in enumerate(plan.stages[:plan.pipeline_size]):
        for rank in st.ranks:
            check_stage(plan, cfg, stage, rank, local_capacity(cfg, rank))


def check_stage(plan: Plan, cfg: Any, stage: int, rank: int, capacity: Optional[Capacity]) -> Optional[str]:
    """Refuse (ConfigError) a stage predicted not to fit ``capacity``; a note's text
    for one that may not, else None. Nothing to check without both figures."""
    predicted = predicted_of(plan, stage)
    if predicted is None or capacity is None or not cfg.train.memory_check:
        return None
    if not fits(predicted, capacity.gib):
        raise ConfigError(misfit_line(plan, cfg, stage, rank, predicted, capacity))
    if may_not_fit(predicted, capacity.gib):
        return (f"stage {stage} is predicted to need {_gib(predicted)} GiB of its {capacity.device}'s "
                f"{_gib(capacity.gib)} GiB: less than {NOTE_MARGIN - 1:.0%} is left for the CUDA context, "
                "communicator buffers and the allocator's fragmentation, which it may run out of memory on")
    return None


def misfit_line(plan: Plan, cfg: Any, stage: int, rank: int, predicted: float, capacity: Capacity) -> str:
    group = plan.stages[stage].group
    # What would fit is asked of the planner's model again, a few milliseconds a try.
    return (f"stage {stage} (rank {rank}, group {group}) is predicted to need {_gib(predicted)} GiB per device "
            f"but its {capacity.device} has {_gib(capacity.gib)} GiB ({_gib(capacity.gib / ALLOCATOR_MARGIN)} "
            f"after a {ALLOCATOR_MARGIN - 1:.0%} allocator margin): {_what_fits(plan, cfg, stage, capacity)} "
            "(train.memory_check=false runs it anyway)")


def _what_fits(plan: Plan, cfg: Any, stage: int, capacity: Capacity) -> str:
    """The way out for this plan's source: an explicit split, plan=auto, or a plan file."""
    group = plan.stages[stage].group
    if cfg.plan == "auto":
        planned = planned_capacity_gib(cfg.model, cfg.cluster, cfg.train, cfg.planner, group)
        made_for = f" for {_gib(planned)} GiB per device" if planned is not None else ""
        index = [g.name for g in cfg.cluster.groups].index(group)
        return (f"plan=auto planned{made_for}; set cluster.groups.{index}.device_type to the devices it has "
                f"(auto detects them) or planner.memory_gib.{group}={capacity.gib:.1f}")
    if cfg.plan is not None:
        return f"plan {cfg.plan} was made for other devices: try plan=auto (which plans for the detected device)"
    others = "another partition.layers split, " + \
        ("a smaller train.micro_batch_size, " if cfg.train.micro_batch_size > 1 else "") + \
        "or plan=auto (which plans for the detected device)"
    mode, predicted, fit = _least_recompute(plan, cfg, group, capacity)
    if predicted is None:
        return f"try train.recompute=selective or full, {others}"
    if not fit:
        return f"even train.recompute={mode} is predicted to need {_gib(predicted)} GiB: try {others}"
    return f"try train.recompute={mode} (predicted {_gib(predicted)} GiB), {others}"


def _least_recompute(plan: Plan, cfg: Any, group: str, capacity: Capacity
                     ) -> tuple[str, Optional[float], bool]:
    """The least recomputation of every stage that brings ``group``'s stages inside
    ``capacity`` (their devices are alike): (mode, its largest prediction there, True);
    else the leanest mode's (mode, prediction, False); no prediction: (mode, None, False)."""
    modes = ("selective",) if plan.spec.split_backward else ("selective", "full")
    physical = plan.stages[:plan.pipeline_size]  # predictions are per pipeline rank
    largest: Optional[float] = None
    for mode in modes:
        stages = [dataclasses.replace(s, recompute=mode, recompute_num_layers=None) for s in plan.stages]
        predicted = predict(dataclasses.replace(plan, stages=stages), cfg)
        if predicted is None:
            return mode, None, False
        largest = max(p for p, s in zip(predicted, physical) if s.group == group)
        if fits(largest, capacity.gib):
            return mode, largest, True
    return modes[-1], largest, False


# -- out of memory at run time ----------------------------------------------------------------
class Progress:
    """Where a rank is, for the out-of-memory line."""

    def __init__(self) -> None:
        self.step: Optional[int] = None

    def describe(self) -> str:
        return "before step 1" if self.step is None else f"at step {self.step}"


@contextmanager
def out_of_memory_reported(topo: Any, progress: Progress, plan: Plan, cfg: Any) -> Iterator[None]:
    """Turn torch's OutOfMemoryError inside into the job's one line (:class:`OutOfDeviceMemory`),
    posted to the job's watch at once (see the module)."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        raise out_of_memory(exc, topo, progress, plan, cfg) from None


def out_of_memory(exc: BaseException, topo: Any, progress: Progress, plan: Plan, cfg: Any) -> OutOfDeviceMemory:
    """The one line for ``exc``, posted as the job's cause now; the error to raise with it."""
    line = out_of_memory_line(exc, topo.rank, topo.pp_rank, progress.describe(), topo.device,
                              predicted_of(plan, topo.pp_rank), cfg)
    if topo.watch is not None:
        topo.watch.announce(line, EXIT_OUT_OF_MEMORY)
    return OutOfDeviceMemory(line)


def out_of_memory_line(exc: BaseException, rank: int, stage: int, where: str, device: torch.device,
                       predicted: Optional[float], cfg: Any) -> str:
    allocated, total, source = device_memory(device)
    tried = _TRIED.search(str(exc))
    attempt = f", trying to allocate {tried.group(1)} more" if tried else ""
    forecast = f"; the plan predicted {_gib(predicted)} GiB" if predicted is not None else ""
    restarts = cfg.train.max_restarts
    restart = f"; not restarted (train.max_restarts={restarts}): it would run out again" if restarts else ""
    return (f"rank {rank} (stage {stage}) ran out of device memory {where}: {_gib(allocated)} GiB allocated of "
            f"{_gib(total)} GiB total ({source}){attempt}{forecast}: {_oom_hint(cfg)}{restart}")


def _oom_hint(cfg: Any) -> str:
    if cfg.plan == "auto":
        return ("plan with more room: planner.memory_headroom below its "
                f"{cfg.planner.memory_headroom:g}, or planner.recompute=selective or full")
    if cfg.plan is not None:
        return "recompute more in the plan's stages, or plan=auto (which plans for the detected device)"
    return ("try train.recompute=selective or full, a smaller train.micro_batch_size, another partition.layers "
            "split, or plan=auto (which plans for the detected device)")


def device_memory(device: torch.device) -> tuple[float, float, str]:
    """(allocated GiB, total GiB, where the figures come from) of this rank's device. A CPU
    rank's device is host RAM: its resident set of the machine's memory."""
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        return (torch.cuda.memory_allocated(device) / GIB, total / GIB,
                f"{torch.cuda.get_device_name(device)}; {_gib(torch.cuda.memory_reserved(device) / GIB)} GiB "
                "reserved by torch's allocator")
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        resident = int(Path("/proc/self/statm").read_text().split()[1]) * page
    except (OSError, ValueError, IndexError):
        resident = 0
    return resident / GIB, os.sysconf("SC_PHYS_PAGES") * page / GIB, "CPU: resident set of host memory"


def _gib(x: float) -> str:
    """126.9, 79.1, 0.0123: a tenth of a GiB for devices, three digits for emulated ones."""
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def write_peak_memory(run_dir: Path, rank: int, device: torch.device) -> None:
    """Each GPU rank's peak memory, for benchmark reports (``memory_rank<r>.json``), and
    how often the caching allocator found the device full and freed its cache to retry
    (``alloc_retries``: each retry synchronizes the device, so a run near capacity slows)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    gib = 2**30
    record = {"rank": rank, "device": str(device),
              "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
              "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / gib,
              "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0)}
    (run_dir / f"memory_rank{rank}.json").write_text(json.dumps(record) + "\n")
