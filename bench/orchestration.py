#!/usr/bin/env python3
r"""The three modes side by side, and weight sync bucketed against tensor by tensor.

Modes: the main job (recipes/qwen_moe_grpo.sh) runs ``sync``, ``periodic`` and ``async`` one after the
other on the same machine and config: a random tiny Qwen3-MoE (no warm-up, so responses are long-tailed:
each ends at a stop token the random model draws now and then, or at ``max_new_tokens``), the same
prompts and seeds. Reported per mode, from its metrics.jsonl after the first (warm-up) step: samples
per second of wall time, the trainer's idle fraction, both as ratios to ``sync``.

Weight sync: one process pushes a model's Hub-named tensors to an embedded engine through
``BroadcastSync``, in 512 MiB flattened buckets and one tensor per bucket (one HTTP announce and one
broadcast per tensor), and reports the seconds per update.

With ``--policies groups,length_aware`` the modes run under each rollout schedule policy
(``rollout.schedule.policy``; ``length_aware`` with the overrides of ``--length-aware-extra`` too), and
the table has a row per policy and mode, each ratio against the first policy's ``sync``. The default,
``groups`` alone, is the job's default policy and the table of before.

    python bench/orchestration.py [--steps 12] [--out docs/benchmarks/orchestration.md]
    python bench/orchestration.py --policies groups,length_aware \
        [--length-aware-extra rollout.schedule.chunk_tokens=16]
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


POLICIES = ("groups", "length_aware")


def policy_overrides(policy: str, length_aware_extra: list[str]) -> list[str]:
    """The job's overrides for a rollout schedule policy."""
    return [f"rollout.schedule.policy={policy}", *(length_aware_extra if policy == "length_aware" else [])]


def run_modes(work: Path, steps: int, model: Path, *overrides: str, name: str = "") -> dict[str, dict]:
    from bench.report import mode_summary, run_demo_job

    results = {}
    for mode in ("sync", "periodic", "async"):
        rows, wall = run_demo_job(work, work / f"{name}{mode}", model, steps, f"run.mode={mode}", *overrides)
        results[mode] = {**mode_summary(rows), "wall_s": wall}
        print(name + mode, results[mode], flush=True)
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
    p.add_argument(
        "--policies",
        default="groups",
        help=f"rollout schedule policies to run the modes under, comma-separated, of {', '.join(POLICIES)}",
    )
    p.add_argument(
        "--length-aware-extra",
        nargs="*",
        default=[],
        help="more overrides for the length_aware policy's runs, e.g. rollout.schedule.chunk_tokens=16",
    )
    p.add_argument("--out", help="append the table to this markdown file")
    args = p.parse_args()
    policies = [x for x in args.policies.split(",") if x]
    if not policies or any(x not in POLICIES for x in policies):
        p.error(f"--policies: a comma-separated list of {', '.join(POLICIES)}, got {args.policies!r}")
    from bench.report import publish

    from moerl.models.tiny import save_tiny_hf

    with tempfile.TemporaryDirectory(prefix="moerl-bench-") as tmp:
        work = Path(tmp)
        model = save_tiny_hf("Qwen3MoeForCausalLM", work / "random-tiny")
        several = len(policies) > 1
        runs = {
            policy: run_modes(
                work,
                args.steps,
                model,
                *policy_overrides(policy, args.length_aware_extra),
                name=f"{policy}-" if several else "",
            )
            for policy in policies
        }
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
    base = runs[policies[0]]["sync"]
    lines = [
        f"\n## Orchestration modes ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.steps} "
        f"steps each, 8 groups x 8 samples per step, random tiny Qwen3-MoE, responses mean {base['len_mean']:.0f} / "
        f"max {base['len_max']:.0f} tokens)\n",
    ]
    if several:
        extra = " ".join(f"`{o}`" for o in args.length_aware_extra)
        lines += [
            f"Rollout schedule policies {', '.join(policies)}"
            + (f" (length_aware with {extra})" if extra and "length_aware" in policies else "")
            + f"; each vs sync against the {policies[0]} sync row.\n",
            "| policy | mode | samples/s | vs sync | trainer idle fraction | vs sync | max staleness | "
            "prompts dropped |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
    else:
        lines += [
            "| mode | samples/s | vs sync | trainer idle fraction | vs sync | max staleness | prompts dropped |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
    for policy, modes in runs.items():
        for mode, r in modes.items():
            lines.append(
                ("| " + policy + " " if several else "")
                + f"| {mode} | {r['samples_per_s']:.1f} | {r['samples_per_s'] / base['samples_per_s']:.2f}x | "
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
