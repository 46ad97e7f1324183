"""Device catalog: what each accelerator can do, for MFU and for planning.

Peak figures are the vendors' published dense (no sparsity) BF16 tensor-core
numbers (and, for devices with FP8 tensor cores, the dense FP8 figure
and which FP8 pair they compute in); memory is the card's capacity as marketed (GB, used as GiB); links
are the per-GPU intra-node bandwidth (NVLink / Infinity Fabric, both
directions added; the PCIe figure for cards without such a fabric) and the
host link (PCIe, one direction). Each entry's source, a vendor datasheet or
product brief as of 2026, is listed in docs/partitioner.md, which a test
holds to the catalog: an entry without a documented source fails it. An
entry is what one rank drives: an MI250X is two GCDs, each its own device to
PyTorch, so its entry is one GCD (half the module's figures).

``efficiency`` is the fraction of the dense peak that a training step's model
FLOPs reach on that device when the partitioner has no measured profile. It is
an assumption, not a datasheet number: 0.55 for NVIDIA datacenter parts (the
seed paper's NVIDIA-only LLaMA-8B run reached 549.7 of 989 TFLOP/s per H200)
and 0.40 for AMD CDNA (its AMD-only run was 0.9-2.3% below the mixed run's
539.6 TFLOP/s per GPU, about 0.40 of the MI325X's 1307). Workstation and
consumer parts have no such anchor; their values are argued beside their
entries. Measure instead with ``python -m hetpipe.plan profile``.

The ``CPU`` entry exists for emulated clusters; its numbers are nominal, not
measured. The catalog is data: :func:`catalog_with` applies overrides and
extra devices from a config (``planner.catalog`` in ``python -m hetpipe.plan``).
:func:`detect_device_type` maps the name torch reports (and, on ROCm, the
GPU architecture and memory when the name says nothing) to a key.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from hetpipe.errors import ConfigError

DEVICE_VENDORS = ("nvidia", "amd", "cpu")
# FP8 pairs by their e4m3 member: "e4m3fn" is OCP's e4m3fn/e5m2 (NVIDIA Ada,
# Hopper, Blackwell; AMD MI350X/MI355X), "e4m3fnuz" the e4m3fnuz/e5m2fnuz pair
# of AMD's MI300X and MI325X (what torchao casts to on ROCm there).
FP8_FORMATS = ("e4m3fn", "e4m3fnuz")


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
    # Dense FP8 tensor-core peak and the FP8 pair the device computes in
    # (FP8_FORMATS); None for both on a device without FP8 (train.precision=fp8
    # refuses it).
    peak_fp8_tflops: Optional[float] = None
    fp8_format: Optional[str] = None

    def __post_init__(self) -> None:
        if self.vendor not in DEVICE_VENDORS:
            raise ConfigError(f"device {self.name!r}: vendor {self.vendor!r} is not one of {DEVICE_VENDORS}")
        if self.fp8_format is not None and self.fp8_format not in FP8_FORMATS:
            raise ConfigError(f"device {self.name!r}: fp8_format={self.fp8_format!r} is not one of "
                              f"{', '.join(FP8_FORMATS)}")
        if (self.fp8_format is None) != (self.peak_fp8_tflops is None):
            raise ConfigError(f"device {self.name!r}: fp8_format and peak_fp8_tflops go together "
                              "(both set for a device with FP8, neither for one without)")
        for field in ("peak_bf16_tflops", "memory_gib", "memory_bandwidth_tbs", "intra_node_link_gbs",
                      "host_link_gbs", "efficiency"):
            if not getattr(self, field) > 0:
                raise ConfigError(f"device {self.name!r}: {field}={getattr(self, field)} must be positive")
        if self.efficiency > 1:
            raise ConfigError(f"device {self.name!r}: efficiency={self.efficiency} is a fraction of peak (<= 1)")


# Efficiency assumptions for the parts the seed paper did not run (see the
# module docstring for the measured anchors, 0.55 and 0.40):
# * L40S 0.45: the same AD102 die as the RTX 4090, but its quoted peak is the
#   full-rate (FP32-accumulate) 362 TFLOP/s against 0.86 TB/s of GDDR6, 419
#   FLOP per byte against the H100's 295, so the bandwidth-bound share of a
#   step (norms, SwiGLU, softmax, the optimizer step) weighs more.
# * RTX 4090 / 5090 0.55, as for datacenter NVIDIA: GeForce BF16 peaks are
#   the half-rate FP32-accumulate figures (165.2 and 209.5 TFLOP/s), which
#   large GEMMs can approach (one microbenchmark has a 5090 above its figure),
#   and they have 1.8x and 2.5x the H100's bandwidth per quoted FLOP. No
#   measurement here backs going higher than the datacenter figure.
# * W7900 / RX 7900 XTX 0.30: RDNA3's ~123 TFLOP/s is a WMMA peak at boost
#   clock; ROCm's GEMM and attention kernels for gfx1100 are less tuned than
#   for CDNA (flash attention's Composable Kernel path targets CDNA), so we
#   assume a lower fraction than CDNA's 0.40.
# * MI210 0.40: the MI250X's CDNA2 GCD on a PCIe card.
#
# Cards whose GPU-to-GPU fabric is an optional bridge (H100 PCIe/NVL and H200
# NVL NVLink bridges of 2 or 4 cards, A100 PCIe 2-card bridges, MI210 Infinity
# Fabric bridges of up to 4) are entered at their PCIe figure, both directions
# added: a bridge spans a pair or a quad, not an 8-GPU node, and TP over the
# node crosses PCIe. Override intra_node_link_gbs when TP stays inside one.
# Consumer cards have no GPU-to-GPU link at all (the RTX 4090 dropped NVLink;
# GeForce drivers also disable peer-to-peer, so NCCL stages through host
# memory and the PCIe figure is an upper bound).
#
# PCIe x16, one direction: Gen4 = 32 GB/s, Gen5 = 64 GB/s.
CATALOG: dict[str, DeviceSpec] = {spec.name: spec for spec in (
    # name, vendor, dense BF16 TFLOP/s, GB, TB/s, intra-node GB/s (bidir), host GB/s (one way), efficiency,
    # dense FP8 TFLOP/s and FP8 format (none on Ampere, CDNA2, RDNA3 and the CPU)
    # HGX/DGX B200 at 1000 W: 180 GB of the package's 192 GB exposed; NVLink 5, 18 x 100 GB/s.
    DeviceSpec("B200", "nvidia", 2250.0, 180.0, 8.0, 1800.0, 64.0, 0.55, 4500.0, "e4m3fn"),
    DeviceSpec("H100", "nvidia", 989.0, 80.0, 3.35, 900.0, 64.0, 0.55, 1979.0, "e4m3fn"),     # H100 SXM5
    # H100 PCIe (also taken for the H100 NVL, which is faster: see detect_device_type).
    DeviceSpec("H100-PCIe", "nvidia", 756.0, 80.0, 2.0, 128.0, 64.0, 0.55, 1513.0, "e4m3fn"),
    DeviceSpec("H200", "nvidia", 989.0, 141.0, 4.8, 900.0, 64.0, 0.55, 1979.0, "e4m3fn"),     # H200 SXM
    DeviceSpec("H200-NVL", "nvidia", 835.0, 141.0, 4.8, 128.0, 64.0, 0.55, 1671.0, "e4m3fn"),  # PCIe card, 600 W
    # China-market Hopper; NVIDIA's H20 brief is not on its public site, so
    # these are the figures its partners publish (96 GB part; a 141 GB one exists).
    DeviceSpec("H20", "nvidia", 148.0, 96.0, 4.0, 900.0, 64.0, 0.55, 296.0, "e4m3fn"),
    DeviceSpec("A100", "nvidia", 312.0, 80.0, 2.039, 600.0, 32.0, 0.55),    # A100 80GB SXM4
    DeviceSpec("A100-40GB", "nvidia", 312.0, 40.0, 1.555, 600.0, 32.0, 0.55),  # A100 40GB SXM4
    DeviceSpec("A100-PCIe", "nvidia", 312.0, 80.0, 1.935, 64.0, 32.0, 0.55),   # A100 80GB PCIe
    DeviceSpec("A100-40GB-PCIe", "nvidia", 312.0, 40.0, 1.555, 64.0, 32.0, 0.55),
    DeviceSpec("L40S", "nvidia", 362.0, 48.0, 0.864, 64.0, 32.0, 0.45, 733.0, "e4m3fn"),
    DeviceSpec("RTX4090", "nvidia", 165.2, 24.0, 1.008, 64.0, 32.0, 0.55, 330.3, "e4m3fn"),
    DeviceSpec("RTX5090", "nvidia", 209.5, 32.0, 1.792, 128.0, 64.0, 0.55, 419.0, "e4m3fn"),
    # MI350X/MI355X: 256 CUs x 4096 BF16 FLOP/clock at 2.2 / 2.4 GHz; 7 x 153.6 GB/s links.
    DeviceSpec("MI355X", "amd", 2516.6, 288.0, 8.0, 1075.2, 64.0, 0.40, 5033.2, "e4m3fn"),
    DeviceSpec("MI350X", "amd", 2306.9, 288.0, 8.0, 1075.2, 64.0, 0.40, 4613.8, "e4m3fn"),
    DeviceSpec("MI325X", "amd", 1307.4, 256.0, 6.0, 896.0, 64.0, 0.40, 2614.9, "e4m3fnuz"),
    DeviceSpec("MI300X", "amd", 1307.4, 192.0, 5.3, 896.0, 64.0, 0.40, 2614.9, "e4m3fnuz"),
    # One GCD: half of the OAM's 383 TFLOP/s, 128 GB, 3.2 TB/s and 8 x 100 GB/s links.
    DeviceSpec("MI250X", "amd", 191.5, 64.0, 1.6, 400.0, 32.0, 0.40),
    DeviceSpec("MI210", "amd", 181.0, 64.0, 1.6, 64.0, 32.0, 0.40),       # PCIe card, CDNA2
    DeviceSpec("W7900", "amd", 122.6, 48.0, 0.864, 64.0, 32.0, 0.30),      # Radeon PRO W7900
    DeviceSpec("RX7900XTX", "amd", 122.8, 24.0, 0.96, 64.0, 32.0, 0.30),   # Radeon RX 7900 XTX
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


# Names that torch reports when the driver does not know the part: ROCm
# falls back to "AMD Radeon Graphics" when libdrm's amdgpu.ids lacks the
# device id (seen on MI300X and MI355X containers), older ROCm gave "" or
# "Device 74a1", and a CUDA driver older than the card says "NVIDIA Graphics
# Device". Such a name says nothing; the ROCm architecture may.
_GENERIC_WORDS = frozenset({"AMD", "ATI", "NVIDIA", "RADEON", "GRAPHICS", "INSTINCT", "DEVICE", "GPU", "TM",
                            "PRO", "GEFORCE"})

# Extra token sets that also select a built-in key, beyond the key's own
# dash-separated parts. The H100 NVL (94 GB, 835 TFLOP/s, 3.9 TB/s, NVLink
# bridges) has no entry of its own: it is taken for the H100 PCIe, the
# PCIe-class card it is closest to, which under-states it (a plan that
# expects less of a device errs towards fitting).
_ALIASES: dict[str, tuple[tuple[str, ...], ...]] = {
    "H100-PCIe": (("H100", "NVL"),),
}

# When the name says nothing: ROCm's gcnArchName (the part before ':'),
# narrowed by the memory torch reports and, if given, the compute-unit count
# (torch's multi_processor_count). Per arch, the candidates as (key, capacity
# GB, compute units), the first being the one taken when what is known does
# not tell them apart. It is the one that expects less of the device (less
# memory, or a lower peak), so a plan made on it errs towards fitting:
# * gfx942: MI300X (192 GB) before MI325X (256 GB); both 304 CUs.
# * gfx950: MI350X (2.2 GHz, 2307 TFLOP/s) before MI355X (2.4 GHz); both
#   288 GB and 256 CUs, so only the name tells them apart.
# * gfx90a: MI210 (104 CUs, 181 TFLOP/s, PCIe) before an MI250X GCD (110 CUs,
#   191.5 TFLOP/s, 400 GB/s Infinity Fabric); both 64 GB, so the CU count
#   decides. (An MI250's GCD also has 104 CUs and the MI210's 181 TFLOP/s.)
# * gfx1100: RX 7900 XTX (24 GB) before W7900 (48 GB); both 96 CUs. A 7900 XT
#   (20 GB, 84 CUs) or W7800 (32 GB, 70 CUs) matches neither and stays unknown.
_ARCH_CANDIDATES: dict[str, tuple[tuple[str, float, int], ...]] = {
    "gfx942": (("MI300X", 192.0, 304), ("MI325X", 256.0, 304)),
    "gfx950": (("MI350X", 288.0, 256), ("MI355X", 288.0, 256)),
    "gfx90a": (("MI210", 64.0, 104), ("MI250X", 64.0, 110)),
    "gfx1100": (("RX7900XTX", 24.0, 96), ("W7900", 48.0, 96)),
}
# torch's total_memory is the capacity less what the driver keeps (a
# 192 GB MI300X reports 191.98 GiB); this much below the capacity still
# counts as that part, while the next size down (20 of 24, 32 of 48,
# 128 of 192 GB) does not.
_MEMORY_MATCH = (0.85, 1.05)


def _tokens(name: str) -> list[str]:
    return [t for t in re.split(r"[^0-9A-Z]+", name.upper()) if t]


def _has_part(tokens: list[str], part: str) -> bool:
    """``part`` is a token, or consecutive tokens run together ('RTX4090' in 'RTX 4090')."""
    for i in range(len(tokens)):
        joined = ""
        for token in tokens[i:]:
            joined += token
            if joined == part:
                return True
            if len(joined) >= len(part) or not part.startswith(joined):
                break
    return False


def _is_generic(tokens: list[str]) -> bool:
    after_device = {tokens[i + 1] for i, t in enumerate(tokens[:-1]) if t == "DEVICE"}  # 'Device 74a1'
    return all(t in _GENERIC_WORDS or t in after_device for t in tokens)


def _from_arch(arch: str, memory_gib: Optional[float], compute_units: Optional[int],
               catalog: Mapping[str, DeviceSpec]) -> str:
    candidates = [(key, gb, cus) for key, gb, cus in _ARCH_CANDIDATES.get(arch, ()) if key in catalog]
    if memory_gib is not None:
        low, high = _MEMORY_MATCH
        candidates = [c for c in candidates if low * c[1] <= memory_gib <= high * c[1]]
    if compute_units is not None:
        candidates = [c for c in candidates if c[2] == compute_units]
    return candidates[0][0] if candidates else ""


def detect_device_type(device_name: str, catalog: Optional[Mapping[str, DeviceSpec]] = None, *,
                       arch: str = "", memory_gib: float | None = None,
                       compute_units: int | None = None) -> str:
    """Map a runtime device name to a catalog key; '' when unknown.

    ``device_name`` is what ``torch.cuda.get_device_name`` reports: on CUDA
    builds 'NVIDIA H100 80GB HBM3', 'NVIDIA A100-PCIE-40GB', 'NVIDIA GeForce
    RTX 4090'; on ROCm builds the marketing name ('AMD Instinct MI300X',
    'AMD Instinct MI250X / MI250', 'AMD Radeon PRO W7900', 'Radeon RX 7900
    XTX') or, where the driver's table lacks the part, 'AMD Radeon Graphics'
    or ''. The name is split into tokens at anything but letters and digits;
    a key matches when each of its dash-separated parts is a token or
    consecutive tokens run together ('A100-40GB' in 'NVIDIA A100-SXM4-40GB',
    'RX7900XTX' in 'AMD Radeon RX 7900 XTX'). Keys with more to match are
    tried first, so an H100 PCIe is not an H100 SXM, nor an A100 40GB an
    A100; whole tokens keep 'H20' out of 'H200', 'H200' out of 'GH200' and
    'A100' out of 'RTX A1000'. An 'RTX 4090 D' is taken for an RTX 4090
    (it has 11% fewer cores).

    Only when the name says nothing (only words like AMD, Radeon, Graphics)
    do ``arch`` (ROCm's ``gcnArchName``, e.g. 'gfx942:sramecc+:xnack-'),
    ``memory_gib`` (``total_memory`` in GiB) and ``compute_units``
    (``multi_processor_count``) decide; see ``_ARCH_CANDIDATES``. A name
    that names a part the catalog lacks ('AMD Instinct MI308X', gfx942 with
    192 GB but 80 CUs) stays unknown: no known peak, so MFU is not reported.
    """
    catalog = CATALOG if catalog is None else catalog
    if device_name.strip().upper() == "CPU":
        return "CPU"
    tokens = _tokens(device_name)
    patterns = [(key, tuple(key.upper().split("-"))) for key in catalog if key != "CPU"]
    patterns += [(key, parts) for key, sets in _ALIASES.items() if key in catalog for parts in sets]
    # Most specific first: the most characters to match, then the most parts.
    patterns.sort(key=lambda kp: (-sum(map(len, kp[1])), -len(kp[1]), kp[0]))
    for key, parts in patterns:
        if all(_has_part(tokens, part) for part in parts):
            return key
    if re.match(r"\s*gfx[0-9a-f]+(:|\s*$)", device_name, re.IGNORECASE):
        arch = arch or device_name  # some ROCm releases report the arch as the name
    elif not _is_generic(tokens):
        return ""
    return _from_arch(arch.split(":")[0].strip().lower(), memory_gib, compute_units, catalog)
