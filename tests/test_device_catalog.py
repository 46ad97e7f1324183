"""The device catalog: its entries, their documented sources, and detect_device_type."""
import re
from pathlib import Path

import pytest

from hetpipe.devices.catalog import CATALOG, DEVICE_VENDORS, catalog_with, detect_device_type, device_spec

DOCS = Path(__file__).resolve().parents[1] / "docs" / "partitioner.md"

# (what torch reports as the name, gcnArchName, total memory in GiB, expected key).
# CUDA builds: torch.cuda.get_device_name() as the driver names the part.
CUDA_NAMES = [
    ("NVIDIA B200", "", 178.4, "B200"),
    ("NVIDIA H100 80GB HBM3", "", 79.1, "H100"),
    ("NVIDIA H100", "", None, "H100"),
    ("NVIDIA H100 PCIe", "", 79.1, "H100-PCIe"),
    ("NVIDIA H100 NVL", "", 93.1, "H100-PCIe"),  # no entry of its own: the PCIe-class one
    ("NVIDIA H200", "", 139.8, "H200"),
    ("NVIDIA H200 NVL", "", 139.8, "H200-NVL"),
    ("NVIDIA H20", "", 95.0, "H20"),
    ("NVIDIA A100-SXM4-80GB", "", 79.2, "A100"),
    ("NVIDIA A100-SXM4-40GB", "", 39.4, "A100-40GB"),
    ("NVIDIA A100 80GB PCIe", "", 79.2, "A100-PCIe"),
    ("NVIDIA A100-PCIE-40GB", "", 39.4, "A100-40GB-PCIe"),
    ("NVIDIA L40S", "", 44.4, "L40S"),
    ("NVIDIA GeForce RTX 4090", "", 23.6, "RTX4090"),
    ("NVIDIA GeForce RTX 4090 D", "", 23.6, "RTX4090"),
    ("NVIDIA GeForce RTX 5090", "", 31.4, "RTX5090"),
]
# ROCm builds: the marketing name from libdrm's amdgpu.ids, with the arch and
# memory that come with it (the name decides; the arch is not consulted).
ROCM_NAMES = [
    ("AMD Instinct MI355X", "gfx950:sramecc+:xnack-", 287.98, "MI355X"),
    ("AMD Instinct MI350X", "gfx950:sramecc+:xnack-", 287.98, "MI350X"),
    ("AMD Instinct MI325X", "gfx942:sramecc+:xnack-", 255.98, "MI325X"),
    ("AMD Instinct MI300X", "gfx942:sramecc+:xnack-", 191.98, "MI300X"),
    ("AMD Instinct MI300X VF", "gfx942:sramecc+:xnack-", 191.98, "MI300X"),
    ("AMD Instinct MI250X / MI250", "gfx90a:sramecc+:xnack-", 63.98, "MI250X"),
    ("AMD Instinct MI250X", "gfx90a:sramecc+:xnack-", 63.98, "MI250X"),
    ("AMD Instinct MI210", "gfx90a:sramecc+:xnack-", 63.98, "MI210"),
    ("AMD Radeon PRO W7900", "gfx1100", 47.98, "W7900"),
    ("AMD Radeon PRO W7900 Dual Slot", "gfx1100", 47.98, "W7900"),
    ("AMD Radeon RX 7900 XTX", "gfx1100", 23.98, "RX7900XTX"),
    ("Radeon RX 7900 XTX", "gfx1100", 23.98, "RX7900XTX"),
    ("AMD Instinct MI300X", "gfx950", 287.98, "MI300X"),  # a specific name wins over the arch
    ("cpu", "", None, "CPU"),
    ("CPU", "", None, "CPU"),
]
# An uninformative name: the arch decides, narrowed by memory.
ARCH_FALLBACK = [
    ("AMD Radeon Graphics", "gfx942:sramecc+:xnack-", 191.98, "MI300X"),
    ("AMD Radeon Graphics", "gfx942:sramecc+:xnack-", 255.98, "MI325X"),
    ("", "gfx942", None, "MI300X"),  # undecided: the smaller part
    ("AMD Radeon Graphics", "gfx950:sramecc+:xnack-", 287.98, "MI350X"),  # MI350X/MI355X: only the name tells
    ("", "gfx90a:sramecc+:xnack-", 63.98, "MI210"),  # MI210 or an MI250X GCD: the lower peak
    ("AMD Radeon Graphics", "gfx1100", 47.98, "W7900"),
    ("AMD Radeon Graphics", "gfx1100", 23.98, "RX7900XTX"),
    ("AMD Radeon Graphics", "gfx1100", None, "RX7900XTX"),
    ("Device 74a5", "gfx942", 255.98, "MI325X"),
    ("gfx942:sramecc+:xnack-", "", 191.98, "MI300X"),  # an old ROCm's name is the arch
    ("gfx1100", "", 23.98, "RX7900XTX"),
]
UNKNOWN = [
    ("NVIDIA GH200 480GB", "", 94.5),  # 'H200' is not a token of it
    ("NVIDIA H800", "", 79.1),
    ("NVIDIA RTX A1000", "", 7.7),  # nor 'A100'
    ("NVIDIA L40", "", 44.4),  # an L40S needs its S
    ("NVIDIA GeForce RTX 3090", "", 23.6),
    ("NVIDIA Graphics Device", "", 79.1),  # uninformative, and no ROCm arch to fall back on
    ("AMD Instinct MI308X", "gfx942:sramecc+:xnack-", 191.98),  # a specific name the catalog lacks
    ("AMD Instinct MI300A", "gfx942:sramecc+:xnack-", 127.98),
    ("AMD Radeon RX 7900 XT", "gfx1100", 19.98),
    ("AMD Radeon Graphics", "gfx1100", 19.98),  # a 7900 XT: neither 24 nor 48 GB
    ("AMD Radeon Graphics", "gfx942", 127.98),  # an MI300A's memory
    ("AMD Radeon Graphics", "gfx1030", 15.98),  # an arch without candidates
    ("AMD Radeon Graphics", "", None),
    ("", "", None),
    ("Intel(R) Data Center GPU Max 1550", "", 128.0),
]


@pytest.mark.parametrize("name,arch,memory_gib,expected", CUDA_NAMES + ROCM_NAMES + ARCH_FALLBACK)
def test_detect_device_type_maps_what_torch_reports(name, arch, memory_gib, expected):
    assert detect_device_type(name, arch=arch, memory_gib=memory_gib) == expected


@pytest.mark.parametrize("name,arch,memory_gib", UNKNOWN)
def test_unknown_devices_map_to_nothing(name, arch, memory_gib):
    assert detect_device_type(name, arch=arch, memory_gib=memory_gib) == ""


def test_every_entry_is_detected_from_a_reported_name():
    # Each key is reached from a name torch reports, not only from the arch.
    named = {key for _, _, _, key in CUDA_NAMES + ROCM_NAMES}
    assert set(CATALOG) - named == set()


@pytest.mark.parametrize("compute_units,expected", [(110, "MI250X"), (104, "MI210"), (None, "MI210"), (80, "")])
def test_compute_units_tell_an_mi250x_gcd_from_an_mi210(compute_units, expected):
    assert detect_device_type("", arch="gfx90a:sramecc+:xnack-", memory_gib=63.98,
                              compute_units=compute_units) == expected
    # An MI308X is gfx942 with an MI300X's memory but 80 CUs.
    assert detect_device_type("AMD Radeon Graphics", arch="gfx942", memory_gib=191.98, compute_units=304) == "MI300X"
    assert detect_device_type("AMD Radeon Graphics", arch="gfx942", memory_gib=191.98, compute_units=80) == ""


@pytest.mark.parametrize("key", sorted(CATALOG))
def test_every_entry_is_complete(key):
    spec = CATALOG[key]
    assert spec.name == key and spec.vendor in DEVICE_VENDORS
    for value in (spec.peak_bf16_tflops, spec.memory_gib, spec.memory_bandwidth_tbs, spec.intra_node_link_gbs,
                  spec.host_link_gbs):
        assert value > 0
    assert 0 < spec.efficiency <= 1
    assert device_spec(key.lower()) is spec


def test_existing_keys_keep_their_figures():
    # Configs, benchmarks and tests name these; their numbers are unchanged.
    expected = {"H100": (989.0, 80.0, 900.0), "H200": (989.0, 141.0, 900.0), "A100": (312.0, 80.0, 600.0),
                "A100-40GB": (312.0, 40.0, 600.0), "MI250X": (191.5, 64.0, 400.0),
                "MI300X": (1307.4, 192.0, 896.0), "MI325X": (1307.4, 256.0, 896.0), "CPU": (1.0, 24.0, 10.0)}
    for key, (peak, memory, link) in expected.items():
        spec = device_spec(key)
        assert (spec.peak_bf16_tflops, spec.memory_gib, spec.intra_node_link_gbs) == (peak, memory, link)


def _docs_catalog_rows() -> dict[str, list[str]]:
    """The rows of docs/partitioner.md's catalog table, by the backquoted key in the first cell."""
    text = DOCS.read_text()
    section = text[text.index("## Device catalog"):text.index("## The cost model")]
    lines = section.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| device | vendor |"))
    rows = {}
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        key = re.match(r"`([^`]+)`", cells[0])
        assert key, f"catalog table row without a `key`: {line}"
        rows[key.group(1)] = cells
    return rows


def _number(cell: str) -> float:
    return float(re.match(r"[\d.]+", cell.replace(",", "")).group(0))


def test_docs_table_lists_every_entry_with_its_figures_and_a_source():
    rows = _docs_catalog_rows()
    assert set(rows) == set(CATALOG), "every catalog entry needs a row (and a source) in docs/partitioner.md"
    for key, cells in rows.items():
        spec = CATALOG[key]
        vendor, peak, memory, bandwidth, link, host, efficiency, source = cells[1:9]
        assert vendor == spec.vendor, key
        assert _number(peak) == spec.peak_bf16_tflops, key
        assert _number(memory) == spec.memory_gib, key
        assert _number(bandwidth) == spec.memory_bandwidth_tbs, key
        assert _number(link) == spec.intra_node_link_gbs, key
        assert _number(host) == spec.host_link_gbs, key
        assert _number(efficiency) == spec.efficiency, key
        assert len(source) > 10, f"{key}: no source"


def test_catalog_with_overrides_and_extends_the_new_entries():
    catalog = catalog_with({"h200-nvl": {"intra_node_link_gbs": 900.0}, "RTX4090": {"efficiency": 0.6},
                            "B300": {"vendor": "nvidia", "peak_bf16_tflops": 2250.0, "memory_gib": 268.0,
                                     "memory_bandwidth_tbs": 8.0, "intra_node_link_gbs": 1800.0}})
    assert catalog["H200-NVL"].intra_node_link_gbs == 900.0 and CATALOG["H200-NVL"].intra_node_link_gbs == 128.0
    assert catalog["RTX4090"].efficiency == 0.6 and set(CATALOG) < set(catalog)
    assert detect_device_type("NVIDIA B300 SXM6 AC", catalog) == "B300"
    assert detect_device_type("NVIDIA B300 SXM6 AC") == ""
    assert detect_device_type("NVIDIA B200", catalog) == "B200"
    assert detect_device_type("AMD Radeon Graphics", catalog, arch="gfx942", memory_gib=255.98) == "MI325X"


def test_detection_only_returns_keys_of_the_catalog_given():
    base = {key: spec for key, spec in CATALOG.items() if key not in ("H100-PCIe", "MI300X", "RX7900XTX")}
    assert detect_device_type("NVIDIA H100 NVL", base) == "H100"  # the alias needs its key
    assert detect_device_type("NVIDIA H100 PCIe", base) == "H100"
    assert detect_device_type("AMD Radeon Graphics", base, arch="gfx942", memory_gib=191.98) == ""
    assert detect_device_type("AMD Radeon Graphics", base, arch="gfx1100", memory_gib=47.98) == "W7900"
    assert detect_device_type("AMD Radeon Graphics", base, arch="gfx1100") == "W7900"


def test_docs_fp8_table_lists_every_fp8_device_with_its_format_and_peak():
    text = DOCS.read_text()
    section = text[text.index("## Device catalog"):text.index("## The cost model")]
    lines = section.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| device | FP8 format |"))
    rows = {}
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[re.match(r"`([^`]+)`", cells[0]).group(1)] = cells
    assert set(rows) == {key for key, spec in CATALOG.items() if spec.fp8_format is not None}
    for key, (_, fmt, peak, source) in rows.items():
        assert (fmt, _number(peak)) == (CATALOG[key].fp8_format, CATALOG[key].peak_fp8_tflops), key
        assert len(source) > 10, f"{key}: no source"
