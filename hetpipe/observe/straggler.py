"""The straggler report: the slowest rank's busy time against its stage's median.

In a mixed cluster one slow node (a throttled GPU, a NIC at a tenth of its
rate, a noisy neighbour) sets every stage's pace, and the step time alone
does not say which. Each rank measures its busy time per step (host time
from the step's start to its gradient exchange, less the time the engine
was blocked on a pipeline neighbour, :attr:`PipelineEngine.wait_s`);
the values ride on the step's gradient exchange, and rank 0 averages them
over the log interval. A rank far above its stage's median is a straggler
within a stage (one DP or TP rank of several); a stage whose median is far
above the others' is a slow stage (a partition or a device that is off).
The log line names the slowest rank, its ratio to the median rank, and every
stage's median; metrics.jsonl keeps every rank's mean.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Any, Sequence

import torch


@dataclass
class StragglerReport:
    """Per-rank busy seconds summed over a log interval, read as a report."""

    stage_of: Sequence[int]  # global rank -> pipeline stage (pp rank)

    def __post_init__(self) -> None:
        self._sums = torch.zeros(len(self.stage_of), dtype=torch.float64)
        self._steps = 0

    def add(self, busy_s: torch.Tensor) -> None:
        """One step's busy seconds, one per global rank."""
        self._sums += busy_s.double().reshape(-1)
        self._steps += 1

    def take(self) -> dict[str, Any]:
        """The interval's report (metrics.jsonl fields), and start the next interval."""
        if not self._steps:
            return {}
        mean = (self._sums / self._steps).tolist()
        self._sums.zero_()
        self._steps = 0
        stages = sorted(set(self.stage_of))
        medians = [median(mean[r] for r in range(len(mean)) if self.stage_of[r] == s) for s in stages]
        slowest = max(range(len(mean)), key=lambda r: mean[r])
        stage = self.stage_of[slowest]
        return {"straggler_rank": slowest, "straggler_stage": stage, "straggler_busy_s": mean[slowest],
                "median_busy_s": median(mean), "stage_median_busy_s": medians, "rank_busy_s": mean}


def describe(report: dict[str, Any]) -> str:
    """The log line's fragment for a report of :meth:`StragglerReport.take`."""
    if not report:
        return ""
    overall = report["median_busy_s"]
    ratio = report["straggler_busy_s"] / overall if overall > 0 else float("inf")
    medians = "/".join(f"{m:.3f}" for m in report["stage_median_busy_s"])
    return (f" | slowest rank {report['straggler_rank']} (stage {report['straggler_stage']}) busy "
            f"{report['straggler_busy_s']:.3f} s, {ratio:.2f}x the median rank; stage medians {medians} s")
