"""``python -m hetpipe.compare RUN_A RUN_B [...] [--rtol R] [--out DIR]``: loss-curve parity.

Reads each run's metrics (a run directory's ``metrics.jsonl``, a JSONL file
given directly, or the run's wandb offline log when it has no JSONL), aligns
the runs by step, prints each run's summary and compares every run with the
first (the reference) on their common steps: max and mean absolute and
relative loss difference and the final-loss relative error, with a verdict
against ``--rtol`` (0 demands bitwise-identical curves). Optionally writes a
PNG of the curves and their difference from the reference, and a Markdown
table. Exits 1 when a verdict fails and 2 when a run cannot be read, so
scripts and CI can rely on it.

Parity is the claim that a mixed-vendor pipeline trains exactly like a
homogeneous one; a loss curve is the cheapest evidence of it, and the
difference curve shows where two runs part ways when they do.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hetpipe.errors import HetpipeError, run_cli
from hetpipe.wandb_log import wandb_logs, wandb_rows


@dataclass
class Run:
    """One run's metrics rows, keyed by step."""
    label: str   # short name for tables and legends
    source: str  # the file(s) the rows came from
    rows: dict[int, dict[str, Any]]

    @property
    def loss(self) -> dict[int, float]:
        return {step: float(row["loss"]) for step, row in self.rows.items()}

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
    """``run``'s loss curve against the reference's, on the steps both logged."""
    a, b = reference.loss, run.loss
    steps = sorted(set(a) & set(b))
    if not steps:
        raise HetpipeError(f"{run.source} and {reference.source} share no steps to compare")
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
    """The rows of a run directory, a metrics JSONL file, a wandb offline run
    directory or a ``.wandb`` log; a run directory's ``metrics.jsonl`` wins
    over its wandb mirror (it is the record the trainer writes first)."""
    path = Path(spec)
    if path.is_file():
        rows = wandb_rows([path], _checked_row) if path.suffix == ".wandb" else _jsonl_rows(path)
        source = str(path)
    elif path.is_dir():
        jsonl = path / "metrics.jsonl"
        if jsonl.is_file():
            rows, source = _jsonl_rows(jsonl), str(jsonl)
        else:
            logs = wandb_logs(path)
            if not logs:
                raise HetpipeError(f"{path}: no metrics.jsonl and no wandb offline run "
                                   "(is it a hetpipe run directory?)")
            rows, source = wandb_rows(logs, _checked_row), ", ".join(str(p) for p in logs)
    else:
        raise HetpipeError(f"{path}: no such run directory or metrics file")
    if not rows:
        raise HetpipeError(f"{source}: no metrics rows (did the run finish a log interval?)")
    return Run(label=label, source=source, rows=rows)


def _checked_row(row: Any, where: str) -> tuple[int, dict[str, Any]]:
    if not isinstance(row, dict) or not isinstance(row.get("step"), int) \
            or not isinstance(row.get("loss"), (int, float)):
        raise HetpipeError(f"{where}: a metrics row needs an integer 'step' and a numeric 'loss'")
    return row["step"], row


def _jsonl_rows(path: Path) -> dict[int, dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise HetpipeError(f"{path}:{number}: not a JSON row ({exc.msg})") from None
            step, row = _checked_row(row, f"{path}:{number}")
            rows[step] = row
    return rows


def run_labels(specs: list[str]) -> list[str]:
    """Short names for the runs (a run directory's name), or the paths as
    given where short names would collide."""
    names = []
    for spec in specs:
        path = Path(spec)
        if path.name == "metrics.jsonl" or path.suffix == ".wandb":
            path = path.parent
        names.append(path.resolve().name or spec)
    return names if len(set(names)) == len(names) else list(specs)


# -------------------------------------------------------------------- reports

def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _verdict(c: Comparison, rtol: float) -> str:
    return ("PASS" if c.passes(rtol) else "FAIL") + (" (bitwise identical)" if c.identical else "")


def print_report(runs: list[Run], comparisons: list[Comparison], rtol: float, ok: bool) -> None:
    print(f"{'run':<40} {'steps':>6} {'first loss':>11} {'final loss':>11} {'med tok/s':>10} "
          f"{'med TFLOP/s':>11}")
    for run in runs:
        loss = run.loss
        print(f"{run.label[-40:]:<40} {len(loss):>6} {loss[min(loss)]:>11.6f} {loss[max(loss)]:>11.6f} "
              f"{_fmt(run.median('tokens_per_s'), '.4g'):>10} {_fmt(run.median('tflops_per_device'), '.4g'):>11}")
    print(f"\nreference: {runs[0].label} ({runs[0].source})")
    print(f"{'run':<40} {'compared':>8} {'missing':>7} {'max |d|':>10} {'mean |d|':>10} {'max rel':>10} "
          f"{'mean rel':>10} {'final rel':>10}  verdict")
    for run, c in zip(runs[1:], comparisons):
        print(f"{run.label[-40:]:<40} {c.compared:>8} {c.missing:>7} {c.max_abs:>10.3e} {c.mean_abs:>10.3e} "
              f"{c.max_rel:>10.3e} {c.mean_rel:>10.3e} {c.final_rel:>10.3e}  {_verdict(c, rtol)}")
    print(f"\nrtol={rtol}: {'all runs agree' if ok else 'curves differ beyond tolerance'}")


def markdown_report(runs: list[Run], comparisons: list[Comparison], rtol: float, ok: bool) -> str:
    """Two tables: one row per run, then one row per run compared with the reference."""
    lines = ["# Loss-curve parity", "",
             f"Reference: `{runs[0].label}`. Tolerance: rtol={rtol} "
             f"({'bitwise identical' if rtol == 0 else 'max relative loss difference'}). "
             f"Verdict: **{'PASS' if ok else 'FAIL'}**.", "",
             "| run | source | steps | first loss | final loss | median tokens/s | median TFLOP/s/device |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for run in runs:
        loss = run.loss
        lines.append(f"| {run.label} | `{run.source}` | {len(loss)} | {loss[min(loss)]:.6f} | "
                     f"{loss[max(loss)]:.6f} | {_fmt(run.median('tokens_per_s'), '.4g')} | "
                     f"{_fmt(run.median('tflops_per_device'), '.4g')} |")
    lines += ["", "| run vs reference | compared steps | missing steps | max abs diff | mean abs diff | "
              "max rel diff | mean rel diff | final rel err | verdict |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for run, c in zip(runs[1:], comparisons):
        lines.append(f"| {run.label} | {c.compared} | {c.missing} | {c.max_abs:.3e} | {c.mean_abs:.3e} | "
                     f"{c.max_rel:.3e} | {c.mean_rel:.3e} | {c.final_rel:.3e} | {_verdict(c, rtol)} |")
    return "\n".join(lines) + "\n"


def plot_curves(runs: list[Run], rtol: float, ok: bool, path: Path) -> None:
    """Loss against step for every run above, loss minus the reference's
    below (on the steps both logged)."""
    try:
        # Imported only when a plot is asked for: comparing needs no plotting
        # stack. The Agg canvas renders without a display or pyplot's state.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise HetpipeError("writing a plot needs the matplotlib package: pip install 'hetpipe[plot]'") from None
    fig = Figure(figsize=(8, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    # Parity means curves on top of each other: distinct line styles keep
    # every run visible where they coincide.
    styles = ["-", "--", ":", "-."]
    reference = runs[0].loss
    for i, run in enumerate(runs):
        loss = run.loss
        steps = sorted(loss)
        top.plot(steps, [loss[s] for s in steps], styles[i % len(styles)], color=f"C{i}", label=run.label)
        if i:
            common = sorted(set(loss) & set(reference))
            bottom.plot(common, [loss[s] - reference[s] for s in common], styles[i % len(styles)],
                        color=f"C{i}", label=run.label)
    bottom.axhline(0.0, color="0.6", linewidth=0.8)
    top.set_ylabel("loss")
    top.set_title(f"rtol={rtol}: {'PASS' if ok else 'FAIL'}")
    top.legend()
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"loss − {runs[0].label}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=120)


# ------------------------------------------------------------------------ CLI

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hetpipe.compare", description=__doc__.split("\n\n")[1],
        epilog="Every run is compared with the first one; runs with different step sets are "
               "compared on their common steps and the missing ones are counted.")
    parser.add_argument("runs", nargs="+",
                        help="run directories (metrics.jsonl, else wandb/offline-run-*), metrics JSONL files, "
                             "wandb offline run directories or .wandb files; the first is the reference")
    parser.add_argument("--rtol", type=float, default=0.0,
                        help="largest per-step relative loss difference that passes (0: bitwise identical)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="write compare.png and compare.md into DIR")
    parser.add_argument("--plot", type=Path, metavar="PATH.png",
                        help="write the curves and their difference from the reference here (overrides --out's)")
    parser.add_argument("--markdown", type=Path, metavar="PATH.md",
                        help="write the summary tables here (overrides --out's)")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        parser.error("give at least two runs")
    if args.rtol < 0:
        parser.error("--rtol must be >= 0")
    plot_path = args.plot or (args.out / "compare.png" if args.out else None)
    markdown_path = args.markdown or (args.out / "compare.md" if args.out else None)

    def _run() -> int:
        runs = [load_run(spec, label) for spec, label in zip(args.runs, run_labels(args.runs))]
        comparisons = [compare_runs(runs[0], run) for run in runs[1:]]
        ok = all(c.passes(args.rtol) for c in comparisons)
        print_report(runs, comparisons, args.rtol, ok)
        # Written whatever the verdict: a failing run's plot is the one worth reading.
        if markdown_path:
            markdown_path.parent.mkdir(parents=True, exist_ok=True)
            markdown_path.write_text(markdown_report(runs, comparisons, args.rtol, ok), encoding="utf-8")
            print(f"wrote {markdown_path}")
        if plot_path:
            plot_curves(runs, args.rtol, ok, plot_path)
            print(f"wrote {plot_path}")
        return 0 if ok else 1

    return run_cli(_run)


if __name__ == "__main__":
    sys.exit(main())
