"""Every field of a manifest, checked against the checksummed state it describes.

A manifest is JSON that anyone can edit; an edited ``step`` once made a run
resume "after step 30" from the state of step 20, and an edited
``world_size`` loaded. So each field is compared with what it describes:
``step`` with ``trainer_state.json`` (whose sha256 the manifest lists) and
with the directory's name, ``world_size`` with the ranks list, the plan and
the per-rank RNG files, each rank's units with the plan, ``model`` with the
shapes of the saved tensors. A mismatch is one sentence naming the field and
both values. Last, the manifest's sha256 of itself catches any other edit
("manifest.json was edited"); the field checks come first so that the
message names the field where one applies.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from hetpipe.checkpoint.digest import SELF_CHECKSUM, manifest_digest
from hetpipe.checkpoint.errors import CheckpointError
from hetpipe.checkpoint.layout import TRAINER_STATE, iter_dir_name, rng_file
from hetpipe.checkpoint.names import whole_model_shapes
from hetpipe.errors import HetpipeError

if TYPE_CHECKING:
    from hetpipe.checkpoint.manifest import Checkpoint

_ITER = re.compile(r"^iter_(\d{7,})$")
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def _int(ckpt: Checkpoint, field: str) -> int:
    value = ckpt.manifest[field]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointError(f"{ckpt.manifest_path}: {field} is {value!r}, not a non-negative integer")
    return value


def _span(ranks: list[int]) -> str:
    return f"ranks {ranks[0]}-{ranks[-1]} ({len(ranks)})" if ranks else "no ranks"


def _check_step(ckpt: Checkpoint, step: int) -> None:
    if TRAINER_STATE not in ckpt.files:
        raise CheckpointError(f"{ckpt.manifest_path} lists no {TRAINER_STATE}")
    state = ckpt.read_json(TRAINER_STATE)  # verified against its sha256 first
    saved = state.get("step") if isinstance(state, dict) else None
    if saved != step:
        raise CheckpointError(f"{ckpt.manifest_path} says step {step}, but {TRAINER_STATE} (checksummed) "
                              f"says step {saved}")
    match = _ITER.match(ckpt.path.name)
    if match and int(match.group(1)) != step:
        raise CheckpointError(f"checkpoint directory {ckpt.path} is named for step {int(match.group(1))}, but "
                              f"its {ckpt.manifest_path.name} and {TRAINER_STATE} say step {step} "
                              f"(was it renamed? it should be {iter_dir_name(step)})")


def _check_ranks(ckpt: Checkpoint, world: int) -> None:
    manifest = ckpt.manifest
    try:
        listed = sorted(int(e["rank"]) for e in manifest["ranks"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{ckpt.manifest_path} has a malformed ranks list") from None
    if listed != list(range(world)):
        raise CheckpointError(f"{ckpt.manifest_path} says world_size {world}, but its ranks list holds "
                              f"{_span(listed)}")
    for name, record in ckpt.files.items():
        if not _PLAIN_NAME.match(name):
            raise CheckpointError(f"{ckpt.manifest_path} lists a file named {name!r}, which is not a plain file name")
        writer = record.get("rank")
        if writer is not None and not (isinstance(writer, int) and 0 <= writer < world):
            raise CheckpointError(f"{ckpt.manifest_path} says world_size {world}, but file {name} was written "
                                  f"by rank {writer}")
    if manifest["version"] >= 2:
        for r in range(world):
            if rng_file(r) not in ckpt.files:
                raise CheckpointError(f"{ckpt.manifest_path} says world_size {world}, but lists no "
                                      f"{rng_file(r)} for rank {r}")
    if manifest.get("plan") is not None:
        _check_plan(ckpt, world)


def _check_plan(ckpt: Checkpoint, world: int) -> None:
    from hetpipe.partitioner.plan_data import Plan

    try:
        plan = Plan.from_dict(dict(ckpt.manifest["plan"]))
    except (HetpipeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{ckpt.manifest_path} has a malformed plan: {exc}") from None
    stages = plan.stages[:plan.pipeline_size]
    in_plan = sorted(r for s in stages for r in s.ranks)
    if in_plan != list(range(world)):
        raise CheckpointError(f"{ckpt.manifest_path} says world_size {world}, but its plan places "
                              f"{_span(in_plan)}")
    ranges = plan.unit_ranges()
    for pp, stage in enumerate(stages):
        units = [list(ranges[plan.placement.stage(pp, c)]) for c in range(plan.num_chunks)]
        for r in stage.ranks:
            if ckpt.units_of(r) != units:
                raise CheckpointError(f"{ckpt.manifest_path} says rank {r} held units {ckpt.units_of(r)}, but "
                                      f"its plan gives that rank {units}")


def _check_model(ckpt: Checkpoint) -> None:
    from hetpipe.models import ModelConfig

    try:
        expected = whole_model_shapes(ModelConfig(**ckpt.model))
    except (HetpipeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{ckpt.manifest_path} has a model config this hetpipe cannot read: "
                              f"{str(exc).splitlines()[0] if str(exc) else exc!r}") from None
    for name, entry in ckpt.entries.items():
        key, sep, param = name.partition("/")
        base = param if sep else name
        if base not in expected:
            raise CheckpointError(f"{ckpt.manifest_path} holds tensor {name}, which its model "
                                  f"({ckpt.model.get('name')}) does not have")
        if key != "step" and entry.shape != expected[base]:
            raise CheckpointError(f"{ckpt.manifest_path}'s model gives {base} the shape {list(expected[base])}, but "
                                  f"its tensor index says {name} has {list(entry.shape)}")
    absent = [name for name in expected if name not in ckpt.tensors]
    if absent:
        raise CheckpointError(f"{ckpt.manifest_path}'s model has tensor {absent[0]}, which the checkpoint "
                              "does not hold")


def check_manifest(ckpt: Checkpoint) -> None:
    """Raise on the first field of ``ckpt.manifest`` that its checkpoint contradicts."""
    step = _int(ckpt, "step")
    world = _int(ckpt, "world_size")
    _check_step(ckpt, step)
    _check_ranks(ckpt, world)
    _check_model(ckpt)
    manifest: dict[str, Any] = ckpt.manifest
    if manifest["version"] >= 2:
        if manifest.get(SELF_CHECKSUM) != manifest_digest(manifest):
            raise CheckpointError(f"{ckpt.manifest_path} was edited after it was written: its {SELF_CHECKSUM} "
                                  "does not match its contents")
