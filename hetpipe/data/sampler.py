"""Which samples each data-parallel rank trains on at each step, reproducibly.

The order is defined globally, not per rank: epoch ``e`` visits the samples
in the permutation drawn from ``default_rng([seed, e])``, and step ``k`` takes
the next ``global_batch_size`` positions of that endless sequence. Each DP
rank then takes its contiguous share. Because the only running state is
``consumed_samples`` (Megatron's name), a resumed run continues the exact
order, and it may even resume with a different DP size or micro-batch size
and still see the same global batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hetpipe.errors import ConfigError


class GlobalBatchSampler:
    """Deterministic global sample order, split into this rank's micro-batches."""

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 1234,
        consumed_samples: int = 0,
    ) -> None:
        for name, value in (
            ("num_samples", num_samples),
            ("global_batch_size", global_batch_size),
            ("micro_batch_size", micro_batch_size),
            ("dp_size", dp_size),
        ):
            if value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        if not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        if global_batch_size % (micro_batch_size * dp_size):
            raise ConfigError(
                f"global_batch_size {global_batch_size} is not divisible by "
                f"micro_batch_size {micro_batch_size} x data-parallel size {dp_size}"
            )
        if consumed_samples < 0:
            raise ConfigError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.consumed_samples = consumed_samples
        self.num_microbatches = global_batch_size // (micro_batch_size * dp_size)
        # Only the current epoch's permutation is kept: an epoch of a large
        # corpus is hundreds of MB of int64, and order only ever moves forward.
        self._epoch = -1
        self._permutation = np.empty(0, dtype=np.int64)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._permutation = np.random.default_rng([self.seed, epoch]).permutation(
                self.num_samples
            )
            self._epoch = epoch
        return self._permutation

    def global_batch(self) -> np.ndarray:
        """Sample indices of the next global batch (all ranks), without advancing."""
        out = np.empty(self.global_batch_size, dtype=np.int64)
        position, filled = self.consumed_samples, 0
        # A global batch may straddle epochs (or several, for tiny datasets).
        while filled < self.global_batch_size:
            epoch, within = divmod(position, self.num_samples)
            take = min(self.num_samples - within, self.global_batch_size - filled)
            out[filled : filled + take] = self._order(epoch)[within : within + take]
            filled += take
            position += take
        return out

    def next_step(self) -> list[np.ndarray]:
        """This rank's micro-batches (arrays of sample indices) for the next step."""
        share = self.global_batch_size // self.dp_size
        mine = self.global_batch()[self.dp_rank * share : (self.dp_rank + 1) * share]
        self.consumed_samples += self.global_batch_size
        return list(mine.reshape(self.num_microbatches, self.micro_batch_size))

    def state_dict(self) -> dict[str, int]:
        """JSON-able state for checkpoints."""
        return {
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; refuses state from a different order."""
        missing = {"consumed_samples", "seed", "num_samples", "global_batch_size"} - set(state)
        if missing:
            raise ConfigError(f"sampler state lacks {', '.join(sorted(missing))}")
        for key, hint in (
            ("seed", "the sample order depends on it"),
            ("num_samples", "different data or seq_length?"),
            ("global_batch_size", "steps would no longer line up with consumed samples"),
        ):
            if int(state[key]) != getattr(self, key):
                raise ConfigError(
                    f"checkpointed sampler state has {key}={state[key]} but this run has "
                    f"{key}={getattr(self, key)} ({hint})"
                )
        consumed = int(state["consumed_samples"])
        if consumed < 0:
            raise ConfigError(f"checkpointed consumed_samples must be >= 0, got {consumed}")
        self.consumed_samples = consumed
