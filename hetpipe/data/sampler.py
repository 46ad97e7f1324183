"""Which samples each data-parallel rank trains on at each step, reproducibly.

The order is defined globally, not per rank: global position ``p`` draws
from the source :class:`~hetpipe.data.blend.BlendSchedule` assigns it (the
only source, without a blend), at that source's next position of its own
:class:`~hetpipe.data.epochs.EpochOrder`; step ``k`` takes the next
``global_batch_size`` positions of that endless sequence. Each DP rank then
takes its contiguous share. Because the running state is ``consumed_samples``
(Megatron's name), plus the per-source counts for a blend, a resumed run
continues the exact order, and it may even resume with a different DP size
or micro-batch size and still see the same global batches.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from hetpipe.pipeline.microbatches import microbatches_per_step
from hetpipe.data.blend import BlendSchedule
from hetpipe.data.epochs import EpochOrder
from hetpipe.errors import ConfigError


class GlobalBatchSampler:
    """Deterministic global sample order, split into this rank's micro-batches.

    ``num_samples`` is one corpus's sample count, or one count per source of
    a blend with ``weights`` (normalised) beside it; a blend's indices run
    over the sources' samples laid end to end, source 0's first.
    """

    def __init__(
        self,
        num_samples: int | Sequence[int],
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 1234,
        consumed_samples: int = 0,
        weights: Sequence[float] | None = None,
    ) -> None:
        sizes = [num_samples] if isinstance(num_samples, int) else list(num_samples)
        if (weights is None) != isinstance(num_samples, int) or (weights is not None and len(weights) != len(sizes)):
            raise ValueError("give one num_samples, or one per blend source with a weight each")
        for name, value in (
            ("num_samples", min(sizes, default=0)),
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
        # A single corpus's state reads as it always has (an int, no weights),
        # so checkpoints from before blends still load.
        self.num_samples: int | list[int] = num_samples if isinstance(num_samples, int) else sizes
        self.weights = None if weights is None else [float(w) for w in weights]
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.consumed_samples = consumed_samples
        self.num_microbatches = microbatches_per_step(global_batch_size, micro_batch_size, dp_size)
        self._orders = [EpochOrder(size, seed, stream) for stream, size in enumerate(sizes)]
        self._offsets = np.cumsum([0] + sizes[:-1])
        self._blend = BlendSchedule(self.weights or [1.0])
        self.last_batch: tuple[np.ndarray, np.ndarray] | None = None

    def global_batch(self) -> np.ndarray:
        """Sample indices of the next global batch (all ranks), without advancing."""
        return self._draw()[0]

    def _draw(self) -> tuple[np.ndarray, np.ndarray]:
        """The next global batch's sample indices and the blend source of each."""
        sources, before = self._blend.assign(self.consumed_samples, self.global_batch_size)
        out = np.empty(self.global_batch_size, dtype=np.int64)
        for source, order in enumerate(self._orders):
            where = np.flatnonzero(sources == source)
            if where.size:
                out[where] = self._offsets[source] + order.take(before[source], where.size)
        return out, sources

    def next_step(self) -> list[np.ndarray]:
        """This rank's micro-batches (arrays of sample indices) for the next step.

        The whole global batch stays in :attr:`last_batch` (indices, sources) until
        the next call: the record of what the step trained on (hetpipe.observe.sample_log).
        """
        self.last_batch = self._draw()
        share = self.global_batch_size // self.dp_size
        mine = self.last_batch[0][self.dp_rank * share : (self.dp_rank + 1) * share]
        self.consumed_samples += self.global_batch_size
        return list(mine.reshape(self.num_microbatches, self.micro_batch_size))

    def restart(self) -> None:
        """Back to the first position (validation reads the same batches every time)."""
        self.consumed_samples = 0

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state for checkpoints."""
        state: dict[str, Any] = {
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
        }
        if self.weights is not None:
            state["weights"] = self.weights
            state["source_consumed"] = self._blend.counts_at(self.consumed_samples)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; refuses state from a different order."""
        missing = {"consumed_samples", "seed", "num_samples", "global_batch_size"} - set(state)
        if missing:
            raise ConfigError(f"sampler state lacks {', '.join(sorted(missing))}")
        for key, hint in (
            ("seed", "the sample order depends on it"),
            ("num_samples", "different data, data.split or seq_length?"),
            ("weights", "the blend's weights changed"),
            ("global_batch_size", "steps would no longer line up with consumed samples"),
        ):
            if state.get(key) != getattr(self, key):
                raise ConfigError(
                    f"checkpointed sampler state has {key}={state.get(key)} but this run has "
                    f"{key}={getattr(self, key)} ({hint})"
                )
        consumed = int(state["consumed_samples"])
        if consumed < 0:
            raise ConfigError(f"checkpointed consumed_samples must be >= 0, got {consumed}")
        if self.weights is not None:
            counts = [int(c) for c in state.get("source_consumed", [])]
            if len(counts) != len(self.weights) or sum(counts) != consumed:
                raise ConfigError(f"checkpointed sampler state has source_consumed={state.get('source_consumed')}, "
                                  f"which does not split consumed_samples={consumed} over "
                                  f"{len(self.weights)} sources")
            self._blend.restore(consumed, counts)
        self.consumed_samples = consumed
