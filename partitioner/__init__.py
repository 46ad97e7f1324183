"""Partitioner (installed as ``hetpipe.partitioner``): which layers each pipeline
stage holds, on which devices, with which parallelism.

The device catalog and per-unit cost model (``catalog``, ``cost``, ``profile``)
price candidate layouts (``cost_context``); the search (``solver``) picks the
best candidate and its exact layer split (``split``) under the planner's
settings (``planner_config``), and ``report`` describes the result, a
:class:`Plan` - data that ``pretrain`` runs. ``resolve.resolve_plan`` is the
one call a runner needs: explicit overrides, ``plan=auto`` or a plan file,
then the checks. The partitioner reads the runtime's configs only through the
protocols in ``inputs``.

The package's modules import one another by their own path (``import
hetpipe.partitioner.cost as cost``), never through this package: it imports
the solver and the report, which import them, so a sibling reached through it
would be an import loop.
"""
from hetpipe.devices.catalog import CATALOG, DeviceSpec, catalog_with, detect_device_type, device_spec
from hetpipe.partitioner.plan_data import Plan, StagePlan, even_split
from hetpipe.partitioner.planner_config import PlannerConfig
from hetpipe.partitioner.report import Solution
from hetpipe.partitioner.solver import plan_for, solve

__all__ = ["CATALOG", "DeviceSpec", "catalog_with", "detect_device_type", "device_spec", "Plan", "StagePlan",
           "even_split", "PlannerConfig", "Solution", "plan_for", "solve"]
