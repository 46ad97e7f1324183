"""Shared test helpers: repo paths, the shared corpus, running the CLIs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


def run_cli(args: list[str], cwd: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``python <args>`` as a user would, capturing output."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, *args], cwd=cwd or REPO, env=env, text=True,
                          capture_output=True, timeout=timeout)


def run_pretrain(run_dir: Path, args: list[str], timeout: float = 240) -> tuple[subprocess.CompletedProcess, list]:
    """``python -m hetpipe.pretrain <args>`` into ``run_dir``; must succeed.
    Returns the process and the rows of its metrics.jsonl."""
    proc = run_cli(["-m", "hetpipe.pretrain", *args, f"hydra.run.dir={run_dir}"], timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return proc, rows


@pytest.fixture(scope="module")
def one_thread():
    """Tensors as small as the test models' only lose from intra-op threads
    (badly, on a busy two-core machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def shakespeare_prefix(tmp_path_factory) -> str:
    """tinyshakespeare byte-tokenized into a Megatron .bin/.idx pair (one document per paragraph)."""
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{SHAKESPEARE} not present")
    out = tmp_path_factory.mktemp("shakespeare")
    proc = run_cli(["scripts/preprocess_data.py", "--input", str(SHAKESPEARE), "--tokenizer", "byte",
                    "--text-sample-by", "paragraph", "--output-prefix", str(out / "shakespeare")])
    assert proc.returncode == 0, proc.stderr
    return str(out / "shakespeare_text_document")
