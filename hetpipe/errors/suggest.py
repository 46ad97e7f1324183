""""Did you mean": the closest of a set of names to a misspelt one (ground floor)."""
from __future__ import annotations

import difflib
from typing import Iterable


def closest(word: str, options: Iterable[str]) -> str | None:
    """The option most like ``word``, or None where none is close (difflib's ratio >= 0.6)."""
    found = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(word: str, options: Iterable[str], shown_as: str = "{}") -> str:
    """`` (did you mean X?)`` for the closest option (``shown_as`` formats it), or ""."""
    match = closest(word, options)
    return f" (did you mean {shown_as.format(match)}?)" if match else ""
