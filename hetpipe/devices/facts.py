"""The device each rank really runs on, and the check that the plan was made for it.

A cluster config's ``device_type`` is a claim; the planner believes it. A
run of ``plan=auto cluster=gpu2_homogeneous`` - which declared H200 - on two
H100s planned 126.9 GiB per device while its banner said "NVIDIA H100 80GB
HBM3", and died of OOM at step 2. So every rank measures its device
(:func:`device_facts`) and publishes the facts at the start-up roll call
(:mod:`hetpipe.launch.nodes`); every rank then checks every rank's facts against the
type its group was planned for (:func:`check_devices`), and a launcher that
starts the ranks on its own machine checks before starting any
(:func:`check_local_devices`). A mismatch is one line naming both, exit 2,
unless ``cluster.allow_device_mismatch`` asks to plan for the declared type on
purpose. An nvidia or amd group of ``device_type: auto`` whose rank finds no GPU
stops the same way (it would otherwise train on the CPU unnoticed) unless
``cluster.allow_cpu`` asks for a CPU run of that GPU config. ``device_type: auto`` resolves through the same detection
(:func:`local_device_type`), in the planner and in the ranks alike.
"""
from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Mapping, Optional

from hetpipe.devices.cluster import ClusterConfig, GroupConfig
from hetpipe.errors import ConfigError
from hetpipe.devices.catalog import DeviceSpec, detect_device_type
from hetpipe.devices.vendor import detect_vendor

# torch is imported inside the functions that measure a device: the planner reads only
# local_device_type's catalog answer for declared types, and plans without torch.
if TYPE_CHECKING:
    import torch

    from hetpipe.partitioner.plan_data import Plan

GIB = 2**30


@dataclass(frozen=True)
class DeviceFacts:
    """What one rank runs on, as its own runtime reports it."""

    name: str  # 'NVIDIA H100 80GB HBM3', or 'cpu'
    vendor: str  # nvidia | amd | cpu: the torch build's, not the config's declaration
    runtime: str  # 'CUDA 13.0', 'ROCm 6.4' or 'cpu'
    torch: str  # torch.__version__
    arch: str  # 'sm_90' (CUDA), 'gfx942' (ROCm), the host's machine ('x86_64') on CPU
    total_gib: float
    free_gib: Optional[float]  # None: not measured (a launcher opens no GPU context)
    device_type: str  # catalog key; '' for a device the catalog does not know

    @classmethod
    def from_dict(cls, values: Mapping) -> DeviceFacts:
        return cls(**{k: values[k] for k in cls.__dataclass_fields__})

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """``'NVIDIA H100 80GB HBM3' (H100)``."""
        return f"{self.name!r} ({self.device_type or 'not in the catalog'})"


def device_facts(device: Optional[torch.device] = None, catalog: Optional[Mapping[str, DeviceSpec]] = None,
                 free: bool = True) -> DeviceFacts:
    """The facts of ``device`` (a CUDA/HIP device, or the CPU; default: the current GPU if any).
    ``free=False`` leaves free memory unmeasured: measuring it opens a context on the GPU."""
    import torch

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
    if device.type == "cpu":
        return _cpu_facts()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _gpu_facts(index, catalog, free)


def _cpu_facts() -> DeviceFacts:
    import torch

    total, available = host_memory_gib()
    return DeviceFacts("cpu", "cpu", "cpu", torch.__version__, platform.machine(), total, available, "CPU")


def _gpu_facts(index: int, catalog: Optional[Mapping[str, DeviceSpec]], free: bool) -> DeviceFacts:
    import torch

    props = torch.cuda.get_device_properties(index)
    free_gib = torch.cuda.mem_get_info(index)[0] / GIB if free else None
    total = props.total_memory / GIB
    name, arch = torch.cuda.get_device_name(index), gpu_arch(index)
    kind = detect_device_type(name, catalog, arch=arch, memory_gib=total, compute_units=props.multi_processor_count)
    vendor = detect_vendor()
    return DeviceFacts(name, vendor, runtime_build(), torch.__version__, arch, total, free_gib, kind)


def gpu_arch(index: int) -> str:
    """'gfx942' on ROCm (gcnArchName without its feature flags), 'sm_90' on CUDA."""
    import torch

    if torch.version.hip:
        return torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def runtime_build() -> str:
    """The GPU runtime this torch was built for: 'CUDA 13.0', 'ROCm 6.4', or 'cpu'."""
    import torch

    if torch.version.hip:
        return "ROCm " + ".".join(torch.version.hip.split(".")[:2])
    return f"CUDA {torch.version.cuda}" if torch.version.cuda else "cpu"


def host_memory_gib() -> tuple[float, float]:
    """(total, available) host memory in GiB: /proc/meminfo's MemTotal and MemAvailable."""
    try:
        with open("/proc/meminfo") as f:
            kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f if ":" in line)}
        return kib["MemTotal"] / 2**20, kib.get("MemAvailable", kib.get("MemFree", 0)) / 2**20
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
        return total, total


def local_device_type(catalog: Optional[Mapping[str, DeviceSpec]] = None) -> tuple[str, str]:
    """(catalog key, runtime name) of this machine's device under ``device_type: auto``:
    its current GPU, else the CPU. The key is '' for a GPU the catalog does not know."""
    facts = device_facts(catalog=catalog, free=False)
    return facts.device_type, facts.name


# -- the check ---------------------------------------------------------------------------------------


def planned_type(group: GroupConfig, plan: Optional[Plan] = None) -> tuple[Optional[str], str]:
    """(the device type ``group`` is planned for, where that comes from); None: ``auto``, which
    each rank resolves from its own device. An ``auto`` group's plan from ``plan=auto`` or
    ``python -m hetpipe.plan`` records the type it was made for (notes.device_types)."""
    if group.device_type != "auto":
        return group.device_type, "declares"
    notes = (getattr(plan, "notes", None) or {}).get("device_types") or {}
    return notes.get(group.name), "plan"


def check_devices(cluster: ClusterConfig, devices: Mapping[int, DeviceFacts],
                  plan: Optional[Plan] = None) -> list[str]:
    """Refuse, in one line, the first rank whose device is not the type its group is planned for.

    ``devices`` maps ranks to their facts (ranks without facts are not checked).
    With ``cluster.allow_device_mismatch`` a mismatch between GPUs is a warning
    instead, one per group (returned); a GPU type on a CPU never runs, nor an ``auto`` GPU
    group without ``cluster.allow_cpu`` (:func:`needs_gpu`)."""
    warnings = []
    for index, group in enumerate(cluster.groups):
        rank = _first_cpu_rank(cluster, index, devices)
        if rank is not None:
            raise ConfigError(no_gpu_line(cluster, index, f"rank {rank} finds none"))
        expected, source = planned_type(group, plan)
        rank = _first_mismatch(cluster.group_ranks(index), expected, devices)
        if rank is None:
            continue
        line = _mismatch_line(group, expected, source, rank, devices[rank])
        if not cluster.allow_device_mismatch or devices[rank].vendor == "cpu":
            raise ConfigError(line + _remedy(index, group, expected, source, devices[rank]))
        warnings.append(f"{line}: going on for {expected}, as cluster.allow_device_mismatch=true asks")
    return warnings


def needs_gpu(cluster: ClusterConfig, group: GroupConfig) -> bool:
    """Whether ``group`` must find GPUs to run: an nvidia or amd group of ``device_type: auto``
    unless ``cluster.allow_cpu`` lets it run on the CPU. A declared GPU type (H200) on a CPU is
    the type check's to refuse (:func:`_first_mismatch`), with or without the flag."""
    return group.device_type == "auto" and group.vendor in ("nvidia", "amd") and not cluster.allow_cpu


def no_gpu_line(cluster: ClusterConfig, index: int, finds: str) -> str:
    """The one line for GPU group ``index`` where ``finds`` ("rank 0 finds none") says no GPU was seen."""
    import torch

    group = cluster.groups[index]
    kind = f"{group.vendor} GPUs" if group.device_type == "auto" else f"{group.device_type} GPUs"
    on_purpose = "set cluster.allow_cpu=true to run it on the CPU on purpose" if group.device_type == "auto" \
        else f"set cluster.groups.{index}.device_type=auto and cluster.allow_cpu=true to run it on the CPU"
    return (f"cluster {cluster.name!r} group {group.name!r} runs on {kind} but {finds} (torch "
            f"{torch.__version__} sees no GPU): run it where the GPUs are, or {on_purpose} "
            "(cluster=cpu_mixed is the emulated CPU cluster)")


def _first_cpu_rank(cluster: ClusterConfig, index: int, devices: Mapping[int, DeviceFacts]) -> Optional[int]:
    """The first rank of group ``index`` that runs on the CPU although the group needs a GPU."""
    if not needs_gpu(cluster, cluster.groups[index]):
        return None
    return next((r for r in cluster.group_ranks(index) if r in devices and devices[r].vendor == "cpu"), None)


def _first_mismatch(ranks: list[int], expected: Optional[str], devices: Mapping[int, DeviceFacts]
                    ) -> Optional[int]:
    """The first of ``ranks`` whose detected type is not ``expected`` (case-insensitive). A GPU
    the catalog does not know cannot be told apart from what was declared for it."""
    if expected is None:
        return None
    return next((r for r in ranks if r in devices and devices[r].device_type
                 and devices[r].device_type.lower() != expected.lower()), None)


def _mismatch_line(group: GroupConfig, expected: str, source: str, rank: int, facts: DeviceFacts) -> str:
    if source == "declares":
        said = f"group {group.name!r} declares device_type {expected}"
    else:
        said = f"the plan was made for group {group.name!r} on {expected} (its notes.device_types)"
    return f"{said} but rank {rank} runs on {facts.describe()}"


def _remedy(index: int, group: GroupConfig, expected: str, source: str, facts: DeviceFacts) -> str:
    if source == "plan":
        fix = ": make the plan on this hardware (plan=auto, or python -m hetpipe.plan here)"
    else:
        fix = f": set cluster.groups.{index}.device_type=auto (or {facts.device_type})"
    if facts.vendor == "cpu":
        return fix + ", or run it where the GPUs are"
    return fix + f", or cluster.allow_device_mismatch=true to plan for {expected} on purpose"


def check_local_devices(cluster: ClusterConfig, catalog: Optional[Mapping[str, DeviceSpec]] = None) -> None:
    """Before a launcher on this machine starts the ranks (its caller skips it under
    torchrun, where this process is a rank): each rank's device as the launcher sees it, checked as
    :func:`check_devices` does, so a mismatch is said before any rank starts or any plan is
    made for the wrong device. Warnings are left to rank 0, which says them after the roll call."""
    check_devices(cluster, local_devices(cluster, catalog))


def local_devices(cluster: ClusterConfig, catalog: Optional[Mapping[str, DeviceSpec]] = None
                  ) -> dict[int, DeviceFacts]:
    """rank -> the facts of the device a local launch gives it: the CPU for a group on CPUs,
    else GPU ``rank``; no entry for a rank without a GPU (its rank says so itself), and
    the CPU for every GPU rank of a machine without one."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    found = {}
    for index, group in enumerate(cluster.groups):
        for rank in cluster.group_ranks(index):
            if group.on_cpu or not gpus:
                found[rank] = _cpu_facts()
            elif rank < gpus:
                found[rank] = _gpu_facts(rank, catalog, free=False)
    return found


# -- the roll call's line ------------------------------------------------------------------------------


def devices_lines(cluster: ClusterConfig, devices: Mapping[int, DeviceFacts]) -> list[str]:
    """One line per group: ``hetpipe: devices: nvidia group: 2 x NVIDIA H100 80GB HBM3 (H100,
    CUDA 13.0, torch 2.11.0+cu130), 79.1 GiB each, 78.5 free``."""
    parts = [_group_part(group, [devices[r] for r in cluster.group_ranks(i) if r in devices])
             for i, group in enumerate(cluster.groups)]
    return [f"hetpipe: devices: {p}" for p in parts if p]


def _group_part(group: GroupConfig, facts: list[DeviceFacts]) -> str:
    """One group's devices: ``2 x NAME (...)``, kinds that differ listed one after another;
    memory is the smallest total and the least free (the host's, for CPU ranks)."""
    if not facts:
        return ""
    kinds: dict[str, int] = {}
    for f in facts:
        runtime = "" if f.runtime == "cpu" else f"{f.runtime}, "
        kind = f"{f.name} ({f.device_type or 'not in the catalog'}, {runtime}torch {f.torch})"
        kinds[kind] = kinds.get(kind, 0) + 1
    free = [f.free_gib for f in facts if f.free_gib is not None]
    each = "of host memory" if all(f.vendor == "cpu" for f in facts) else "each"
    memory = f"{min(f.total_gib for f in facts):.1f} GiB {each}" + (f", {min(free):.1f} free" if free else "")
    return f"{group.name} group: {', '.join(f'{n} x {k}' for k, n in kinds.items())}, {memory}"
