"""The odd values every config schema refuses alike, each in one line naming its field.

A float field from the command line takes ``nan`` and ``inf``, and a
comparison with NaN is false whichever way it is asked, so a rule written as
``if value < 0: refuse`` lets NaN through (``optimizer.min_lr=nan`` then
poisoned the weights at step 12). The schemas' ``__post_init__`` hooks state
their ranges through these functions, which refuse a non-finite value first.
"""
from __future__ import annotations

import math
from typing import Optional

from hetpipe.errors import ConfigError

# numpy's global seed (np.random.seed) takes 0 .. 2**32 - 1, and each model unit's
# torch generator is seeded with seed * 1_000_003 + unit (models/transformer.py),
# which torch takes up to 2**64 - 1: a seed in numpy's range fits both.
MAX_SEED = 2**32 - 1


def finite(name: str, value: float) -> None:
    """Refuse NaN and infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}={value} must be a finite number")


def in_range(name: str, value: float, low: Optional[float] = None, high: Optional[float] = None,
             low_open: bool = False, why: str = "") -> None:
    """Refuse a non-finite ``value`` or one outside [low, high] ((low, high] with ``low_open``)."""
    finite(name, value)
    below = low is not None and (value <= low if low_open else value < low)
    if below or (high is not None and value > high):
        raise ConfigError(f"{name}={value} must be {_bounds(low, high, low_open)}{why}")


def positive(name: str, value: float, why: str = "") -> None:
    in_range(name, value, 0, low_open=True, why=why)


def seed(name: str, value: int) -> None:
    """A seed every generator the run seeds takes (see MAX_SEED)."""
    if not 0 <= value <= MAX_SEED:
        raise ConfigError(f"{name}={value} must be between 0 and {MAX_SEED} (2**32 - 1): numpy's seed takes no "
                          "other, and torch's generators take it times 1000003 per model unit")


def _bounds(low: Optional[float], high: Optional[float], low_open: bool) -> str:
    if high is None:
        return ("positive" if low == 0 else f"above {low:g}") if low_open else \
            ("0 or more" if low == 0 else f"at least {low:g}")
    if low is None:
        return f"at most {high:g}"
    return f"in ({low:g}, {high:g}]" if low_open else f"between {low:g} and {high:g}"
