"""One corpus's endless, reproducible sample order: a fresh shuffle every epoch.

Epoch ``e`` of stream ``s`` visits the samples in the permutation drawn from
``default_rng([seed, e])`` for stream 0 and ``default_rng([seed, e, s])``
otherwise. Stream 0 is the order a single corpus has always had, so runs
and checkpoints from before blends existed keep their order; the sources of
a blend after the first take streams 1, 2, ... so that no two sources of
equal size share a shuffle.
"""

from __future__ import annotations

import numpy as np


class EpochOrder:
    """Position ``p`` of the order is sample ``permutation(p // n)[p % n]``."""

    def __init__(self, num_samples: int, seed: int, stream: int = 0) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.stream = stream
        # Only the current epoch's permutation is kept: an epoch of a large
        # corpus is hundreds of MB of int64, and order only ever moves forward.
        self._epoch = -1
        self._permutation = np.empty(0, dtype=np.int64)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            key = [self.seed, epoch] if self.stream == 0 else [self.seed, epoch, self.stream]
            self._permutation = np.random.default_rng(key).permutation(self.num_samples)
            self._epoch = epoch
        return self._permutation

    def take(self, position: int, count: int) -> np.ndarray:
        """Sample indices at positions ``[position, position + count)``."""
        out = np.empty(count, dtype=np.int64)
        filled = 0
        # A request may straddle epochs (or several, for tiny datasets).
        while filled < count:
            epoch, within = divmod(position, self.num_samples)
            take = min(self.num_samples - within, count - filled)
            out[filled : filled + take] = self._epoch_order(epoch)[within : within + take]
            filled += take
            position += take
        return out
