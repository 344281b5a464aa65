"""``moerl ablate``: the main job under a grid of overrides (:mod:`moerl.orchestrator.ablate`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moerl.orchestrator.ablate import RECIPE, TABLE_KEYS, AblationError, ablate


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    shared = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(
        prog="moerl ablate",
        description=(
            "Run the main job under a grid of overrides, one run after another with the same seeds and data; write a "
            "comparison table (OUT/ablation.md) and the runs' curves on the same axes (OUT/ablation.png)."
        ),
        epilog="Overrides after -- go to every run (e.g. -- run.steps=10 run.mode=sync).",
    )
    p.add_argument(
        "--out", required=True, help="a new directory: a run directory per combination, ablation.md, ablation.png"
    )
    p.add_argument(
        "--grid", action="append", required=True, metavar="KEY=V1,V2", help="an axis of the grid (repeat for more)"
    )
    p.add_argument("--last", type=int, default=3, help="steps at the end of each run averaged in the table (default 3)")
    p.add_argument(
        "--keys", nargs="+", default=list(TABLE_KEYS), help="metrics in the table (KEY:std: its std over the steps)"
    )
    p.add_argument(
        "--recipe", default=str(RECIPE), help="the job's launcher (default: this checkout's recipes/qwen_moe_grpo.sh)"
    )
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    try:
        ablate(Path(args.out), args.grid, shared, Path(args.recipe), args.last, tuple(args.keys))
    except AblationError as e:
        print(f"error: {e}")
        return 2
    return 0
