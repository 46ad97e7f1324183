"""Partitioner (installed as ``hetpipe.partitioner``): which layers each pipeline
stage holds, on which devices, with which parallelism.

The device catalog and per-unit cost model (``catalog``, ``cost``, ``profile``)
feed the solver (``solver``), whose result is a :class:`Plan` - data that
``pretrain`` runs. ``plan_for`` is the one call a runner needs.
"""
from hetpipe.partitioner.catalog import CATALOG, DeviceSpec, catalog_with, detect_device_type, device_spec
from hetpipe.partitioner.plan import Plan, StagePlan, even_split
from hetpipe.partitioner.solver import PlannerConfig, Solution, plan_for, solve

__all__ = ["CATALOG", "DeviceSpec", "catalog_with", "detect_device_type", "device_spec", "Plan", "StagePlan",
           "even_split", "PlannerConfig", "Solution", "plan_for", "solve"]
