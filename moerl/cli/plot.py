"""``moerl plot``: a run's metrics as PNG curves (:func:`moerl.orchestrator.metrics.plot`)."""

from __future__ import annotations

import argparse

from moerl.orchestrator.metrics import KEY_CURVES, plot


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="moerl plot",
        description=(
            "Plot a run's metrics.jsonl as PNG curves; given several runs, draw them on the same axes (legend: each "
            "run directory's name), e.g. the runs of an ablation."
        ),
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (run.dir of the job)")
    p.add_argument("--out", help="PNG path (default RUN_DIR/curves.png; several runs: compare.png beside the first)")
    p.add_argument("--keys", nargs="+", help=f"metrics to plot (default: {' '.join(KEY_CURVES)})")
    args = p.parse_args(argv)
    try:
        print(plot(args.run_dirs, args.out, tuple(args.keys) if args.keys else KEY_CURVES))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}")
        return 2
    return 0
