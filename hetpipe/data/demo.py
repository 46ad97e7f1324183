"""A real corpus that every machine already has: the Python standard library.

Demos, smoke tests and benchmarks need genuine text (a loss curve on random
tokens shows nothing) but must not download anything. The standard library's
own ``.py`` sources are several megabytes of real, varied text present
wherever Python is, so :func:`demo_corpus` tokenizes them once into a cached
Megatron ``.bin``/``.idx`` pair through the same code path as
``scripts/preprocess_data.py``.
"""

from __future__ import annotations

import os
import platform
import sysconfig
from pathlib import Path

from hetpipe.data.indexed import IndexedDataset, data_file_path, index_file_path
from hetpipe.data.preprocess import encode_to_indexed, output_prefix_for
from hetpipe.data.tokenizer import load_tokenizer
from hetpipe.errors import DataError

# Enough text for a demo run to show learning, small enough to build in seconds.
MAX_TEXT_BYTES = 8 * 1024 * 1024
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_sources(max_bytes: int = MAX_TEXT_BYTES) -> list[Path]:
    """Sorted standard-library ``.py`` files (no tests, no third-party
    packages), stopping once about ``max_bytes`` of source is gathered."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen: list[Path] = []
    total = 0
    for directory, dirs, names in os.walk(root):
        # Sorting in place fixes os.walk's order, so the corpus is the same
        # on every machine with this Python version.
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            path = Path(directory, name)
            chosen.append(path)
            total += path.stat().st_size
            if total >= max_bytes:
                return chosen
    return chosen


def default_cache_dir() -> Path:
    """``$HETPIPE_CACHE``, else ``~/.cache/hetpipe``."""
    return Path(os.environ.get("HETPIPE_CACHE") or Path.home() / ".cache" / "hetpipe")


def demo_corpus(tokenizer_spec: str = "byte", cache_dir: str | None = None) -> str:
    """Prefix of the cached standard-library corpus for ``tokenizer_spec``,
    building it first if it is missing or unreadable."""
    tokenizer = load_tokenizer(tokenizer_spec)
    directory = Path(cache_dir) if cache_dir else default_cache_dir()
    base = directory / "demo" / f"stdlib-py{platform.python_version()}-{tokenizer.name}"
    prefix = output_prefix_for(str(base), "text")
    if os.path.exists(index_file_path(prefix)) and os.path.exists(data_file_path(prefix)):
        try:
            IndexedDataset(prefix)
            return prefix
        except DataError:
            pass  # a damaged cache entry is simply rebuilt

    try:
        import datasets
    except ImportError:
        raise DataError("the demo corpus is built with the datasets package, which is not installed: "
                        "pip install datasets, or give data.path=PREFIX of an indexed dataset "
                        "(scripts/preprocess_data.py makes one)") from None

    files = stdlib_sources()
    if not files:
        raise DataError(
            f"no standard-library sources found under {sysconfig.get_paths()['stdlib']}"
        )
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in files]
    # The writer streams into unique temporary files and renames them into
    # place, .idx last, so processes building this concurrently each publish
    # a complete (and identical) pair and readers never see a partial one.
    encode_to_indexed(
        datasets.Dataset.from_dict({"text": texts}),
        ["text"],
        tokenizer,
        str(base),
        source="the standard-library demo corpus",
        progress=False,
    )
    return prefix
