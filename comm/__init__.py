"""Communication (installed as ``hetpipe.comm``): vendor detection now; process
groups and the cross-vendor boundary channels build on it."""
from hetpipe.comm.vendor import accelerator_name, detect_vendor

__all__ = ["accelerator_name", "detect_vendor"]
