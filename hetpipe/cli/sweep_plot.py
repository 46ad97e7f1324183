"""A sweep's plots: throughput by plan (``sweep_throughput.png``) and loss curves
labelled by each job's overrides (``sweep_loss.png``), from the rows of
hetpipe/cli/sweep_summary.py. matplotlib is imported here alone: the table needs
no plotting stack (an ImportError tells the caller it is missing)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hetpipe.cli.sweep_summary import SweepRow


def _figure(width: float, height: float):
    # The Agg canvas renders without a display or pyplot's state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_throughput(rows: list["SweepRow"], path: Path) -> Path:
    """One bar per job, labelled by its plan and overrides; a failed job is named with its status."""
    fig = _figure(9, 1.5 + 0.6 * len(rows))
    ax = fig.subplots()
    names = [f"{row.plan}\n{row.label}" for row in rows]
    values = [row.tokens_per_s or 0.0 for row in rows]
    bars = ax.barh(range(len(rows)), values, color=["C0" if row.job.exit_status == 0 else "C3" for row in rows])
    for bar, row in zip(bars, rows):
        if row.job.exit_status != 0:
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" exit {row.status}", va="center")
    ax.set_yticks(range(len(rows)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (median step)")
    ax.set_title("throughput by plan (split, schedule, TP x DP)")
    fig.savefig(path, format="png", dpi=120)
    return path


def plot_loss(rows: list["SweepRow"], path: Path) -> Path:
    """Every job's training loss against step, labelled by its overrides."""
    fig = _figure(9, 6)
    ax = fig.subplots()
    styles = ["-", "--", ":", "-."]
    for i, row in enumerate(rows):
        if row.loss:
            steps = sorted(row.loss)
            ax.plot(steps, [row.loss[s] for s in steps], linestyle=styles[i % len(styles)], color=f"C{i}",
                    label=row.label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    if any(row.loss for row in rows):
        ax.legend(fontsize=8)
    fig.savefig(path, format="png", dpi=120)
    return path
