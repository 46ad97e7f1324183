"""``python -m hetpipe.compare RUN_A RUN_B [...] [--rtol R]``: loss-curve parity.

Reads each run directory's ``metrics.jsonl``, aligns the runs by step, and
compares every run with the first: max and mean absolute and relative loss
difference and the final-loss relative error, with a verdict against
``--rtol`` (0 demands bitwise-identical curves). Exits 1 when a verdict fails,
so scripts and CI can rely on it.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from hetpipe.errors import HetpipeError, run_cli
from hetpipe.metrics import read_metrics


@dataclass
class Comparison:
    steps: int
    max_abs: float
    mean_abs: float
    max_rel: float
    mean_rel: float
    final_rel: float
    identical: bool

    def passes(self, rtol: float) -> bool:
        return self.identical if rtol == 0 else self.max_rel <= rtol


def loss_curve(run_dir: str | Path) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in read_metrics(run_dir)}


def compare_curves(a: dict[int, float], b: dict[int, float]) -> Comparison:
    steps = sorted(set(a) & set(b))
    if not steps:
        raise HetpipeError("the runs share no steps to compare")
    absd = [abs(a[s] - b[s]) for s in steps]
    rel = [d / max(abs(a[s]), 1e-12) for d, s in zip(absd, steps)]
    last = steps[-1]
    return Comparison(
        steps=len(steps), max_abs=max(absd), mean_abs=sum(absd) / len(absd), max_rel=max(rel),
        mean_rel=sum(rel) / len(rel), final_rel=abs(a[last] - b[last]) / max(abs(a[last]), 1e-12),
        identical=all(a[s] == b[s] for s in steps))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetpipe.compare", description=__doc__.split("\n\n")[1])
    parser.add_argument("runs", nargs="+", help="run directories (each holds metrics.jsonl); the first is the reference")
    parser.add_argument("--rtol", type=float, default=0.0,
                        help="largest per-step relative loss difference that passes (0: bitwise identical)")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        parser.error("give at least two run directories")

    def _run() -> int:
        curves = [loss_curve(r) for r in args.runs]
        print(f"{'run':<48} {'steps':>6} {'first loss':>11} {'final loss':>11}")
        for run, curve in zip(args.runs, curves):
            first, last = min(curve), max(curve)
            print(f"{str(run)[-48:]:<48} {len(curve):>6} {curve[first]:>11.6f} {curve[last]:>11.6f}")
        ok = True
        print(f"\nreference: {args.runs[0]}")
        print(f"{'run':<48} {'max |d|':>10} {'mean |d|':>10} {'max rel':>10} {'final rel':>10}  verdict")
        for run, curve in zip(args.runs[1:], curves[1:]):
            c = compare_curves(curves[0], curve)
            verdict = "PASS" if c.passes(args.rtol) else "FAIL"
            ok &= verdict == "PASS"
            note = " (bitwise identical)" if c.identical else ""
            print(f"{str(run)[-48:]:<48} {c.max_abs:>10.3e} {c.mean_abs:>10.3e} {c.max_rel:>10.3e} "
                  f"{c.final_rel:>10.3e}  {verdict}{note}")
        print(f"\nrtol={args.rtol}: {'all runs agree' if ok else 'curves differ beyond tolerance'}")
        return 0 if ok else 1

    return run_cli(_run)


if __name__ == "__main__":
    sys.exit(main())
