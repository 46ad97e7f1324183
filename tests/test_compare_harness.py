"""The loss-curve parity harness: ``python -m hetpipe.compare``'s inputs and
outputs, and ``scripts/parity_experiment.sh`` end to end on CPU.

The parity claims under test: when only the boundary transport (or the vendor
label) differs, curves are bitwise identical; when the layer split differs,
they agree to 1e-5.
"""
import json
import os
import struct
import subprocess

import pytest
import yaml

from cli_zygote import python_shim
from conftest import REPO, USUAL_ENV, run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The pipeline tests' tiny model and batch: a run takes a few seconds.
TINY = ["model.hidden_size=64", "model.ffn_hidden_size=160", "train.train_iters=10", "train.seq_length=32",
        "train.micro_batch_size=2", "train.global_batch_size=8", "train.log_interval=5",
        "optimizer.lr=3e-3"]


def _run(tmp_path, name, losses, first_step=1, val=None):
    """A run directory with training rows from ``first_step`` on and, after
    the training row of each step in ``val`` ({step: loss}), a validation
    row as MetricsLogger.record_validation writes it."""
    d = tmp_path / name
    d.mkdir()
    rows = []
    for i, x in enumerate(losses):
        rows.append({"step": first_step + i, "loss": x, "tokens_per_s": 1000.0 + i})
        if first_step + i in (val or {}):
            rows.append({"step": first_step + i, "val_loss": val[first_step + i], "val_ppl": 2.0})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _png_width(path):
    return struct.unpack(">I", path.read_bytes()[16:20])[0]  # the IHDR chunk's width


def _table(markdown, header_start):
    """Rows (lists of cells) of the Markdown table whose header starts with ``header_start``."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header_start} |"))
    assert set(lines[start + 1].replace("|", "").split()) <= {"---", "---:"}
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return [cell.strip() for cell in lines[start].strip("|").split("|")], rows


@pytest.mark.timeout(60)
def test_png_and_markdown_written_with_one_row_per_compared_run(tmp_path):
    ref = _run(tmp_path, "ref", [5.0, 4.0, 3.0])
    same = _run(tmp_path, "same", [5.0, 4.0, 3.0])
    off = _run(tmp_path, "off", [5.0, 4.5, 3.3])
    out = tmp_path / "report"
    proc = run_cli(["-m", "hetpipe.compare", str(ref), str(same), str(off), "--rtol", "0.2", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert (out / "compare.png").read_bytes().startswith(PNG_MAGIC)
    header, rows = _table((out / "compare.md").read_text(), "run vs reference")
    assert header[:4] == ["run vs reference", "compared steps", "missing steps", "max abs diff"]
    assert [r[0] for r in rows] == ["same", "off"]
    same_row, off_row = (dict(zip(header, r)) for r in rows)
    assert same_row["max abs diff"] == "0.000e+00" and same_row["verdict"] == "PASS (bitwise identical)"
    assert off_row["compared steps"] == "3" and off_row["missing steps"] == "0"
    assert off_row["max abs diff"] == f"{0.5:.3e}" and off_row["mean abs diff"] == f"{0.8 / 3:.3e}"
    assert off_row["max rel diff"] == f"{0.5 / 4:.3e}" and off_row["final rel err"] == f"{0.3 / 3:.3e}"
    assert off_row["verdict"] == "PASS"
    _, run_rows = _table((out / "compare.md").read_text(), "run")
    assert [r[0] for r in run_rows] == ["ref", "same", "off"]

    # Explicit paths win over --out's, parents are created, and a failing
    # verdict still writes both (exit 1).
    png, md = tmp_path / "a" / "curves.png", tmp_path / "b" / "table.md"
    proc = run_cli(["-m", "hetpipe.compare", str(ref), str(off), "--plot", str(png), "--markdown", str(md)])
    assert proc.returncode == 1 and "FAIL" in proc.stdout
    assert png.read_bytes().startswith(PNG_MAGIC) and "| off |" in md.read_text()
    # No validation rows anywhere: training only, said once, one plot column.
    assert "validation loss: training only, no run has validation rows" in proc.stdout
    assert "Validation: training only, no run has validation rows." in md.read_text()
    assert _png_width(png) == 8 * 120


@pytest.mark.timeout(60)
def test_validation_curves_are_compared_with_the_same_rtol(tmp_path):
    val = {2: 4.5, 3: 3.5}
    ref = _run(tmp_path, "ref", [5.0, 4.0, 3.0], val=val)
    same = _run(tmp_path, "same", [5.0, 4.0, 3.0], val=val)
    # Training within 1e-2 of the reference; validation 0.4 / 3.5 away at step 3.
    off = _run(tmp_path, "off", [5.0, 4.0, 3.01], val={2: 4.5, 3: 3.9})
    none = _run(tmp_path, "none", [5.0, 4.0, 3.0])
    out = tmp_path / "report"
    proc = run_cli(["-m", "hetpipe.compare", str(ref), str(same), str(off), str(none), "--rtol", "1e-2",
                    "--out", str(out)])
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    val_start = lines.index(next(line for line in lines if line.startswith("validation loss ")))
    training = {line.split()[0]: line for line in lines[:val_start] if line.startswith(("same ", "off ", "none "))}
    validation = {line.split()[0]: line for line in lines[val_start:] if line.startswith(("same ", "off ", "none "))}
    assert all(line.endswith(" PASS") or line.endswith("(bitwise identical)") for line in training.values())
    assert validation["same"].endswith("PASS (bitwise identical)")
    assert validation["off"].split()[1:3] == ["2", "0"] and validation["off"].endswith("FAIL")
    assert validation["none"].split()[1:] == "training only: no validation rows in none".split()
    assert "curves differ beyond tolerance" in proc.stdout
    # The summary counts each run's validation rows and its final validation loss.
    summary = {line.split()[0]: line.split() for line in lines[:lines.index("")]}
    assert summary["ref"][-2:] == ["2", "3.500000"] and summary["none"][-2:] == ["0", "-"]

    md = (out / "compare.md").read_text()
    header, rows = _table(md, "run vs reference (validation)")
    off_row = dict(zip(header, rows[1]))
    assert [r[0] for r in rows] == ["same", "off", "none"]
    assert off_row["max abs diff"] == f"{0.4:.3e}" and off_row["verdict"] == "FAIL"
    assert rows[2][-1] == "training only: no validation rows in none"
    assert "Verdict: **FAIL**" in md
    # A second column of panels: validation loss and its difference.
    assert _png_width(out / "compare.png") == 2 * 8 * 120

    # Validation within tolerance: the same runs pass.
    proc = run_cli(["-m", "hetpipe.compare", str(ref), str(off), "--rtol", "0.2"])
    assert proc.returncode == 0 and "all runs agree" in proc.stdout, proc.stdout + proc.stderr
    # A reference without validation rows: every run compares training only.
    proc = run_cli(["-m", "hetpipe.compare", str(none), str(ref)])
    assert proc.returncode == 0 and "training only: no validation rows in none" in proc.stdout
    # Validation rows that never share a step with the reference's cannot be judged.
    late = _run(tmp_path, "late", [5.0, 4.0, 3.0], val={1: 4.5})
    proc = run_cli(["-m", "hetpipe.compare", str(ref), str(late)])
    assert proc.returncode == 2 and "share no validation steps to compare" in proc.stderr


@pytest.mark.timeout(60)
def test_misaligned_steps_compare_on_common_steps_and_count_the_rest(tmp_path):
    ref = _run(tmp_path, "ref", [6.0, 5.0, 4.0, 3.0, 2.0])             # steps 1..5
    late = _run(tmp_path, "late", [4.0, 3.0, 2.0, 1.5], first_step=3)  # steps 3..6
    proc = run_cli(["-m", "hetpipe.compare", str(ref), str(late), "--rtol", "0"])
    assert proc.returncode == 0, proc.stderr
    line = [line for line in proc.stdout.splitlines() if line.startswith("late ")][-1]
    # 3 common steps; 1, 2 only in ref and 6 only in late.
    assert line.split()[1:3] == ["3", "3"] and "bitwise identical" in line

    disjoint = _run(tmp_path, "disjoint", [1.0], first_step=9)
    proc = run_cli(["-m", "hetpipe.compare", str(ref), str(disjoint)])
    assert proc.returncode == 2 and "share no steps" in proc.stderr


@pytest.mark.timeout(60)
def test_a_metrics_jsonl_path_is_accepted(tmp_path):
    a = _run(tmp_path, "a", [5.0, 4.0])
    b = _run(tmp_path, "b", [5.0, 4.0])
    proc = run_cli(["-m", "hetpipe.compare", str(a / "metrics.jsonl"), str(b)])
    assert proc.returncode == 0 and "bitwise identical" in proc.stdout
    assert f"reference: a ({a / 'metrics.jsonl'})" in proc.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case, message", [
    ("missing", "no such run directory or metrics file"),
    ("empty_dir", "no metrics.jsonl (is it a hetpipe run directory?)"),
    ("empty_file", "no metrics rows with a training loss"),
    ("only_validation", "no metrics rows with a training loss"),
    ("bad_json", "metrics.jsonl:2: not a JSON row"),
    ("no_step", "metrics.jsonl:1: a metrics row needs an integer 'step'"),
    ("no_loss", "metrics.jsonl:1: a metrics row needs a numeric 'loss' or 'val_loss'"),
    ("bad_val_loss", "metrics.jsonl:2: a metrics row needs a numeric 'loss' or 'val_loss'"),
])
def test_unreadable_run_is_one_clear_line(tmp_path, case, message):
    good = _run(tmp_path, "good", [5.0, 4.0])
    bad = tmp_path / case
    if case != "missing":
        bad.mkdir()
    contents = {"empty_file": "\n", "bad_json": '{"step": 1, "loss": 5.0}\n{"step": 2,\n',
                "only_validation": '{"step": 1, "val_loss": 5.0, "val_ppl": 148.4}\n',
                "no_step": '{"loss": 5.0}\n', "no_loss": '{"step": 1, "lm loss": 5.0}\n',
                "bad_val_loss": '{"step": 1, "loss": 5.0}\n{"step": 1, "val_loss": null}\n'}
    if case in contents:
        (bad / "metrics.jsonl").write_text(contents[case])
    proc = run_cli(["-m", "hetpipe.compare", str(good), str(bad), "--out", str(tmp_path / "report")])
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("hetpipe: error:"), proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "report").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("given", ["wandb_dir", "offline_run", "wandb_log", "run_without_jsonl"])
def test_a_wandb_run_is_refused_with_a_pointer_to_metrics_jsonl(tmp_path, given):
    # metrics.jsonl is the record compare reads; wandb's files are a mirror
    # in a format hetpipe does not own. A run directory with metrics.jsonl
    # is read as usual even with a wandb mirror beside it.
    good = _run(tmp_path, "good", [5.0, 4.0])
    offline = good / "wandb" / "offline-run-20260101_000000-abcd1234"
    offline.mkdir(parents=True)
    (offline / "run-abcd1234.wandb").write_bytes(b":W&B\xe1\xbe\x00")
    proc = run_cli(["-m", "hetpipe.compare", str(good), str(good)])
    assert proc.returncode == 0 and "bitwise identical" in proc.stdout, proc.stderr
    if given == "run_without_jsonl":
        (good / "metrics.jsonl").rename(tmp_path / "metrics.jsonl")
    bad = {"wandb_dir": good / "wandb", "offline_run": offline, "wandb_log": offline / "run-abcd1234.wandb",
           "run_without_jsonl": good}[given]
    proc = run_cli(["-m", "hetpipe.compare", str(_run(tmp_path, "ref", [5.0, 4.0])), str(bad)])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr == (f"hetpipe: error: {bad}: compare reads metrics.jsonl, not wandb runs: "
                           "pass the hetpipe run directory that holds metrics.jsonl\n")


@pytest.mark.timeout(60)
def test_plot_without_matplotlib_names_the_extra_and_keeps_the_report(tmp_path):
    # matplotlib is the optional [plot] extra: comparing works without it,
    # and asking for the figure says which extra to install.
    good = _run(tmp_path, "good", [5.0, 4.0])
    same = _run(tmp_path, "same", [5.0, 4.0])
    code = ("import sys; sys.modules['matplotlib'] = None; from hetpipe.compare import main; "
            f"sys.exit(main([{str(good)!r}, {str(same)!r}, '--out', {str(tmp_path / 'report')!r}]))")
    proc = run_cli(["-c", code])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "hetpipe: error: writing a plot needs the matplotlib package: pip install 'hetpipe[plot]'" in proc.stderr
    assert (tmp_path / "report" / "compare.md").is_file()


def _parity(out, data):
    env = dict(os.environ, PYTHON=python_shim(USUAL_ENV, script_only=["EXTRA_RUNS"]), PYTHONUNBUFFERED="1",
               HYDRA_FULL_ERROR="0",
               EXTRA_RUNS="mixed_direct=cluster=cpu_mixed cluster.transport.kind=direct")
    return subprocess.run(["bash", str(REPO / "scripts" / "parity_experiment.sh"), str(out), *TINY,
                           f"data.path={data}"],
                          cwd=REPO, env=env, text=True, capture_output=True, timeout=200)


@pytest.fixture(scope="module")
def parity(tmp_path_factory, corpus_prefix):
    out = tmp_path_factory.mktemp("parity")
    return out, _parity(out, corpus_prefix)


@pytest.mark.timeout(240)
def test_parity_script_gives_bitwise_identical_curves_on_cpu(parity):
    out, proc = parity
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdicts = {line.split()[0]: line for line in proc.stdout.splitlines()
                if line.startswith(("homogeneous_b ", "mixed ", "mixed_direct "))}
    assert set(verdicts) == {"homogeneous_b", "mixed", "mixed_direct"}
    assert all(line.endswith("PASS (bitwise identical)") for line in verdicts.values())
    assert (out / "compare.png").read_bytes().startswith(PNG_MAGIC)
    assert "| mixed | 10 | 0 |" in (out / "compare.md").read_text()
    # The three runs really were the three layouts the experiment claims.
    plans = {name: yaml.safe_load((out / name / "plan.yaml").read_text())
             for name in ("homogeneous_a", "homogeneous_b", "mixed", "mixed_direct")}
    assert [s["group"] for s in plans["homogeneous_a"]["stages"]] == ["nvidia", "nvidia"]
    assert [s["group"] for s in plans["homogeneous_b"]["stages"]] == ["amd", "amd"]
    assert [s["group"] for s in plans["mixed"]["stages"]] == ["nvidia", "amd"]
    assert [s["group"] for s in plans["mixed_direct"]["stages"]] == ["nvidia", "amd"]
    direct = yaml.safe_load((out / "mixed_direct" / "config.yaml").read_text())
    assert direct["cluster"]["transport"]["kind"] == "direct"
    assert all([s["layers"] for s in p["stages"]] == [2, 2] for p in plans.values())


@pytest.mark.timeout(120)
def test_a_different_split_agrees_within_1e_5(tmp_path, parity):
    out, proc = parity
    assert proc.returncode == 0
    # The mixed run again with the layers split [1,3] instead of [2,2]: its
    # own overrides, with the split replaced (hydra's last override wins).
    overrides = yaml.safe_load((out / "mixed" / ".hydra" / "overrides.yaml").read_text())
    split = tmp_path / "mixed_1_3"
    trained = run_cli(["-m", "hetpipe.pretrain", *overrides, "partition.layers=[1,3]", f"hydra.run.dir={split}"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert [s["layers"] for s in yaml.safe_load((split / "plan.yaml").read_text())["stages"]] == [1, 3]
    proc = run_cli(["-m", "hetpipe.compare", str(out / "mixed"), str(split), "--rtol", "1e-5"])
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout + proc.stderr
