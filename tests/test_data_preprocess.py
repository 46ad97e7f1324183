"""Tokenizers and scripts/preprocess_data.py, run as a user would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hetpipe.data.indexed import IndexedDataset
from hetpipe.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from hetpipe.errors import DataError

from conftest import EOS, corpus_lines

REPO = Path(__file__).resolve().parents[1]

DOCS = ["First Citizen:\nBefore we proceed any further, hear me speak.", "", "héllo wörld ✓", "x"]


def preprocess(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "scripts/preprocess_data.py", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def stream(prefix: str) -> list[int]:
    data = IndexedDataset(prefix)
    return [int(t) for i in range(len(data)) for t in data.get(i)]


def byte_stream(docs: list[str]) -> list[int]:
    return [t for d in docs if d for t in list(d.encode("utf-8")) + [256]]


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    assert ids.tolist() == list("héllo ✓".encode())
    assert tok.decode(np.append(ids, tok.eod)) == "héllo ✓"
    assert tok.vocab_size == 257 and tok.eod == 256


def test_hf_tokenizer_matches_its_backend(hf_tokenizer_dir):
    directory, backend = hf_tokenizer_dir
    tok = load_tokenizer(str(directory))
    assert isinstance(tok, HFTokenizer)
    assert tok.eod == backend.token_to_id(EOS) and tok.vocab_size == 400
    text = "Before we proceed any further"
    assert tok.encode(text).tolist() == backend.encode(text).ids
    assert tok.decode(np.append(tok.encode(text), tok.eod)) == text


def test_tokenizer_specs_that_cannot_load(tmp_path, hf_tokenizer_dir):
    with pytest.raises(DataError, match="tokenizer 'no/such/dir' not found"):
        load_tokenizer("no/such/dir")
    with pytest.raises(DataError, match=f"tokenizer '{tmp_path}' could not be loaded"):
        load_tokenizer(str(tmp_path))
    from transformers import PreTrainedTokenizerFast

    _, backend = hf_tokenizer_dir
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(tmp_path / "no_eos")
    with pytest.raises(DataError, match="has no eos token"):
        load_tokenizer(str(tmp_path / "no_eos"))


def test_txt_documents_and_lines(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in/b.txt").write_text("second file\n\nwith a gap\n")
    (tmp_path / "in/a.txt").write_text("first ✓ file\n")
    (tmp_path / "in/README.md").write_text("not input")
    run = preprocess(
        "--input",
        str(tmp_path / "in"),
        "--tokenizer",
        "byte",
        "--output-prefix",
        str(tmp_path / "out/doc"),
    )
    assert run.returncode == 0, run.stderr
    assert "2 documents" in run.stdout
    # A directory is read in sorted order, one document per file.
    expected = byte_stream(["first ✓ file\n", "second file\n\nwith a gap\n"])
    assert stream(str(tmp_path / "out/doc_text_document")) == expected

    run = preprocess(
        "--input",
        str(tmp_path / "in/b.txt"),
        "--tokenizer",
        "byte",
        "--output-prefix",
        str(tmp_path / "out/line"),
        "--text-sample-by",
        "line",
        "--no-append-eod",
    )
    assert run.returncode == 0, run.stderr
    assert "1 empty skipped" in run.stdout
    assert stream(str(tmp_path / "out/line_text_document")) == list(b"second filewith a gap")


def test_jsonl_with_empty_and_missing_fields(tmp_path):
    rows = [{"text": d, "id": i} for i, d in enumerate(DOCS)] + [{"id": 99}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = preprocess(
        "--input",
        str(tmp_path / "c.jsonl"),
        "--tokenizer",
        "byte",
        "--output-prefix",
        str(tmp_path / "c"),
        "--workers",
        "2",
    )
    assert run.returncode == 0, run.stderr
    assert "3 documents" in run.stdout and "2 empty skipped" in run.stdout
    prefix = str(tmp_path / "c_text_document")
    assert IndexedDataset(prefix).dtype == np.uint16
    assert stream(prefix) == byte_stream(DOCS)


def test_parquet_one_output_pair_per_key(tmp_path):
    titles = ["A", "B", "C", "D"]
    pq.write_table(pa.table({"text": DOCS, "title": titles}), tmp_path / "p.parquet")
    run = preprocess(
        "--input",
        str(tmp_path / "p.parquet"),
        "--json-keys",
        "text",
        "title",
        "--tokenizer",
        "byte",
        "--output-prefix",
        str(tmp_path / "p"),
    )
    assert run.returncode == 0, run.stderr
    assert stream(str(tmp_path / "p_text_document")) == byte_stream(DOCS)
    assert stream(str(tmp_path / "p_title_document")) == byte_stream(titles)
    # Nothing but the outputs is left beside them (the datasets cache is removed).
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "p.parquet",
        "p_text_document.bin",
        "p_text_document.idx",
        "p_title_document.bin",
        "p_title_document.idx",
    ]


def test_hf_tokenizer_stream_is_its_encodings_plus_eos(tmp_path, hf_tokenizer_dir, corpus_text):
    directory, backend = hf_tokenizer_dir
    docs = corpus_lines(corpus_text, 450)[400:450] + ["unseen wörds ✓"]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    run = preprocess(
        "--input",
        str(tmp_path / "s.jsonl"),
        "--tokenizer",
        str(directory),
        "--output-prefix",
        str(tmp_path / "s"),
    )
    assert run.returncode == 0, run.stderr
    eos = backend.token_to_id(EOS)
    expected = [t for d in docs for t in backend.encode(d).ids + [eos]]
    assert stream(str(tmp_path / "s_text_document")) == expected


@pytest.mark.parametrize(
    "case, words",
    [
        ("missing", "input '{tmp}/absent.jsonl' not found"),
        ("key", "has no 'body' field (fields: text)"),
        ("extension", "unsupported extension '.csv'"),
        ("mixed", "inputs mix json and text files"),
    ],
)
def test_bad_inputs_fail_with_one_line(tmp_path, case, words):
    (tmp_path / "ok.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "ok.txt").write_text("hi\n")
    (tmp_path / "data.csv").write_text("text\nhi\n")
    inputs = {
        "missing": ["--input", str(tmp_path / "absent.jsonl")],
        "key": ["--input", str(tmp_path / "ok.jsonl"), "--json-keys", "body"],
        "extension": ["--input", str(tmp_path / "data.csv")],
        "mixed": ["--input", str(tmp_path / "ok.jsonl"), str(tmp_path / "ok.txt")],
    }[case]
    run = preprocess(*inputs, "--tokenizer", "byte", "--output-prefix", str(tmp_path / "o"))
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("hetpipe: error:")]
    assert len(errors) == 1 and words.format(tmp=tmp_path) in errors[0]
    assert "Traceback" not in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.csv", "ok.jsonl", "ok.txt"]
