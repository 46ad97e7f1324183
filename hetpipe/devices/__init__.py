"""Devices: what kinds exist, what this process runs on and how a cluster groups them.
Part of the ground floor (docs/architecture.md, "Layers"): it imports only errors, so
the planner, the launcher and the trainer all read devices the same way.

* :mod:`~hetpipe.devices.catalog` - the device catalog (peak FLOP/s, memory, bandwidth
  per kind, with sources) and the mapping from what a runtime reports to a catalog key;
* :mod:`~hetpipe.devices.facts` - one rank's device as its runtime reports it (name,
  vendor, build, arch, memory, catalog key), the roll call's devices line and the
  check of declared against real devices;
* :mod:`~hetpipe.devices.vendor` - which vendor's runtime this process has;
* :mod:`~hetpipe.devices.cluster` - the cluster config: vendor groups of devices and the
  transport settings between them.
"""
