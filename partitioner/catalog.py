"""Device catalog: what each accelerator can do, for MFU and for planning.

Peak figures are the vendors' published dense (no sparsity) BF16 tensor-core
numbers; memory is the HBM capacity; links are the per-GPU intra-node fabric
bandwidth (NVLink / Infinity Fabric, both directions added) and the host link
(PCIe, one direction). Sources, as of 2026, are listed in docs/partitioner.md:
NVIDIA H100 and H200 product briefs and datasheets, the NVIDIA A100 datasheet,
AMD Instinct MI250X, MI300X and MI325X datasheets. An entry is what one rank
drives: an MI250X is two GCDs, each its own device to PyTorch, so its entry
is one GCD (half the module's figures).

``efficiency`` is the fraction of the dense peak that a training step's model
FLOPs reach on that device when the partitioner has no measured profile. It is
an assumption, not a datasheet number: 0.55 for NVIDIA Hopper/Ampere (the seed
paper's NVIDIA-only LLaMA-8B run reached 549.7 of 989 TFLOP/s per H200) and
0.40 for AMD CDNA (its AMD-only run was 0.9-2.3% below the mixed run's 539.6
TFLOP/s per GPU, about 0.40 of the MI325X's 1307). Measure instead with
``python -m hetpipe.plan profile``.

The ``CPU`` entry exists for emulated clusters; its numbers are nominal, not
measured. The catalog is data: :func:`catalog_with` applies overrides and
extra devices from a config (``planner.catalog`` in ``python -m hetpipe.plan``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from hetpipe.errors import ConfigError

DEVICE_VENDORS = ("nvidia", "amd", "cpu")


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    vendor: str  # nvidia | amd | cpu
    peak_bf16_tflops: float  # dense
    memory_gib: float
    memory_bandwidth_tbs: float
    intra_node_link_gbs: float  # per GPU, bidirectional aggregate
    # Device <-> host link (PCIe), GB/s in one direction: what CPU-forwarding's
    # two copies run at.
    host_link_gbs: float = 64.0
    # Fraction of the dense peak a training step reaches (model FLOPs), used
    # when no measured profile exists. An assumption; see the module docstring.
    efficiency: float = 0.5

    def __post_init__(self) -> None:
        if self.vendor not in DEVICE_VENDORS:
            raise ConfigError(f"device {self.name!r}: vendor {self.vendor!r} is not one of {DEVICE_VENDORS}")
        for field in ("peak_bf16_tflops", "memory_gib", "memory_bandwidth_tbs", "intra_node_link_gbs",
                      "host_link_gbs", "efficiency"):
            if not getattr(self, field) > 0:
                raise ConfigError(f"device {self.name!r}: {field}={getattr(self, field)} must be positive")
        if self.efficiency > 1:
            raise ConfigError(f"device {self.name!r}: efficiency={self.efficiency} is a fraction of peak (<= 1)")


CATALOG: dict[str, DeviceSpec] = {spec.name: spec for spec in (
    # PCIe Gen5 x16 = 64 GB/s per direction; Gen4 x16 = 32.
    DeviceSpec("H100", "nvidia", 989.0, 80.0, 3.35, 900.0, 64.0, 0.55),     # H100 SXM5
    DeviceSpec("H200", "nvidia", 989.0, 141.0, 4.8, 900.0, 64.0, 0.55),     # H200 SXM
    DeviceSpec("A100", "nvidia", 312.0, 80.0, 2.039, 600.0, 32.0, 0.55),    # A100 80GB SXM4
    DeviceSpec("A100-40GB", "nvidia", 312.0, 40.0, 1.555, 600.0, 32.0, 0.55),  # A100 40GB SXM4
    # One GCD: half of the OAM's 383 TFLOP/s, 128 GB, 3.2 TB/s and 8 x 100 GB/s links.
    DeviceSpec("MI250X", "amd", 191.5, 64.0, 1.6, 400.0, 32.0, 0.40),
    DeviceSpec("MI300X", "amd", 1307.4, 192.0, 5.3, 896.0, 64.0, 0.40),
    DeviceSpec("MI325X", "amd", 1307.4, 256.0, 6.0, 896.0, 64.0, 0.40),
    # Nominal, emulation only; copies between "device" and host are memcpys.
    DeviceSpec("CPU", "cpu", 1.0, 24.0, 0.05, 10.0, 10.0, 1.0),
)}


def device_spec(name: str, catalog: Optional[Mapping[str, DeviceSpec]] = None) -> DeviceSpec:
    """Look a device type up by name (case-insensitive); unknown names are an error."""
    catalog = CATALOG if catalog is None else catalog
    for key, spec in catalog.items():
        if key.lower() == name.lower():
            return spec
    raise ConfigError(f"unknown device type {name!r} (known: {', '.join(catalog)}); "
                      "add it with planner.catalog.<NAME>={vendor: ..., peak_bf16_tflops: ..., ...}")


def catalog_with(overrides: Optional[Mapping[str, Mapping[str, Any]]],
                 base: Optional[Mapping[str, DeviceSpec]] = None) -> dict[str, DeviceSpec]:
    """A copy of ``base`` (the built-in catalog) with overrides applied.

    ``overrides`` maps a device name to fields: for a known device, the fields
    to change (``{"H200": {"efficiency": 0.6}}``); for a new name, a whole
    entry (vendor, peak_bf16_tflops, memory_gib, memory_bandwidth_tbs,
    intra_node_link_gbs; host_link_gbs and efficiency are optional).
    """
    catalog = dict(CATALOG if base is None else base)
    fields = {f.name for f in dataclasses.fields(DeviceSpec)} - {"name"}
    for name, values in (overrides or {}).items():
        values = dict(values or {})
        unknown = set(values) - fields
        if unknown:
            raise ConfigError(f"catalog override for {name!r}: unknown field(s) {sorted(unknown)} "
                              f"(fields: {', '.join(sorted(fields))})")
        known = next((key for key in catalog if key.lower() == str(name).lower()), None)
        try:
            if known is not None:
                catalog[known] = dataclasses.replace(catalog[known], **values)
            else:
                catalog[str(name)] = DeviceSpec(name=str(name), **values)
        except TypeError:
            required = [f.name for f in dataclasses.fields(DeviceSpec)
                        if f.default is dataclasses.MISSING and f.name != "name"]
            missing = [f for f in required if f not in values]
            raise ConfigError(f"catalog entry {name!r} is a new device and needs {', '.join(missing)}") from None
    return catalog


def detect_device_type(device_name: str, catalog: Optional[Mapping[str, DeviceSpec]] = None) -> str:
    """Map a runtime device name ('NVIDIA H200', 'AMD Instinct MI300X', 'cpu') to a catalog key.

    A key matches when each of its dash-separated parts is in the name
    ('A100-40GB' matches 'NVIDIA A100-SXM4-40GB'); longer keys are tried first
    so that e.g. 'MI325X' is not taken for 'MI300X', nor an A100-40GB for an
    A100. Unrecognised accelerators map to '' (no known peak: MFU is not reported).
    """
    catalog = CATALOG if catalog is None else catalog
    upper = device_name.upper()
    if upper == "CPU":
        return "CPU"
    for key in sorted(catalog, key=len, reverse=True):
        if key != "CPU" and all(part in upper for part in key.upper().split("-")):
            return key
    return ""
