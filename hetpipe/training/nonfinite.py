"""Skip an optimizer step whose loss or gradient norm is not finite.

A loss spike that overflows (or a bad batch, or a flaky device) gives an inf
or NaN gradient norm. Applying that step would write NaN into every weight
and AdamW moment, and the run would be lost back to its last checkpoint. The
global norm and the global loss are known on every rank after the clip's one
exchange (:class:`hetpipe.training.gradients.GradNormClipper`), so every rank takes the
same decision from the same numbers without another collective: a
non-finite step is skipped everywhere (no weight or optimizer-state change),
and a run that keeps producing them stops with an error instead of spinning.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from hetpipe.errors import HetpipeError


class TrainingDiverged(HetpipeError):
    """``train.max_skipped_steps`` consecutive steps had a non-finite loss or gradient norm."""


class NonFiniteGuard:
    """Counts consecutive non-finite steps; decides skip or apply."""

    def __init__(self, max_skipped_steps: int) -> None:
        self.max_skipped_steps = max_skipped_steps
        self.consecutive = 0
        self.total = 0

    def check(self, step: int, grad_norm: torch.Tensor, loss: Optional[torch.Tensor]) -> Optional[str]:
        """None to apply step ``step`` (1-based); else why it is skipped.

        Raises :class:`TrainingDiverged` at the ``max_skipped_steps``-th skip
        in a row. ``loss`` is None where no rank reports one (not the case in
        training; kept for callers without a loss). One host read of each
        value: on a one-GPU run that is the step's only synchronisation.
        """
        values = {"grad norm": float(grad_norm)}
        if loss is not None:
            values["loss"] = float(loss)
        bad = [f"{name} {value}" for name, value in values.items() if not math.isfinite(value)]
        if not bad:
            self.consecutive = 0
            return None
        self.consecutive += 1
        self.total += 1
        reason = " and ".join(bad)
        if self.consecutive >= self.max_skipped_steps:
            raise TrainingDiverged(
                f"training diverged: step {step} had {reason}, {self.consecutive} non-finite steps in a row "
                f"(train.max_skipped_steps={self.max_skipped_steps}); none was applied, so the last "
                "checkpoint is the last good state: resume from it with a lower optimizer.lr or a smaller "
                "optimizer.clip_grad")
        return reason
