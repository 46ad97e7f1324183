"""``python -m hetpipe.compare RUN_A RUN_B [...] [--rtol R | --noise-ref RUN_A2] [--out DIR]``: loss-curve parity.

Reads each run's metrics (a run directory's ``metrics.jsonl`` or a JSONL file
given directly), aligns the runs by step, prints each run's summary and
compares every run with the first (the reference) on their common steps: max
and mean absolute and relative loss difference and the final-loss relative
error, with a verdict (hetpipe.cli.compare_verdict): against ``--rtol`` where
given; bitwise identical for two runs of ``train.deterministic=true``;
beyond the noise floor fails with ``--noise-ref`` (a second run of the
reference's configuration, whose difference from the reference is shown
beside each verdict); else bitwise identical. The training curve comes from
rows with ``loss``; where both runs also have validation rows (``val_loss``),
their validation curves are compared the same way and count towards the
verdict. Optionally writes a PNG of the curves and their difference from the
reference, and a Markdown table. Exits 1 when a verdict fails and 2 when a run
cannot be read, so scripts and CI can rely on it.

Parity is the claim that a mixed-vendor pipeline trains exactly like a
homogeneous one; a loss curve is the cheapest evidence of it, and the
difference curve shows where two runs part ways when they do. Only
``metrics.jsonl`` is read: it is the record the trainer writes, and wandb or
TensorBoard files are mirrors of it in formats hetpipe does not own.

``python -m hetpipe.compare --sweep DIR`` summarises a hydra sweep instead
(hetpipe/cli/sweep_summary.py). Jobs of a sweep compared as runs are labelled by
the overrides that set them apart, not by their job numbers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hetpipe.cli.compare_verdict import NOISE_K, TRAINING, VALIDATION, Judge
from hetpipe.errors import HetpipeError, run_cli
from hetpipe.cli.sweep_jobs import job_overrides, override_labels


@dataclass
class Run:
    """One run's metrics rows, keyed by step."""
    label: str   # short name for tables and legends
    source: str  # the file the rows came from
    rows: dict[int, dict[str, Any]]      # training rows (with "loss")
    val_rows: dict[int, dict[str, Any]]  # validation rows (with "val_loss")

    @property
    def loss(self) -> dict[int, float]:
        return {step: float(row["loss"]) for step, row in self.rows.items()}

    @property
    def val_loss(self) -> dict[int, float]:
        return {step: float(row["val_loss"]) for step, row in self.val_rows.items()}

    @property
    def deterministic(self) -> bool:
        """Every training row was written by a ``train.deterministic=true`` run."""
        return all(row.get("deterministic") is True for row in self.rows.values())

    def median(self, key: str) -> Optional[float]:
        # The median, not the mean: the first log interval carries warm-up
        # and would skew a mean of a short run's throughput.
        values = [r[key] for r in self.rows.values() if isinstance(r.get(key), (int, float))]
        return statistics.median(values) if values else None


@dataclass
class Comparison:
    compared: int  # steps both runs logged
    missing: int   # steps only one of them logged
    max_abs: float
    mean_abs: float
    max_rel: float
    mean_rel: float
    final_rel: float
    identical: bool

    def passes(self, rtol: float) -> bool:
        return self.identical if rtol == 0 else self.max_rel <= rtol


def compare_runs(reference: Run, run: Run) -> Comparison:
    """``run``'s training loss curve against the reference's, on the steps both logged."""
    return _compare_curves(reference.loss, run.loss, f"{run.source} and {reference.source} share no steps")


def compare_validation(reference: Run, run: Run) -> Optional[Comparison]:
    """``run``'s validation loss curve against the reference's; None when
    either run has no validation rows (the pair compares training only)."""
    if not reference.val_rows or not run.val_rows:
        return None
    return _compare_curves(reference.val_loss, run.val_loss,
                           f"{run.source} and {reference.source} share no validation steps")


def _compare_curves(a: dict[int, float], b: dict[int, float], disjoint: str) -> Comparison:
    steps = sorted(set(a) & set(b))
    if not steps:
        raise HetpipeError(f"{disjoint} to compare")
    absd = [abs(a[s] - b[s]) for s in steps]
    rel = [d / max(abs(a[s]), 1e-12) for d, s in zip(absd, steps)]
    last = steps[-1]
    return Comparison(
        compared=len(steps), missing=len(set(a) ^ set(b)), max_abs=max(absd), mean_abs=sum(absd) / len(absd),
        max_rel=max(rel), mean_rel=sum(rel) / len(rel),
        final_rel=abs(a[last] - b[last]) / max(abs(a[last]), 1e-12),
        identical=all(a[s] == b[s] for s in steps))


# ---------------------------------------------------------------- reading runs

def load_run(spec: str, label: str) -> Run:
    """The rows of a run directory's ``metrics.jsonl`` or of a metrics JSONL file."""
    path = Path(spec)
    if path.is_dir() and (path / "metrics.jsonl").is_file():
        path = path / "metrics.jsonl"
    if _is_wandb(path):
        raise HetpipeError(f"{path}: compare reads metrics.jsonl, not wandb runs: pass the hetpipe run "
                           "directory that holds metrics.jsonl")
    if path.is_dir():
        raise HetpipeError(f"{path}: no metrics.jsonl (is it a hetpipe run directory?)")
    if not path.is_file():
        raise HetpipeError(f"{path}: no such run directory or metrics file")
    rows, val_rows = _jsonl_rows(path)
    if not rows:
        raise HetpipeError(f"{path}: no metrics rows with a training loss (did the run finish a log interval?)")
    return Run(label=label, source=str(path), rows=rows, val_rows=val_rows)


def _is_wandb(path: Path) -> bool:
    """A .wandb log, a wandb run directory, a wandb directory, or a run
    directory whose wandb mirror outlived its metrics.jsonl."""
    return path.suffix == ".wandb" or path.is_dir() and any(
        next(path.glob(pattern), None) for pattern in ("*.wandb", "*/*.wandb", "wandb"))


def _jsonl_rows(path: Path) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """Training rows (with ``loss``) and validation rows (with ``val_loss``), by step."""
    rows: dict[int, dict[str, Any]] = {}
    val_rows: dict[int, dict[str, Any]] = {}
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise HetpipeError(f"{path}:{number}: not a JSON row ({exc.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise HetpipeError(f"{path}:{number}: a metrics row needs an integer 'step'")
            if "event" in row:
                continue  # a skipped step, a restart, a preemption: no loss to compare
            key = "loss" if "loss" in row else "val_loss"
            if not isinstance(row.get(key), (int, float)):
                raise HetpipeError(f"{path}:{number}: a metrics row needs a numeric 'loss' or 'val_loss'")
            (rows if key == "loss" else val_rows)[row["step"]] = row
    return rows, val_rows


def run_labels(specs: list[str]) -> list[str]:
    """Short names for the runs: the overrides that set them apart where all are
    jobs of hydra sweeps (directories named by their job number), else a run
    directory's name; the paths as given where short names would collide."""
    paths = [Path(spec).parent if Path(spec).name == "metrics.jsonl" else Path(spec) for spec in specs]
    overrides = [job_overrides(p) if p.name.isdigit() else None for p in paths]
    names = override_labels(overrides) if all(o is not None for o in overrides) else \
        [p.resolve().name or spec for p, spec in zip(paths, specs)]
    return names if len(set(names)) == len(names) else list(specs)


# -------------------------------------------------------------------- reports

def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _final(curve: dict[int, float]) -> Optional[float]:
    return curve[max(curve)] if curve else None


def _training_only(reference: Run, run: Run) -> str:
    """Why a pair's validation curves are not compared."""
    lacking = [r.label for r in (run, reference) if not r.val_rows]
    return f"training only: no validation rows in {' and '.join(lacking)}"


@dataclass
class Report:
    """Every run, each pair's comparisons and how they are judged."""
    runs: list[Run]
    comparisons: list[Comparison]
    validations: list[Optional[Comparison]]
    judge: Judge

    def verdicts(self) -> list[tuple[Run, str, Comparison]]:
        pairs = [(run, TRAINING, c) for run, c in zip(self.runs[1:], self.comparisons)]
        return pairs + [(run, VALIDATION, v) for run, v in zip(self.runs[1:], self.validations) if v is not None]

    @property
    def ok(self) -> bool:
        return all(self.judge.verdict(self.runs[0], run, metric, c).ok for run, metric, c in self.verdicts())

    def verdict(self, run: Run, metric: str, c: Comparison) -> str:
        return self.judge.verdict(self.runs[0], run, metric, c).text

    def deterministic_runs(self) -> list[str]:
        return [run.label for run in self.runs if run.deterministic]

    def summary(self) -> str:
        return f"{self.judge.describe()}: {'all runs agree' if self.ok else 'curves differ beyond tolerance'}"


def print_report(report: Report) -> None:
    runs, judge = report.runs, report.judge
    print(f"{'run':<40} {'steps':>6} {'first loss':>11} {'final loss':>11} {'med tok/s':>10} "
          f"{'med TFLOP/s':>11} {'val steps':>9} {'final val':>10}")
    for run in runs:
        loss = run.loss
        print(f"{run.label[-40:]:<40} {len(loss):>6} {loss[min(loss)]:>11.6f} {loss[max(loss)]:>11.6f} "
              f"{_fmt(run.median('tokens_per_s'), '.4g'):>10} {_fmt(run.median('tflops_per_device'), '.4g'):>11} "
              f"{len(run.val_rows):>9} {_fmt(_final(run.val_loss), '.6f'):>10}")
    if report.deterministic_runs():
        print(f"deterministic (train.deterministic=true): {', '.join(report.deterministic_runs())}; "
              "two of them pass only bitwise identical")
    print(f"\nreference: {runs[0].label} ({runs[0].source})")
    if judge.noise_ref is not None:
        print(f"noise floor: {runs[0].label} against {judge.noise_ref}, a second run of its configuration "
              f"(floor max and mean relative difference); a run fails beyond {judge.k:g}x it")
    floor_header = f" {'floor max':>10} {'floor mean':>10}" if judge.noise_ref is not None else ""
    header = (f"{'compared':>8} {'missing':>7} {'max |d|':>10} {'mean |d|':>10} {'max rel':>10} "
              f"{'mean rel':>10} {'final rel':>10}{floor_header}  verdict")

    def line(run: Run, metric: str, c: Comparison) -> str:
        floors = "".join(f" {cell:>10}" for cell in judge.floor_cells(metric)) if floor_header else ""
        return (f"{run.label[-40:]:<40} {c.compared:>8} {c.missing:>7} {c.max_abs:>10.3e} {c.mean_abs:>10.3e} "
                f"{c.max_rel:>10.3e} {c.mean_rel:>10.3e} {c.final_rel:>10.3e}{floors}  "
                f"{report.verdict(run, metric, c)}")

    print(f"{'training loss':<40} {header}")
    for run, c in zip(runs[1:], report.comparisons):
        print(line(run, TRAINING, c))
    if not any(run.val_rows for run in runs):
        print("validation loss: training only, no run has validation rows")
    else:
        print(f"{'validation loss':<40} {header}")
        for run, v in zip(runs[1:], report.validations):
            print(line(run, VALIDATION, v) if v else f"{run.label[-40:]:<40} {_training_only(runs[0], run)}")
    print(f"\n{report.summary()}")


def _rule_words(judge: Judge) -> str:
    if judge.noise_ref is not None and judge.rtol is None:
        return (f"a run fails when its max or mean relative loss difference exceeds {judge.k:g}x the noise floor, "
                f"the reference against `{judge.noise_ref}`; two deterministic runs must be bitwise identical")
    if judge.rtol:
        return "max relative loss difference"
    return "bitwise identical"


def markdown_report(report: Report) -> str:
    """One row per run, then one row per run compared with the reference:
    a table for training loss and, where runs have validation rows, one for
    validation loss."""
    runs, judge = report.runs, report.judge
    lines = ["# Loss-curve parity", "",
             f"Reference: `{runs[0].label}`. Rule: {judge.describe()} ({_rule_words(judge)}). "
             f"Verdict: **{'PASS' if report.ok else 'FAIL'}**.", "",
             "| run | source | steps | first loss | final loss | median tokens/s | median TFLOP/s/device | "
             "validation steps | final validation loss |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for run in runs:
        loss = run.loss
        lines.append(f"| {run.label} | `{run.source}` | {len(loss)} | {loss[min(loss)]:.6f} | "
                     f"{loss[max(loss)]:.6f} | {_fmt(run.median('tokens_per_s'), '.4g')} | "
                     f"{_fmt(run.median('tflops_per_device'), '.4g')} | {len(run.val_rows)} | "
                     f"{_fmt(_final(run.val_loss), '.6f')} |")
    if report.deterministic_runs():
        lines += ["", f"Deterministic runs (`train.deterministic=true`): "
                      f"{', '.join(f'`{name}`' for name in report.deterministic_runs())}."]
    noise = judge.noise_ref is not None
    columns = ("compared steps | missing steps | max abs diff | mean abs diff | max rel diff | mean rel diff | "
               f"final rel err | {'floor max rel | floor mean rel | ' if noise else ''}verdict |")
    rule = "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if noise else "") + " --- |"

    def row(run: Run, metric: str, c: Comparison) -> str:
        floors = "".join(f"{cell} | " for cell in judge.floor_cells(metric)) if noise else ""
        return (f"| {run.label} | {c.compared} | {c.missing} | {c.max_abs:.3e} | {c.mean_abs:.3e} | "
                f"{c.max_rel:.3e} | {c.mean_rel:.3e} | {c.final_rel:.3e} | {floors}{report.verdict(run, metric, c)} |")

    lines += ["", f"| run vs reference | {columns}", rule]
    lines += [row(run, TRAINING, c) for run, c in zip(runs[1:], report.comparisons)]
    if not any(run.val_rows for run in runs):
        lines += ["", "Validation: training only, no run has validation rows."]
    else:
        dashes = "- | " * (9 if noise else 7)
        lines += ["", f"| run vs reference (validation) | {columns}", rule]
        lines += [row(run, VALIDATION, v) if v else f"| {run.label} | {dashes}{_training_only(runs[0], run)} |"
                  for run, v in zip(runs[1:], report.validations)]
    return "\n".join(lines) + "\n"


def plot_curves(runs: list[Run], title: str, path: Path) -> None:
    """Loss against step for every run above, loss minus the reference's
    below (on the steps both logged); validation loss likewise in a second
    column where runs have validation rows."""
    try:
        # Imported only when a plot is asked for: comparing needs no plotting
        # stack. The Agg canvas renders without a display or pyplot's state.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise HetpipeError("writing a plot needs the matplotlib package: pip install 'hetpipe[plot]'") from None
    panels = [("training loss", [run.loss for run in runs], None)]
    if any(run.val_rows for run in runs):
        # Markers: validation is sparse, and a single point draws no line.
        panels.append(("validation loss", [run.val_loss for run in runs], "o"))
    fig = Figure(figsize=(8 * len(panels), 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(panels), sharex="col", height_ratios=[2, 1], squeeze=False)
    # Parity means curves on top of each other: distinct line styles keep
    # every run visible where they coincide.
    styles = ["-", "--", ":", "-."]
    for column, (name, curves, marker) in enumerate(panels):
        top, bottom = axes[0][column], axes[1][column]
        reference = curves[0]
        for i, (run, curve) in enumerate(zip(runs, curves)):
            if not curve:
                continue  # a run without validation rows stays out of that legend
            steps = sorted(curve)
            style = dict(linestyle=styles[i % len(styles)], marker=marker, markersize=4, color=f"C{i}",
                         label=run.label)
            top.plot(steps, [curve[s] for s in steps], **style)
            if i:
                common = sorted(set(curve) & set(reference))
                bottom.plot(common, [curve[s] - reference[s] for s in common], **style)
        bottom.axhline(0.0, color="0.6", linewidth=0.8)
        top.set_ylabel(name)
        top.legend()
        bottom.set_xlabel("step")
        bottom.set_ylabel(f"{name} − {runs[0].label}")
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=120)


# ------------------------------------------------------------------------ CLI

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hetpipe.compare", description=__doc__.split("\n\n")[1],
        epilog="Every run is compared with the first one; runs with different step sets are "
               "compared on their common steps and the missing ones are counted.")
    parser.add_argument("runs", nargs="*",
                        help="run directories (their metrics.jsonl) or metrics JSONL files; "
                             "the first is the reference")
    parser.add_argument("--sweep", type=Path, metavar="DIR",
                        help="instead of comparing runs, summarise the hydra sweep (-m) in DIR: one row per "
                             "job (overrides, plan, tokens/s, TFLOP/s/GPU, peak memory, final loss, exit "
                             "status) in DIR/sweep.md and DIR/sweep.csv, with sweep_throughput.png and "
                             "sweep_loss.png")
    parser.add_argument("--rtol", type=float, default=None,
                        help="largest per-step relative loss difference, training or validation, that "
                             "passes, for every pair (0: bitwise identical; the default unless --noise-ref)")
    parser.add_argument("--noise-ref", metavar="RUN",
                        help="a second run of the reference's configuration: its difference from the "
                             "reference is the noise floor, shown beside each verdict, and a run fails only "
                             "beyond --noise-k times it (two train.deterministic runs: bitwise still)")
    parser.add_argument("--noise-k", type=float, default=NOISE_K,
                        help=f"how many noise floors a run may differ by (default {NOISE_K:g}; "
                             "hetpipe/cli/compare_verdict.py says why)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="write compare.png and compare.md into DIR")
    parser.add_argument("--plot", type=Path, metavar="PATH.png",
                        help="write the curves and their difference from the reference here (overrides --out's)")
    parser.add_argument("--markdown", type=Path, metavar="PATH.md",
                        help="write the summary tables here (overrides --out's)")
    return parser


def build_report(specs: list[str], rtol: Optional[float], noise_ref: Optional[str], k: float) -> Report:
    """Read the runs (and the noise run), compare each with the first, and say how they are judged."""
    labels = run_labels([*specs, *([noise_ref] if noise_ref else [])])
    runs = [load_run(spec, label) for spec, label in zip(specs, labels)]
    judge = Judge(rtol=rtol, k=k)
    if noise_ref is not None:
        noise = load_run(noise_ref, labels[-1])
        judge.noise_ref = noise.label
        judge.floors[TRAINING] = compare_runs(runs[0], noise)
        floor = compare_validation(runs[0], noise)
        if floor is not None:
            judge.floors[VALIDATION] = floor
    return Report(runs, [compare_runs(runs[0], run) for run in runs[1:]],
                  [compare_validation(runs[0], run) for run in runs[1:]], judge)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.sweep is not None:
        if args.runs:
            parser.error("--sweep DIR summarises the sweep's own jobs: give no runs beside it")
        return run_cli(lambda: _summarise_sweep(args.sweep))
    if len(args.runs) < 2:
        parser.error("give at least two runs")
    if args.rtol is not None and args.rtol < 0:
        parser.error("--rtol must be >= 0")
    if args.noise_k <= 0:
        parser.error("--noise-k must be > 0")
    plot_path = args.plot or (args.out / "compare.png" if args.out else None)
    markdown_path = args.markdown or (args.out / "compare.md" if args.out else None)

    def _run() -> int:
        report = build_report(args.runs, args.rtol, args.noise_ref, args.noise_k)
        print_report(report)
        # Written whatever the verdict: a failing run's plot is the one worth reading.
        if markdown_path:
            markdown_path.parent.mkdir(parents=True, exist_ok=True)
            markdown_path.write_text(markdown_report(report), encoding="utf-8")
            print(f"wrote {markdown_path}")
        if plot_path:
            plot_curves(report.runs, report.summary(), plot_path)
            print(f"wrote {plot_path}")
        return 0 if report.ok else 1

    return run_cli(_run)


def _summarise_sweep(sweep_dir: Path) -> int:
    from hetpipe.cli.sweep_summary import print_summary  # hydra's callback base class loads with it

    print_summary(sweep_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
