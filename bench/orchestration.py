#!/usr/bin/env python3
"""The three modes side by side, and weight sync bucketed against tensor by tensor.

Modes: the main job (recipes/qwen_moe_grpo.sh) runs ``sync``, ``periodic`` and ``async`` one after the
other on the same machine and config: a random tiny Qwen3-MoE (no warm-up, so responses are long-tailed:
each ends at a stop token the random model draws now and then, or at ``max_new_tokens``), the same
prompts and seeds. Reported per mode, from its metrics.jsonl after the first (warm-up) step: samples
per second of wall time, the trainer's idle fraction, both as ratios to ``sync``.

Weight sync: one process pushes a model's Hub-named tensors to an embedded engine through
``BroadcastSync``, in 512 MiB flattened buckets and one tensor per bucket (one HTTP announce and one
broadcast per tensor), and reports the seconds per update.

    python bench/orchestration.py [--steps 12] [--out docs/benchmarks/orchestration.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_modes(work: Path, steps: int, model: Path) -> dict[str, dict]:
    from bench.report import mode_summary, run_demo_job

    results = {}
    for mode in ("sync", "periodic", "async"):
        rows, wall = run_demo_job(work, work / mode, model, steps, f"run.mode={mode}")
        results[mode] = {**mode_summary(rows), "wall_s": wall}
        print(mode, results[mode], flush=True)
    return results


def sync_times(work: Path, model: Path, repeats: int = 3) -> dict[str, float]:
    from safetensors.torch import load_file

    from moerl.weight_sync.broadcast import BroadcastSync
    from tests.engine_server import running_server

    tensors = {}
    for f in sorted(model.glob("*.safetensors")):
        tensors.update(load_file(f))
    named = sorted(tensors.items())
    out = {"tensors": len(named), "mib": sum(t.numel() * t.element_size() for _, t in named) / 2**20}
    with running_server(model, work / "sync-engine-logs") as url:
        sync = BroadcastSync([url], "127.0.0.1", "gloo")
        sync.connect()
        try:
            for label, bucket in (("bucketed_s", 512 << 20), ("per_tensor_s", 0)):
                sync.bucket_bytes = bucket
                times = []
                for i in range(repeats):
                    times.append(sync.push(named, version=f"{label}{i}").seconds)
                out[label] = statistics.median(times)
        finally:
            sync.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument(
        "--sync-hidden", type=int, default=256, help="hidden size of the model used for the weight-sync timing"
    )
    p.add_argument("--out", help="append the table to this markdown file")
    args = p.parse_args()
    from bench.report import publish

    from moerl.models.tiny import save_tiny_hf

    with tempfile.TemporaryDirectory(prefix="moerl-bench-") as tmp:
        work = Path(tmp)
        model = save_tiny_hf("Qwen3MoeForCausalLM", work / "random-tiny")
        modes = run_modes(work, args.steps, model)
        big = save_tiny_hf(
            "Qwen3MoeForCausalLM",
            work / "sync-model",
            hidden_size=args.sync_hidden,
            intermediate_size=4 * args.sync_hidden,
            moe_intermediate_size=args.sync_hidden,
            num_experts=32,
            head_dim=64,
        )
        sync = sync_times(work, big)
    base = modes["sync"]
    lines = [
        f"\n## Orchestration modes ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.steps} "
        f"steps each, 8 groups x 8 samples per step, random tiny Qwen3-MoE, responses mean {base['len_mean']:.0f} / "
        f"max {base['len_max']:.0f} tokens)\n",
        "| mode | samples/s | vs sync | trainer idle fraction | vs sync | max staleness | prompts dropped |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, r in modes.items():
        lines.append(
            f"| {mode} | {r['samples_per_s']:.1f} | {r['samples_per_s'] / base['samples_per_s']:.2f}x | "
            f"{r['idle']:.2f} | {r['idle'] / base['idle'] if base['idle'] else float('nan'):.2f}x | "
            f"{r['staleness_max']:.0f} | {r['dropped']} |"
        )
    lines += [
        f"\n## Weight sync, bucketed vs tensor by tensor (gloo broadcast to one embedded engine, {sync['tensors']} "
        f"tensors, {sync['mib']:.0f} MiB, median of 3)\n",
        "| transport | seconds per update |",
        "| --- | --- |",
        f"| 512 MiB flattened buckets | {sync['bucketed_s']:.3f} |",
        f"| one tensor per bucket | {sync['per_tensor_s']:.3f} |",
        f"| ratio | {sync['per_tensor_s'] / sync['bucketed_s']:.1f}x |",
    ]
    publish(lines, args.out)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
