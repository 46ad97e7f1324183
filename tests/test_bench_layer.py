"""scripts/bench_layer.py's backward split on a CPU: F, B and W timed apart
beside the fused backward, for eager and fused layers (tiny shapes)."""
import subprocess

import pytest

from conftest import run_cli

pytestmark = pytest.mark.timeout(120)


def _bench(*args: str) -> subprocess.CompletedProcess:
    return run_cli(["scripts/bench_layer.py", "--model", "tiny_llama", "--seq-length", "32",
                    "--layers", "1", "--microbatches", "1", "--iters", "1", *args], timeout=110)


def test_split_variants_time_f_b_w_against_the_fused_backward():
    # fused+split: the compiled elementwise regions' backward must survive B's retain_graph.
    proc = _bench("--variants", "eager+split,fused+split")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    table = proc.stdout.split("Backward split")[1]
    assert "| F ms | B ms | W ms | B+W ms |" in table
    for variant in ("eager+split", "fused+split"):
        row = next(line for line in table.splitlines() if line.startswith(f"| {variant} |"))
        assert all(float(cell) > 0 for cell in row.strip("|").split("|")[1:])


def test_split_refuses_what_it_cannot_time():
    proc = _bench("--variants", "compile+split,fused+split+recompute=full")
    assert proc.returncode == 2 and "+split (layers, eager or fused, no recompute)" in proc.stderr
    assert "'compile+split', 'fused+split+recompute=full'" in proc.stderr
