"""Which precision each vendor group trains in, and whether its devices can run it.

``train.precision`` is the job's; ``cluster.groups[i].precision`` overrides it
for group i (models/precision.py lists the modes). ``fp8`` needs FP8 tensor
cores, which the device catalog says per device (``DeviceSpec.fp8_format``): a
group on a device without them (A100, MI210, a CPU) stops the job in one line
that says how to train that group in bf16 instead. The two vendor groups of a
job may compute in different FP8 pairs (OCP on H200, fnuz on MI300X); their
boundary messages are bf16 either way.
"""
from __future__ import annotations

from typing import Mapping, Optional

from hetpipe.devices.cluster import ClusterConfig
from hetpipe.devices.catalog import DeviceSpec, device_spec
from hetpipe.devices.facts import local_devices
from hetpipe.errors import ConfigError


def group_precision(train_precision: str, group_override: Optional[str]) -> str:
    """The ``train.precision`` value a group runs: its own, else the job's."""
    return group_override if group_override is not None else train_precision


def _asked(train_precision: str, group_override: Optional[str], index: int) -> str:
    """The setting that asked for fp8, as the user wrote it."""
    return f"cluster.groups.{index}.precision=fp8" if group_override is not None else \
        f"train.precision={train_precision}"


def fp8_format(train_precision: str, group_override: Optional[str], index: int, group_name: str,
               device_type: str, catalog: Optional[Mapping[str, DeviceSpec]] = None) -> str:
    """The FP8 format (catalog.FP8_FORMATS) group ``index`` computes in on ``device_type``,
    or ConfigError where that device has no FP8."""
    asked = _asked(train_precision, group_override, index)
    if not device_type:
        raise ConfigError(f"{asked}: group {group_name!r} runs on a device the catalog does not know, so "
                          "its FP8 support is unknown: add it with planner.catalog (fp8_format, "
                          "peak_fp8_tflops)")
    spec = device_spec(device_type, catalog)
    if spec.fp8_format is None:
        raise ConfigError(f"{asked} needs FP8 tensor cores, and group {group_name!r} runs on {spec.name}, "
                          f"which has none (device catalog): set cluster.groups.{index}.precision=bf16 to "
                          "train that group in bf16")
    return spec.fp8_format


def check_local_fp8(cluster: ClusterConfig, train_precision: str,
                    catalog: Optional[Mapping[str, DeviceSpec]] = None) -> None:
    """Before a launcher on this machine starts the ranks: every fp8 group's local
    devices have FP8 (each rank checks its own again, :func:`fp8_format`)."""
    devices = local_devices(cluster, catalog)
    for index, group in enumerate(cluster.groups):
        if group_precision(train_precision, group.precision) != "fp8":
            continue
        for rank in cluster.group_ranks(index):
            if rank in devices:
                fp8_format(train_precision, group.precision, index, group.name, devices[rank].device_type, catalog)
