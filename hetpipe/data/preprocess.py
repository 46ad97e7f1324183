"""Raw text → Megatron ``.bin``/``.idx``: hetpipe's ``tools/preprocess_data.py``.

Reading goes through Hugging Face ``datasets`` so that text, JSON lines and
Parquet inputs, multi-process tokenization and out-of-core corpora all come
from one well-tested library; the output is the Megatron indexed format, with
Megatron's flag names and file naming (``{prefix}_{key}_document``), so
existing Megatron recipes and data carry over. :func:`encode_to_indexed` is
the reusable core (the demo corpus is built with it too).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hetpipe.data.indexed import IndexedDatasetWriter, optimal_dtype
from hetpipe.data.tokenizer import Tokenizer, load_tokenizer
from hetpipe.errors import DataError, run_cli

if TYPE_CHECKING:
    import datasets

# Extension → the datasets builder that reads it.
BUILDER_OF_EXTENSION = {
    ".txt": "text",
    ".text": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}
_EXTENSIONS = ", ".join(BUILDER_OF_EXTENSION)

# Rows per Arrow batch when copying tokenized data into the .bin: large enough
# that per-batch overhead vanishes, small enough to bound memory.
_WRITE_BATCH_ROWS = 8192


@dataclass(frozen=True)
class InputFiles:
    """The files one preprocessing call reads, all of one builder kind."""

    builder: str
    files: list[str]
    skipped: list[str]  # empty or other-extension files under input directories


@dataclass(frozen=True)
class WrittenDataset:
    """What :func:`encode_to_indexed` wrote for one json key."""

    key: str
    prefix: str
    documents: int
    tokens: int
    empty_skipped: int
    dtype: np.dtype


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's output naming: ``{output_prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def collect_inputs(paths: Sequence[str]) -> InputFiles:
    """Expand files and directories into a sorted file list of one builder kind."""
    files: list[str] = []
    skipped: list[str] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = []
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(names):
                    if name.startswith("."):
                        continue
                    candidate = os.path.join(root, name)
                    if Path(name).suffix.lower() in BUILDER_OF_EXTENSION and (
                        os.path.getsize(candidate) > 0
                    ):
                        found.append(candidate)
                    else:
                        skipped.append(candidate)
            if not found:
                raise DataError(f"input directory '{raw}' holds no non-empty {_EXTENSIONS} files")
            files.extend(found)
        elif path.is_file():
            if path.suffix.lower() not in BUILDER_OF_EXTENSION:
                raise DataError(
                    f"input '{raw}' has unsupported extension '{path.suffix}' "
                    f"(expected one of {_EXTENSIONS})"
                )
            # datasets' JSON reader crashes on an empty file rather than
            # reporting it, and an empty input is a mistake worth naming.
            if path.stat().st_size == 0:
                raise DataError(f"input '{raw}' is empty")
            files.append(str(path))
        else:
            raise DataError(f"input '{raw}' not found")
    builders = {BUILDER_OF_EXTENSION[Path(f).suffix.lower()] for f in files}
    if len(builders) > 1:
        raise DataError(
            f"inputs mix {' and '.join(sorted(builders))} files; "
            "preprocess each kind in its own call"
        )
    return InputFiles(builders.pop(), files, skipped)


def load_documents(
    inputs: InputFiles, cache_dir: str, text_sample_by: str = "document"
) -> datasets.Dataset:
    """Read ``inputs`` with the matching ``datasets`` builder, caching under ``cache_dir``."""
    import datasets

    kwargs: dict[str, Any] = {}
    if inputs.builder == "text":
        kwargs["sample_by"] = text_sample_by
    try:
        return datasets.load_dataset(
            inputs.builder, data_files=inputs.files, split="train", cache_dir=cache_dir, **kwargs
        )
    except datasets.exceptions.DatasetGenerationError as exc:
        cause = exc.__cause__ or exc
        reason = " ".join(str(cause).split())[:300]
        raise DataError(f"could not read {_describe(inputs.files)}: {reason}") from exc


def encode_to_indexed(
    dataset: datasets.Dataset,
    json_keys: Sequence[str],
    tokenizer: Tokenizer,
    output_prefix: str,
    *,
    source: str,
    append_eod: bool = True,
    workers: int = 1,
    progress: bool = True,
) -> list[WrittenDataset]:
    """Tokenize each ``json_keys`` column of ``dataset`` into its own indexed dataset.

    ``source`` names the data in error messages. Documents that tokenize to
    nothing are skipped (an EOD alone would teach the model nothing) and
    counted. Returns one :class:`WrittenDataset` per key, in key order.
    """
    for key in json_keys:
        if key not in dataset.column_names:
            raise DataError(
                f"{source} has no '{key}' field (fields: {', '.join(dataset.column_names)}); "
                "choose one with --json-keys"
            )
        feature = dataset.features[key]
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise DataError(f"field '{key}' of {source} holds {feature}, not text")

    with _progress_bars(progress):
        tokenized = dataset.map(
            _encode_batch,
            batched=True,
            fn_kwargs={"keys": list(json_keys), "tokenizer": tokenizer, "append_eod": append_eod},
            remove_columns=dataset.column_names,
            num_proc=workers if workers > 1 else None,
            # Nothing here can reuse a cached result (the CLI's cache dir is
            # private and deleted, the demo's dataset lives in memory), so a
            # fresh fingerprint just spares datasets hashing the tokenizer.
            new_fingerprint=uuid.uuid4().hex,
            desc="tokenizing",
        )
    return _write_columns(tokenized, json_keys, tokenizer, output_prefix)


def _encode_batch(
    batch: dict[str, list[str | None]], keys: list[str], tokenizer: Tokenizer, append_eod: bool
) -> dict[str, list[np.ndarray]]:
    out = {}
    eod = np.array([tokenizer.eod], dtype=np.int32)
    for key in keys:
        # A null (a JSON row without the key) counts as an empty document.
        encoded = tokenizer.encode_batch([text or "" for text in batch[key]])
        if append_eod:
            encoded = [np.concatenate((ids, eod)) if ids.size else ids for ids in encoded]
        out[key] = encoded
    return out


def _write_columns(
    tokenized: datasets.Dataset, keys: Sequence[str], tokenizer: Tokenizer, output_prefix: str
) -> list[WrittenDataset]:
    import pyarrow.compute as pc

    dtype = np.dtype(optimal_dtype(tokenizer.vocab_size))
    empty = dict.fromkeys(keys, 0)
    with contextlib.ExitStack() as stack:
        writers = {
            key: stack.enter_context(
                IndexedDatasetWriter(output_prefix_for(output_prefix, key), dtype)
            )
            for key in keys
        }
        for table in tokenized.with_format("arrow").iter(batch_size=_WRITE_BATCH_ROWS):
            for key, writer in writers.items():
                column = table.column(key).combine_chunks()
                lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
                tokens = column.flatten().to_numpy(zero_copy_only=False)
                nonempty = lengths > 0
                empty[key] += int((~nonempty).sum())
                writer.add_documents(tokens, lengths[nonempty])
    return [
        WrittenDataset(
            key=key,
            prefix=writer.prefix,
            documents=writer.num_documents,
            tokens=writer.num_tokens,
            empty_skipped=empty[key],
            dtype=dtype,
        )
        for key, writer in writers.items()
    ]


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """Turn datasets' progress bars off for the block if not ``enabled``,
    restoring the caller's setting afterwards (the switch is process-global)."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    if not enabled:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            datasets.enable_progress_bars()


def _describe(files: Sequence[str]) -> str:
    if len(files) <= 3:
        return ", ".join(files)
    return f"{files[0]}, {files[1]} and {len(files) - 2} more files"


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface, with Megatron's flag names."""
    parser = argparse.ArgumentParser(
        prog="preprocess_data.py",
        description="Tokenize text, JSON lines or Parquet into Megatron .bin/.idx files.",
    )
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help=f"files or directories (walked, sorted) of {_EXTENSIONS}; one kind per call",
    )
    parser.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        metavar="KEY",
        help="fields to tokenize, one output pair per key (default: text)",
    )
    parser.add_argument(
        "--tokenizer",
        required=True,
        help="'byte' or a local Hugging Face tokenizer directory",
    )
    parser.add_argument(
        "--output-prefix",
        required=True,
        help="outputs are {prefix}_{key}_document.bin/.idx",
    )
    parser.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end every document with the tokenizer's EOD id (default: on)",
    )
    parser.add_argument(
        "--text-sample-by",
        choices=("document", "paragraph", "line"),
        default=None,
        help="for .txt/.text inputs: a document is a whole file, a paragraph or a line "
        "(default: document)",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        help="tokenizer processes (default: 1)",
    )
    return parser


def _preprocess(args: argparse.Namespace) -> int:
    inputs = collect_inputs(args.input)
    if args.text_sample_by is not None and inputs.builder != "text":
        raise DataError(
            f"--text-sample-by applies to .txt/.text inputs, not to {inputs.builder} files"
        )
    tokenizer = load_tokenizer(args.tokenizer)
    json_keys = list(dict.fromkeys(args.json_keys))
    output_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(output_dir, exist_ok=True)
    if args.workers > 1:
        # The worker processes are the parallelism here; the Rust tokenizer's
        # own thread pool would only warn (or stall) after the fork.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    progress = sys.stderr.isatty()

    # datasets caches the parsed input and the tokenized columns as Arrow
    # files; keep them beside the output (same disk, sized like the data) and
    # delete them afterwards instead of growing ~/.cache behind the user's back.
    with tempfile.TemporaryDirectory(prefix=".hetpipe-preprocess-", dir=output_dir) as cache:
        with _progress_bars(progress):
            dataset = load_documents(inputs, cache, args.text_sample_by or "document")
        num_documents = len(dataset)
        written = encode_to_indexed(
            dataset,
            json_keys,
            tokenizer,
            args.output_prefix,
            source=_describe(inputs.files),
            append_eod=args.append_eod,
            workers=args.workers,
            progress=progress,
        )

    print(
        f"read {len(inputs.files)} {inputs.builder} file(s), {num_documents} documents, "
        f"tokenizer {args.tokenizer} (vocab {tokenizer.vocab_size})"
    )
    if inputs.skipped:
        print(
            f"ignored {len(inputs.skipped)} empty or other-extension file(s) in input "
            f"directories, e.g. {inputs.skipped[0]}"
        )
    for result in written:
        print(
            f"{result.key}: {result.documents} documents, {result.tokens} tokens, "
            f"{result.empty_skipped} empty skipped -> {result.prefix}.bin/.idx ({result.dtype})"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``scripts/preprocess_data.py``; returns the exit status."""
    args = build_parser().parse_args(argv)
    return run_cli(lambda: _preprocess(args))
