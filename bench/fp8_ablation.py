"""The figure and table of docs/fp8-rollouts.md from two ``moerl ablate`` grids of the CPU demo:

- sync mode (every token sampled by the policy that trains on it: the mismatch is numerics alone):
  ``engines.quantization=none,fp8`` x ``trainer.replay.routing=off,R3`` x ``rollout.seed=0,1,2``, 15 steps;
- async mode (one version of staleness): the same two axes x ``trainer.loss.correction=tis,icepop,token_mask,seq_mask``
  x ``rollout.seed=0,1``, 30 steps.

Each value is a mean over a configuration's seeds and every step, the mismatch's a median (a step's k3 can spike a
thousandfold); a part of the split with no tokens in a step is left out.

Usage: python bench/fp8_ablation.py --sync runs/fp8_sync --async runs/fp8 [--figure docs/figures/fp8_ablation.png]
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moerl.orchestrator.metrics import read_metrics  # noqa: E402

_AXIS = re.compile(r"(quantization|routing|correction|seed)-([A-Za-z0-9_]+)")


def runs(grid: Path) -> dict[tuple, list[list[dict]]]:
    """(quantization, routing, correction or None) -> each seed's metrics rows."""
    out: dict[tuple, list[list[dict]]] = {}
    for run in sorted(p for p in grid.iterdir() if p.is_dir()):
        axes = dict(_AXIS.findall(run.name))
        key = (axes["quantization"], axes["routing"], axes.get("correction"))
        out.setdefault(key, []).append(read_metrics(run))
    return out


def mean(seeds: list[list[dict]], key: str) -> float:
    """Over every step of every seed; the median for the mismatch, whose steps spike by orders of magnitude."""
    values = [r[key] for rows in seeds for r in rows if key in r and not math.isnan(r[key])]
    if not values:
        return float("nan")
    return statistics.median(values) if key.startswith("mismatch/") else statistics.mean(values)


def per_step(seeds: list[list[dict]], key: str) -> list[float]:
    steps = min(len(rows) for rows in seeds)
    return [statistics.mean(rows[i][key] for rows in seeds) for i in range(steps)]


SYNC_KEYS = (
    ("routing/agreement", "routing agreement"),
    ("routing/differs_any_layer", "tokens routed otherwise in some layer"),
    ("mismatch/k3_kl", "k3"),
    ("mismatch/k3_kl_routing_agree", "k3, routing agrees"),
    ("mismatch/k3_kl_routing_differ", "k3, routing differs"),
    ("rollout/reward_mean", "reward"),
)
ASYNC_KEYS = (
    ("rollout/reward_mean", "reward"),
    ("mismatch/k3_kl_lag0", "k3, lag 0"),
    ("mismatch/k3_kl_lagged", "k3, lagged"),
    ("mismatch/k3_kl_routing_differ", "k3, routing differs"),
    ("train/grad_norm", "grad norm"),
)


def table(title: str, grid: dict, axes: tuple[str, ...], keys: tuple[tuple[str, str], ...]) -> list[str]:
    """One markdown table: a row per configuration (its ``axes`` values), a column per metric."""
    lines = [
        title,
        "",
        "| " + " | ".join(axes) + " | " + " | ".join(label for _, label in keys) + " |",
        "|---" * (len(axes) + len(keys)) + "|",
    ]
    for config, seeds in sorted(grid.items()):
        values = " | ".join(f"{mean(seeds, key):.4g}" for key, _ in keys)
        lines.append("| " + " | ".join(config[: len(axes)]) + f" | {values} |")
    return lines


def tables(sync: dict, asynchronous: dict) -> list[str]:
    return [
        *table("Sync mode, over 3 seeds x 15 steps (k3: medians):", sync, ("engines", "routing replay"), SYNC_KEYS),
        "",
        *table(
            "Async mode, over 2 seeds x 30 steps (k3: medians):",
            asynchronous,
            ("engines", "routing replay", "correction"),
            ASYNC_KEYS,
        ),
    ]


def figure(sync: dict, asynchronous: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    styles = {("none", "off"): "C0--", ("none", "R3"): "C0-", ("fp8", "off"): "C3--", ("fp8", "R3"): "C3-"}
    for ax, (key, label) in zip(axes[0], (SYNC_KEYS[0], SYNC_KEYS[2], SYNC_KEYS[5]), strict=True):
        for (quantization, routing, _), seeds in sorted(sync.items()):
            ax.plot(per_step(seeds, key), styles[quantization, routing], label=f"{quantization}, replay {routing}")
        ax.set_title(f"sync: {label}")
        ax.set_xlabel("step")
    axes[0][0].legend()
    corrections = sorted({c for _, _, c in asynchronous})
    for ax, (key, label) in zip(axes[1], (ASYNC_KEYS[0], ASYNC_KEYS[1], ASYNC_KEYS[2]), strict=True):
        width = 0.2
        for i, (quantization, routing) in enumerate(styles):
            heights = [mean(asynchronous[quantization, routing, c], key) for c in corrections]
            ax.bar(
                [x + (i - 1.5) * width for x in range(len(corrections))],
                heights,
                width,
                color=styles[quantization, routing][:2],
                alpha=0.5 if routing == "off" else 1.0,
                label=f"{quantization}, replay {routing}",
            )
        ax.set_xticks(range(len(corrections)), corrections)
        ax.set_title(f"async: {label} ({'median' if key.startswith('mismatch/') else 'mean'} of 30 steps)")
    axes[1][0].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sync", type=Path, required=True)
    p.add_argument("--async", dest="asynchronous", type=Path, required=True)
    p.add_argument("--figure", type=Path, default=None)
    args = p.parse_args()
    sync, asynchronous = runs(args.sync), runs(args.asynchronous)
    print("\n".join(tables(sync, asynchronous)))
    if args.figure is not None:
        figure(sync, asynchronous, args.figure)


if __name__ == "__main__":
    main()
