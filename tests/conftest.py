"""Shared test helpers: repo paths, the test corpus, running the CLIs."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_zygote import python_shim, run_module
from hetpipe.data.demo import stdlib_sources

REPO = Path(__file__).resolve().parents[1]


def _cli_env(environ) -> dict[str, str]:
    return dict(environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")


# The environment of this worker before any test changed it (tests/cli_zygote.py).
USUAL_ENV = _cli_env(os.environ)


def run_cli(args: list[str], cwd: Path | None = None, timeout: float = 240,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python <args>`` as a user would, capturing output, with ``env`` added to the
    environment: ``-m MODULE`` or a script by path in a process forked from an interpreter
    that imported torch and hetpipe already where nothing differs but the import
    (tests/cli_zygote.py; a script through its python shim), else in a fresh interpreter."""
    env_added, env = list(env or {}), _cli_env({**os.environ, **(env or {})})
    if len(args) >= 2 and args[0] == "-m":
        done = run_module(args[1], args[2:], env, str(cwd or REPO), timeout, USUAL_ENV, passed=env_added)
        if done is not None:
            return done
    python = python_shim(USUAL_ENV) if args and args[0].endswith(".py") else sys.executable
    return subprocess.run([python, *args], cwd=cwd or REPO, env=env, text=True, capture_output=True, timeout=timeout)


def torchrun(args: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment of ``python -m torch.distributed.run ARGS``: torchrun and
    the workers it starts (with $PYTHON_EXEC) fork from this worker's zygote (tests/cli_zygote.py)."""
    python = python_shim(USUAL_ENV)
    return [python, "-m", "torch.distributed.run", *args], dict(env, PYTHON_EXEC=python)


def run_pretrain(run_dir: Path, args: list[str], timeout: float = 240) -> tuple[subprocess.CompletedProcess, list]:
    """``python -m hetpipe.pretrain <args>`` into ``run_dir``; must succeed.
    Returns the process and the rows of its metrics.jsonl."""
    proc = run_cli(["-m", "hetpipe.pretrain", *args, f"hydra.run.dir={run_dir}"], timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return proc, rows


# The log's path is written into the module: an emulated node's environment keeps
# PYTHONPATH but none of hetpipe's variables (tests/cluster_nodes.py).
STARTS_LOGGER = """import json, sys
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.orig_argv) + "\\n")
"""


def log_python_starts(tmp_path: Path, monkeypatch) -> Path:
    """Every Python interpreter started from here on (CLIs, fork servers, spawned
    workers, emulated nodes' launchers: not forked ones) appends its command line
    to the returned file, through a sitecustomize module on PYTHONPATH."""
    site = tmp_path / "starts_site"
    site.mkdir(parents=True)
    log = tmp_path / "python_starts.jsonl"
    (site / "sitecustomize.py").write_text(STARTS_LOGGER.format(log=str(log)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    return log


def fork_servers_started(log: Path) -> int:
    """How many multiprocessing fork servers the logged interpreters were."""
    lines = log.read_text().splitlines() if log.exists() else []
    return sum("multiprocessing.forkserver" in " ".join(json.loads(line)) for line in lines)


# scripts/test.sh runs the suite on pytest-xdist workers, each taking whole
# modules (--dist loadscope: a module's shared reference runs are made once)
# in collection order (--no-loadscope-reorder). Handing out the longest
# modules first keeps the last minutes from running on one worker: these were
# the slowest, longest first, in the last measured run (docs/benchmarks.md,
# "The suite's time, fourth step").
LONGEST_MODULES_FIRST = (
    "test_fused.py", "test_launcher_restart.py", "test_nic_faults.py", "test_parallel_tp.py",
    "test_node_faults.py", "test_pretrain.py", "test_pipeline.py", "test_determinism.py", "test_fd_limit.py",
    "test_parallel_cli.py", "test_partitioner_cli.py", "test_checkpoint_resume.py", "test_forged_verdicts.py",
    "test_zero_bubble.py", "test_memory_fit.py", "test_partitioner_solver.py", "test_context_pipeline.py",
    "test_bench_peer.py", "test_torch_compat.py", "test_bench_driver.py", "test_precision.py",
    "test_families.py", "test_doctor.py", "test_compare_harness.py", "test_two_nodes.py",
    "test_scheduler_env.py", "test_mooncake_mover.py", "test_data_preprocess.py", "test_channel_auth.py",
    "test_long_runs.py",
)


def pytest_collection_modifyitems(config, items):
    """Longest modules first; a stable sort keeps each module's own order."""
    rank = {name: k for k, name in enumerate(LONGEST_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="module")
def one_thread():
    """Tensors as small as the test models' only lose from intra-op threads
    (badly, on a busy two-core machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# About as much prose as tinyshakespeare's first third: enough paragraphs for
# the tiny models to learn from in a few steps and for a 400-token BPE to train.
CORPUS_BYTES = 400_000


def prose_corpus(path: Path, max_bytes: int = CORPUS_BYTES) -> Path:
    """Write English prose every machine has - the docstrings of the Python
    standard library, in the demo corpus's file order - to ``path``, one
    paragraph per blank-line-separated block. The same Python version gives
    the same file, so a fresh clone needs nothing outside the repository."""
    paragraphs: list[str] = []
    size = 0
    for source in stdlib_sources():
        try:
            tree = ast.parse(source.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            for block in (doc or "").split("\n\n"):
                block = block.strip()
                if len(block) >= 40:
                    paragraphs.append(block)
                    size += len(block) + 2
            if size >= max_bytes:
                path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
                return path
    path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def corpus_text(tmp_path_factory) -> Path:
    """The test corpus as a text file (see :func:`prose_corpus`)."""
    return prose_corpus(tmp_path_factory.mktemp("corpus") / "prose.txt")


@pytest.fixture(scope="session")
def corpus_prefix(tmp_path_factory, corpus_text) -> str:
    """The test corpus byte-tokenized into a Megatron .bin/.idx pair (one
    document per paragraph) by scripts/preprocess_data.py, as a user makes one."""
    out = tmp_path_factory.mktemp("corpus_bin")
    proc = run_cli(["scripts/preprocess_data.py", "--input", str(corpus_text), "--tokenizer", "byte",
                    "--text-sample-by", "paragraph", "--output-prefix", str(out / "prose")])
    assert proc.returncode == 0, proc.stderr
    return str(out / "prose_text_document")


EOS = "<|endoftext|>"


def corpus_lines(corpus: Path, count: int) -> list[str]:
    """The first ``count`` non-empty lines of the test corpus (``corpus_text``)."""
    return [line for line in corpus.read_text().splitlines() if line][:count]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory, corpus_text) -> tuple[Path, object]:
    """A tiny byte-level BPE trained here, saved as a transformers tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(corpus_lines(corpus_text, 400), trainer)
    directory = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS).save_pretrained(directory)
    return directory, backend
