"""Device catalog: what each accelerator can do, for MFU and for planning.

Peak figures are the vendors' published dense (no sparsity) BF16 tensor-core
numbers; memory is the usable HBM capacity; links are the per-GPU intra-node
fabric bandwidth (NVLink / Infinity Fabric, both directions). Sources, as of
2026: NVIDIA H100 and H200 product briefs and datasheets, NVIDIA A100
datasheet, AMD Instinct MI250X, MI300X and MI325X datasheets. The ``CPU``
entry exists for emulated clusters; its numbers are nominal, not measured.
"""
from __future__ import annotations

from dataclasses import dataclass

from hetpipe.errors import ConfigError


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    vendor: str  # nvidia | amd | cpu
    peak_bf16_tflops: float  # dense
    memory_gib: float
    memory_bandwidth_tbs: float
    intra_node_link_gbs: float  # per GPU, bidirectional aggregate


CATALOG: dict[str, DeviceSpec] = {spec.name: spec for spec in (
    DeviceSpec("H100", "nvidia", 989.0, 80.0, 3.35, 900.0),      # H100 SXM5
    DeviceSpec("H200", "nvidia", 989.0, 141.0, 4.8, 900.0),      # H200 SXM
    DeviceSpec("A100", "nvidia", 312.0, 80.0, 2.039, 600.0),     # A100 80GB SXM4
    DeviceSpec("MI250X", "amd", 383.0, 128.0, 3.2, 800.0),       # per OAM (2 GCDs)
    DeviceSpec("MI300X", "amd", 1307.4, 192.0, 5.3, 896.0),
    DeviceSpec("MI325X", "amd", 1307.4, 256.0, 6.0, 896.0),
    DeviceSpec("CPU", "cpu", 1.0, 24.0, 0.05, 10.0),             # nominal, emulation only
)}


def device_spec(name: str) -> DeviceSpec:
    """Look a device type up by name (case-insensitive); unknown names are an error."""
    for key, spec in CATALOG.items():
        if key.lower() == name.lower():
            return spec
    raise ConfigError(f"unknown device type {name!r} (known: {', '.join(CATALOG)})")


def detect_device_type(device_name: str) -> str:
    """Map a runtime device name ('NVIDIA H200', 'AMD Instinct MI300X', 'cpu') to a catalog key.

    Longer keys are tried first so that e.g. 'MI325X' is not taken for 'MI300X'.
    Unrecognised accelerators map to '' (no known peak: MFU is not reported).
    """
    upper = device_name.upper()
    if upper == "CPU":
        return "CPU"
    for key in sorted(CATALOG, key=len, reverse=True):
        if key != "CPU" and key in upper:
            return key
    return ""
