"""Which source each sample of a weighted blend comes from: Megatron's rule.

Megatron-Core's blended dataset (its ``build_blending_indices`` helper) gives
global sample position ``p`` to the source that lags its share the most: the
``i`` maximising ``w_i * max(p, 1) - c_i``, the first such ``i`` on ties,
where ``c_i`` counts the earlier positions source ``i`` got. No random
numbers are involved, so the realised mix follows the weights as closely as
integers can (with two sources each count stays within one sample of
``w_i * n``), and because the same doubles are compared in the same order,
the sequence of sources is Megatron's own. (The idea is Megatron's; this is
an independent implementation.)

The rule's state after ``n`` positions is just the per-source counts, so the
sampler checkpoints them and a resumed run continues without replaying a
sequence that is hundreds of millions of positions long in a real run.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class BlendSchedule:
    """The source of every global sample position, computed forward on demand."""

    def __init__(self, weights: Sequence[float]) -> None:
        self.weights = [float(w) for w in weights]
        self._position = 0
        self._counts = [0] * len(self.weights)
        # Where the latest request started: asking for the same positions
        # again (a peek before the step that consumes them) needs no replay.
        self._start = (0, list(self._counts))

    def _choose(self) -> int:
        t = float(max(self._position, 1))
        best, best_error = 0, self.weights[0] * t - self._counts[0]
        for i in range(1, len(self.weights)):
            error = self.weights[i] * t - self._counts[i]
            if error > best_error:
                best, best_error = i, error
        self._counts[best] += 1
        self._position += 1
        return best

    def _seek(self, position: int) -> None:
        if position < self._position:
            start, counts = self._start
            if position < start:
                start, counts = 0, [0] * len(self.weights)
            self._position, self._counts = start, list(counts)
        while self._position < position:
            self._choose()

    def assign(self, position: int, count: int) -> tuple[np.ndarray, list[int]]:
        """The source of each position in ``[position, position + count)``,
        and how many earlier positions each source had got."""
        if len(self.weights) == 1:
            return np.zeros(count, dtype=np.int64), [position]
        self._seek(position)
        self._start = (position, list(self._counts))
        sources = np.fromiter((self._choose() for _ in range(count)), dtype=np.int64, count=count)
        return sources, list(self._start[1])

    def counts_at(self, position: int) -> list[int]:
        """How many of the first ``position`` positions each source got."""
        if len(self.weights) == 1:
            return [position]
        self._seek(position)
        return list(self._counts)

    def restore(self, position: int, counts: Sequence[int]) -> None:
        """Continue from a checkpointed :meth:`counts_at` without replaying."""
        self._position, self._counts = position, [int(c) for c in counts]
        self._start = (position, list(self._counts))
