#!/usr/bin/env python3
"""Colocated against separate placement on the same CPU cores, in sync mode (the one mode colocation runs).

The main job (recipes/qwen_moe_grpo.sh) runs twice on the same config, a random tiny Qwen3-MoE with long-tailed
responses (as bench/orchestration.py): ``run.placement=separate`` (the broadcast sync) and ``colocated`` (the engines
release their memory while the trainer trains, then take the weights handed over in shared memory). Reported from
each run's metrics.jsonl after its first (warm-up) step: samples per second, the weight push's seconds, and for the
colocated run the sleep (pause and release), wake (resumes and continue) and push seconds per step and their share of
the step.

    python bench/colocate.py [--steps 12] [--out docs/benchmarks/colocation.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("sleep", "wake", "push")


def run(work: Path, placement: str, steps: int, model: Path) -> dict:
    from bench.report import mode_summary, run_demo_job

    rows, wall = run_demo_job(work, work / placement, model, steps, "run.mode=sync", f"run.placement={placement}")
    result = {
        **mode_summary(rows),
        "wall_s": wall,
        "step_s": statistics.mean(r["time/step_seconds"] for r in rows),
        "sync_s": statistics.mean(r["sync/seconds"] for r in rows),
    }
    if placement == "colocated":
        result.update({p: statistics.mean(r[f"colocate/{p}_seconds"] for r in rows) for p in PHASES})
        result["fraction"] = statistics.mean(r["colocate/step_fraction"] for r in rows)
    print(placement, result, flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", help="append the table to this markdown file")
    args = p.parse_args()
    from bench.report import publish

    from moerl.models.tiny import save_tiny_hf

    with tempfile.TemporaryDirectory(prefix="moerl-bench-") as tmp:
        work = Path(tmp)
        model = save_tiny_hf("Qwen3MoeForCausalLM", work / "random-tiny")
        results = {placement: run(work, placement, args.steps, model) for placement in ("separate", "colocated")}
    sep, col = results["separate"], results["colocated"]
    lines = [
        f"\n## Colocated against separate, sync mode ({platform.processor() or platform.machine()}, {os.cpu_count()} "
        f"cores, {time.strftime('%Y-%m-%d')}, {args.steps} steps each less the first, 8 groups x 8 samples per step, "
        f"random tiny Qwen3-MoE, responses mean {sep['len_mean']:.0f} tokens)\n",
        "| placement | samples/s | step s | weight push s | sleep s | wake s | sleep + wake + push, of the step |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| separate | {sep['samples_per_s']:.1f} | {sep['step_s']:.3f} | {sep['sync_s']:.3f} | | | |",
        f"| colocated | {col['samples_per_s']:.1f} | {col['step_s']:.3f} | {col['push']:.3f} | {col['sleep']:.3f} | "
        f"{col['wake']:.3f} | {col['fraction']:.1%} |",
    ]
    publish(lines, args.out)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
