"""Profile files (``hetpipe-profile/1``): their format, reading, writing, and the entry the planner uses.

``python -m hetpipe.plan profile`` measures (:mod:`hetpipe.partitioner.profile`,
which describes the format) and files its entry here; the planner reads
entries through :func:`planner_profiles` and :func:`find_entry`. Nothing here
needs torch, so planning imports none.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from hetpipe.errors import ConfigError
from hetpipe.models.families import spec_of
from hetpipe.models.model_config import ModelConfig
from hetpipe.models.train_modes import RECOMPUTE_MODES

PROFILE_FORMAT = "hetpipe-profile/1"
UNIT_KINDS = ("embedding", "layer", "head")


def profile_shape(model: ModelConfig, seq_length: int, precision: str,
                  fused_elementwise: bool = False) -> dict[str, Any]:
    """What a measurement depends on besides the microbatch size (the layer count does not matter)."""
    return {"hidden_size": model.hidden_size, "ffn_hidden_size": model.ffn_hidden_size,
            "num_attention_heads": model.num_attention_heads, "num_query_groups": model.num_query_groups,
            "head_dim": model.head_dim, "vocab_size": model.vocab_size,
            "add_qkv_bias": model.add_qkv_bias, "seq_length": seq_length, "precision": precision,
            "fused_elementwise": fused_elementwise, **spec_of(model).layer_shape_fields()}


def load_profile(path: str | Path) -> dict[str, list[dict]]:
    """The ``devices`` table of a profile file: device type -> list of entries."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"profile file {p} not found (make one with `python -m hetpipe.plan profile ...`)")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"profile file {p} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise ConfigError(f"profile file {p} is not a {PROFILE_FORMAT} file")
    devices = data.get("devices", {})
    for device, entries in devices.items():
        for entry in entries:
            missing = [k for k in UNIT_KINDS if k not in entry.get("units", {})]
            if missing or "shape" not in entry or "micro_batch_size" not in entry:
                raise ConfigError(f"profile file {p}: an entry for {device} lacks "
                                  f"{missing or ['shape/micro_batch_size']}")
            unknown = sorted(set(entry.get("recompute", {})) - set(RECOMPUTE_MODES[1:]))
            if unknown:
                raise ConfigError(f"profile file {p}: an entry for {device} has recompute modes {unknown}; "
                                  f"known: {', '.join(RECOMPUTE_MODES[1:])}")
    return devices


# Profiles measured on the lent machines, shipped with the package: the
# planner uses the entries of the device type it plans for (H100 for a group
# detected or declared H100) unless planner.builtin_profiles=false.
BUILTIN_PROFILES = Path(__file__).resolve().parent / "profiles"


def planner_profiles(path: Optional[str], builtin: bool = True) -> dict[str, list[dict]]:
    """The profile entries the planner looks costs up in: the file ``path``
    (its entries win over the built-in ones of the same device) and, with
    ``builtin``, every built-in profile."""
    files = ([Path(path)] if path else []) + (sorted(BUILTIN_PROFILES.glob("*.json")) if builtin else [])
    devices: dict[str, list[dict]] = {}
    for f in files:
        for device, entries in load_profile(f).items():
            devices.setdefault(device, []).extend(entries)
    return devices


def find_entry(devices: dict[str, list[dict]], device_type: str, shape: dict[str, Any],
               micro_batch_size: int) -> Optional[dict]:
    """The entry measured on ``device_type`` at ``shape``; one at the same
    microbatch size is preferred (no scaling needed)."""
    entries = [e for key, es in devices.items() if key.lower() == device_type.lower() for e in es
               if e["shape"] == shape]
    exact = [e for e in entries if e["micro_batch_size"] == micro_batch_size]
    return (exact or entries or [None])[0]


def save_entry(path: str | Path, device_type: str, entry: dict) -> None:
    """Add ``entry`` to the profile file (created if missing), replacing an
    entry of the same device, shape and microbatch size."""
    p = Path(path)
    data = {"format": PROFILE_FORMAT, "devices": {}}
    if p.is_file():
        load_profile(p)  # refuse to overwrite something that is not a profile
        data = json.loads(p.read_text())
    entries = data["devices"].setdefault(device_type, [])
    entries[:] = [e for e in entries if (e["shape"], e["micro_batch_size"])
                  != (entry["shape"], entry["micro_batch_size"])]
    entries.append(entry)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
