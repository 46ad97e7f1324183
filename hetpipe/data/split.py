"""Megatron's ``--split``: train, validation and test as contiguous document ranges.

``data.split="969,30,1"`` gives each corpus's first ~96.9 % of documents to
training, the next ~3 % to validation and the rest to test, the way
Megatron-Core's dataset builder cuts them (its ``_get_split_indices``
rounding rule), so a corpus split here holds out the same documents as a
Megatron run of it. Cutting by whole documents keeps every validation token
out of training.
"""

from __future__ import annotations

import math

from hetpipe.errors import ConfigError

SPLIT_PARTS = ("train", "valid", "test")


def parse_split(spec: str) -> tuple[float, float, float]:
    """Normalised (train, valid, test) weights of a ``"969,30,1"`` string;
    missing trailing parts are 0, as in Megatron."""
    usage = (f"data.split={spec!r} must be up to three non-negative numbers 'train,valid,test' "
             "separated by commas, e.g. '969,30,1'")
    fields = [field.strip() for field in str(spec).split(",")]
    if not 1 <= len(fields) <= len(SPLIT_PARTS):
        raise ConfigError(usage)
    try:
        values = [float(field) for field in fields]
    except ValueError:
        raise ConfigError(usage) from None
    if any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise ConfigError(usage)
    values += [0.0] * (len(SPLIT_PARTS) - len(values))
    total = sum(values)
    train, valid, test = (v / total for v in values)
    return train, valid, test


def split_documents(num_documents: int, weights: tuple[float, float, float], part: str) -> tuple[int, int]:
    """The ``[first, last)`` documents of ``part`` ("train", "valid" or "test").

    Each part's size is rounded on its own; the overshoot of the rounded
    total is then taken off every boundary, which is Megatron's rule. The
    clamp only matters for degenerate splits of a handful of documents,
    where that rule could step outside the corpus.
    """
    bounds = [0]
    for weight in weights:
        bounds.append(bounds[-1] + int(round(weight * float(num_documents))))
    overshoot = bounds[-1] - num_documents
    bounds[1:] = [min(max(b - overshoot, 0), num_documents) for b in bounds[1:]]
    index = SPLIT_PARTS.index(part)
    return bounds[index], bounds[index + 1]
