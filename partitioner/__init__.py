"""Partitioner (installed as ``hetpipe.partitioner``): the device catalog now;
the cost model and plan solver build on it."""
from hetpipe.partitioner.catalog import CATALOG, DeviceSpec, detect_device_type, device_spec

__all__ = ["CATALOG", "DeviceSpec", "detect_device_type", "device_spec"]
