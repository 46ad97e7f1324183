"""What ``data.path`` names: one corpus, or Megatron's weighted blend of several.

Megatron-LM's ``--data-path`` is either a prefix or ``w1 prefix1 w2 prefix2
...`` with relative weights; accepting the same string means the data
argument of a Megatron command line carries over unchanged. As in Megatron,
weights are normalised to sum to 1 and prefixes cannot contain whitespace.

The sources' samples share one index space (source 0's samples first, then
source 1's, ...), so the sampler hands out plain integers whether a run reads
one corpus or twenty, and a single corpus keeps the indices it always had.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hetpipe.data.packed import PackedSequenceDataset
from hetpipe.errors import ConfigError


@dataclass(frozen=True)
class DataSource:
    prefix: str
    # Normalised: the weights of one blend sum to 1.
    weight: float


def parse_data_path(spec: str, field: str = "data.path") -> list[DataSource]:
    """The sources of ``"prefix"`` or ``"w1 prefix1 w2 prefix2 ..."``."""
    tokens = str(spec).split()
    if not tokens:
        raise ConfigError(f"{field} is empty: give a data prefix, 'demo', or a blend 'w1 prefix1 w2 prefix2 ...'")
    if len(tokens) == 1:
        return [DataSource(tokens[0], 1.0)]
    if len(tokens) % 2:
        raise ConfigError(f"{field}={spec!r} has {len(tokens)} entries, but a blend is weight-prefix pairs "
                          "('0.7 prefixA 0.3 prefixB')")
    weights = []
    for text, prefix in zip(tokens[::2], tokens[1::2]):
        try:
            weight = float(text)
        except ValueError:
            raise ConfigError(f"{field}: {text!r} stands where the weight of {prefix} belongs; a blend is "
                              "weight-prefix pairs ('0.7 prefixA 0.3 prefixB')") from None
        if not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"{field}: the weight of {prefix} is {text}; weights must be positive")
        weights.append(weight)
    total = sum(weights)
    return [DataSource(prefix, weight / total) for prefix, weight in zip(tokens[1::2], weights)]


class BlendedSamples:
    """The samples of several sources in one index space."""

    def __init__(self, sources: Sequence[PackedSequenceDataset]) -> None:
        self.sources = list(sources)
        self.sizes = [s.num_samples for s in self.sources]
        self._starts = np.cumsum([0] + self.sizes[:-1])
        self.num_samples = sum(self.sizes)

    @property
    def offsets(self) -> list[int]:
        """Index of each source's first sample."""
        return [int(start) for start in self._starts]

    def locate(self, i: int) -> tuple[int, int]:
        """(source, index within that source) of sample ``i``."""
        source = int(np.searchsorted(self._starts, i, side="right")) - 1
        return source, i - int(self._starts[source])

    def __getitem__(self, i: int) -> np.ndarray:
        source, local = self.locate(i)
        return self.sources[source][local]

    def describe(self, i: int) -> str:
        """``<prefix> sample <n>``, naming where sample ``i`` comes from."""
        source, local = self.locate(i)
        return f"{self.sources[source].dataset.prefix} sample {local}"
