"""A hydra sweep of plans ends with one table (sweep.md, sweep.csv) and its plots;
`compare --sweep` rebuilds them, and compare labels sweep jobs by their overrides."""
import csv
import shutil

import pytest

from conftest import run_cli

SMALL = ["+model=tiny_llama", "model.hidden_size=64", "model.ffn_hidden_size=160", "model.num_layers=4",
         "cluster=cpu_mixed", "train.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=4",
         "train.train_iters=2", "train.log_interval=1", "logging.progress=false", "logging.sample_log=false"]
# Two plans that run, and one that cannot (5 + 5 layers of a 4-layer model): exit 2.
SWEEP = "partition.layers=[1,3],[3,1],[5,5]"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, corpus_prefix):
    out = tmp_path_factory.mktemp("sweep") / "sw"
    proc = run_cli(["-m", "hetpipe.pretrain", "-m", *SMALL, f"data.path={corpus_prefix}", SWEEP,
                    f"hydra.sweep.dir={out}"], timeout=300)
    return proc, out


def _csv(path):
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_sweep_ends_with_a_table_of_every_job_failed_one_included(sweep):
    proc, out = sweep
    # The failed job does not stop the others, and the sweep ends with its status.
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    rows = _csv(out / "sweep.csv")
    assert [r["overrides"] for r in rows] == ["partition.layers=[1,3]", "partition.layers=[3,1]",
                                              "partition.layers=[5,5]"]
    assert [r["exit status"] for r in rows] == ["0", "0", "2"]
    assert [r["split"] for r in rows] == ["1+3", "3+1", ""]
    assert all(r["schedule"] == "1f1b" and r["TP x DP"] == "1x1" for r in rows[:2])
    for r in rows[:2]:
        assert float(r["tokens/s"]) > 0 and float(r["final loss"]) > 0
        assert r["TFLOP/s/GPU"] == ""  # a CPU run's TFLOP/s means nothing
    assert rows[2]["final loss"] == "" and rows[2]["tokens/s"] == ""
    table = (out / "sweep.md").read_text()
    assert "| 2 | partition.layers=[5,5] | - |" in table and table.rstrip().endswith("| 2 |")
    assert "wrote " + str(out / "sweep.md") in proc.stdout
    for plot in ("sweep_throughput.png", "sweep_loss.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_sweep_rebuilds_the_summary(sweep, tmp_path):
    _, out = sweep
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("sweep*"))
    proc = run_cli(["-m", "hetpipe.compare", "--sweep", str(copy)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _csv(copy / "sweep.csv") == _csv(out / "sweep.csv")
    assert (copy / "sweep_throughput.png").is_file() and (copy / "sweep_loss.png").is_file()
    assert "partition.layers=[3,1]" in proc.stdout
    proc = run_cli(["-m", "hetpipe.compare", "--sweep", str(tmp_path / "nowhere")], timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("hetpipe: error:") and "Traceback" not in proc.stderr


def test_compare_labels_sweep_jobs_by_their_overrides(sweep, tmp_path):
    _, out = sweep
    proc = run_cli(["-m", "hetpipe.compare", str(out / "0"), str(out / "1"), "--rtol", "1", "--out",
                    str(tmp_path)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "compare.md").read_text()
    assert "| partition.layers=[3,1] |" in md and "Reference: `partition.layers=[1,3]`" in md
