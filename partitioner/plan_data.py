"""The partition plan: which layers each pipeline stage holds, and where - the data
class :class:`Plan` (``python -m hetpipe.plan``, hetpipe/plan.py, is the command that prints one).

A plan is data (YAML-serialisable): the partitioner writes one, and
``pretrain`` reads one or builds it from explicit overrides such as
``partition.layers=[15,17]``. Stages are *virtual* stages in pipeline order;
with several chunks per rank (``num_chunks`` > 1) :mod:`hetpipe.pipeline.placement`
says which rank holds which: r, r + P, r + 2P, ... interleaved, or r and
2P - 1 - r in zb_v's V. The embedding always sits on the first virtual stage
and the output head on the last, so a stage's unit range is its layers plus
those.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import yaml

from hetpipe.errors import ConfigError
from hetpipe.models.train_modes import RECOMPUTE_MODES
from hetpipe.pipeline.microbatches import microbatches_per_step
from hetpipe.pipeline.placement import Placement
from hetpipe.pipeline.registry import DEFAULT_SCHEDULE, SCHEDULES, Schedule, schedule_spec, several_chunks

if TYPE_CHECKING:
    from hetpipe.partitioner.inputs import TrainShape


@dataclass
class StagePlan:
    # The vendor group this stage runs in.
    group: str
    # Global ranks of the stage: TP x CP x DP of them, index (d * cp + c) * tp + t.
    ranks: List[int]
    # Decoder layers this (virtual) stage holds.
    layers: int
    tp: int = 1
    dp: int = 1
    # Activation recomputation of the stage's decoder layers: none, selective
    # or full (hetpipe.models.recompute), for its first recompute_num_layers
    # layers (None: all of them).
    recompute: str = "none"
    recompute_num_layers: Optional[int] = None
    # Context-parallel degree: each sequence split over cp ranks (hetpipe.parallel.context).
    cp: int = 1


@dataclass
class Plan:
    stages: List[StagePlan]
    schedule: str = DEFAULT_SCHEDULE
    num_chunks: int = 1
    notes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"plan schedule {self.schedule!r} is not one of {tuple(SCHEDULES)}")
        spec = self.spec
        if self.num_chunks < 1 or len(self.stages) % self.num_chunks:
            raise ConfigError(f"plan has {len(self.stages)} stages, not a multiple of num_chunks={self.num_chunks}")
        spec.check_placement(self.num_chunks)
        if self.num_chunks > 1 and spec.chunks == 1:
            raise ConfigError(f"num_chunks > 1 needs schedule={several_chunks()}")
        if any(s.layers < 0 for s in self.stages):
            raise ConfigError(f"plan has a negative layer count: {[s.layers for s in self.stages]}")
        for v, s in enumerate(self.stages):
            if s.recompute not in RECOMPUTE_MODES:
                raise ConfigError(f"plan stage {v}: recompute {s.recompute!r} is not one of "
                                  f"{', '.join(RECOMPUTE_MODES)}")
            if s.recompute_num_layers is not None and s.recompute_num_layers < 0:
                raise ConfigError(f"plan stage {v}: recompute_num_layers={s.recompute_num_layers} is negative")
            if spec.split_backward and s.recompute == "full":
                # W reruns single nodes of a layer's graph after B; a fully
                # recomputed layer would rerun its whole forward for each.
                raise ConfigError(f"plan stage {v}: recompute=full cannot run under schedule {self.schedule} "
                                  "(its deferred weight gradients would recompute the layer again); use selective")

    @property
    def pipeline_size(self) -> int:
        """Pipeline ranks (P); virtual stages = P * num_chunks."""
        return len(self.stages) // self.num_chunks

    @property
    def spec(self) -> Schedule:
        """The schedule's registry entry (hetpipe/pipeline/registry.py)."""
        return schedule_spec(self.schedule)

    @property
    def placement(self) -> Placement:
        """Which virtual stage each (pipeline rank, chunk) holds under this plan's schedule."""
        return Placement(self.schedule, self.pipeline_size, self.num_chunks)

    @property
    def dp(self) -> int:
        """Data-parallel degree: every stage's (resolve.check_runnable holds them equal)."""
        return self.stages[0].dp

    def microbatches(self, train: TrainShape) -> int:
        """Microbatches each pipeline replica runs per optimizer step: ``train``'s
        global batch over this plan's DP replicas. The engine's schedule, the DP
        reducer, the validator, the step's loss and the memory model read it here."""
        return microbatches_per_step(train.global_batch_size, train.micro_batch_size, self.dp)

    @property
    def num_layers(self) -> int:
        return sum(s.layers for s in self.stages)

    def unit_ranges(self) -> list[tuple[int, int]]:
        """[start, stop) model-unit range of each virtual stage (unit 0 = embedding)."""
        bounds = unit_bounds([s.layers for s in self.stages])
        return list(zip(bounds, bounds[1:]))

    def check_model(self, num_layers: int) -> None:
        if self.num_layers != num_layers:
            raise ConfigError(f"plan splits {self.num_layers} layers ({[s.layers for s in self.stages]}) "
                              f"but the model has {num_layers}")
        empty = [v for v, (a, b) in enumerate(self.unit_ranges()) if a == b]
        if empty:
            raise ConfigError(f"plan gives virtual stage(s) {empty} no model units")

    def to_yaml(self) -> str:
        return yaml.safe_dump(asdict(self), sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        # Plans written before recomputation was per stage say `recompute:
        # false` for the whole plan (true was never runnable).
        if data.get("recompute") is False:
            data = {k: v for k, v in data.items() if k != "recompute"}
        try:
            stages = [StagePlan(**s) for s in data["stages"]]
            return cls(stages=stages, **{k: v for k, v in data.items() if k != "stages"})
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"malformed plan: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"plan file {p} not found")
        return cls.from_dict(yaml.safe_load(p.read_text()) or {})


def unit_bounds(layers: list[int]) -> list[int]:
    """Model-unit boundaries of (virtual) stages holding ``layers`` decoder layers
    each, the embedding joining the first and the head the last."""
    bounds = [0]
    for v, n in enumerate(layers):
        bounds.append(bounds[-1] + n + (v == 0) + (v == len(layers) - 1))
    return bounds


def even_split(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible; the first and last stages, which
    also hold the embedding and the head, get the smaller shares."""
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    # Hand the remainder to the middle stages first, then inwards from the ends.
    order = sorted(range(num_stages), key=lambda i: (i in (0, num_stages - 1), abs(i - (num_stages - 1) / 2)))
    for i in order[:extra]:
        counts[i] += 1
    return counts


def v_layers(per_rank: list[int]) -> list[int]:
    """A V split (virtual stages 0..2P-1, rank r holding r and 2P-1-r) that gives
    each rank the layers a one-chunk split gives it: rank r's chunk 0 gets the
    larger half. E.g. PP2's [17, 15] -> [9, 8, 7, 8] in pipeline order."""
    P = len(per_rank)
    first = [n - n // 2 for n in per_rank]
    return first + [per_rank[r] // 2 for r in reversed(range(P))]
