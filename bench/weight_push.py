"""Bytes per push and push seconds of the four ways the engines can take the policy: full bf16-or-fp32 tensors
(sync.method=broadcast), FP8 (engines.quantization=fp8), deltas (sync.delta=true) and FP8 deltas, side by side in one
run of the CPU demo (recipes/qwen_moe_grpo.yaml: the tiny warmed-up Qwen3-MoE, fp32 trainer and engines on the CPU); and
the same on paper for Qwen3-30B-A3B, the fraction of elements a step changes drawn from an update of its exact shapes.

On paper: each expert, attention and embedding tensor of Qwen3-30B-A3B's shapes is drawn with the spread of its
trained weights (std 0.02; a bf16 model, as the engines hold it), moved by one Adam-like step (each element by ``lr`` in
a random direction, Adam's update being about lr per element whatever the gradient), and the elements whose bf16 value,
or FP8 value and block scale, changed are counted; the delta bytes are :func:`moerl.engines.delta.encode`'s. A real
step's updates are not uniform (rarely routed experts move less, some not at all), so the fractions are an estimate.

Usage: python bench/weight_push.py [--steps 12] [--out docs/benchmarks/weight-push.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from lora_sync import QWEN3_30B_A3B  # noqa: E402
from moerl import fp8  # noqa: E402
from moerl.engines.delta import encode  # noqa: E402
from moerl.models import family_for  # noqa: E402
from report import measured_steps, publish  # noqa: E402

WAYS = {
    "full": [],
    "FP8": ["engines.quantization=fp8"],
    "delta": ["sync.delta=true"],
    "FP8 + delta": ["engines.quantization=fp8", "sync.delta=true"],
}


def demo(steps: int) -> list[str]:
    lines = [
        "| push | bytes per push | of a full push | elements changed | push seconds | step seconds |",
        "|---|---|---|---|---|---|",
    ]
    full = None
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in WAYS.items():
            run_dir = Path(tmp) / name.replace(" ", "")
            args = ["bash", str(REPO / "recipes/qwen_moe_grpo.sh"), f"run.dir={run_dir}", f"run.steps={steps}"]
            out = subprocess.run(
                [*args, "run.progress=false", *overrides],
                env={**os.environ, "PYTHON": sys.executable},
                capture_output=True,
                text=True,
            )
            if out.returncode:
                raise SystemExit(f"{name} failed:\n{out.stderr[-4000:]}")
            rows = measured_steps(run_dir)
            pushed = statistics.mean(r["sync/bytes"] for r in rows)
            full = pushed if full is None else full
            changed = (
                f"{statistics.mean(r['sync/changed_fraction'] for r in rows):.1%}"
                if "sync/changed_fraction" in rows[0]
                else "all sent"
            )
            lines.append(
                f"| {name} | {pushed / 1024:,.0f} KiB | {pushed / full:.0%} | {changed} | "
                f"{statistics.mean(r['sync/seconds'] for r in rows):.3f} | "
                f"{statistics.mean(r['time/step_seconds'] for r in rows):.2f} |"
            )
    return lines


def on_paper(lrs: list[float]) -> list[str]:
    """Each tensor kind of Qwen3-30B-A3B (a few experts of one layer stand for all of them), one step, counted."""
    family = family_for(QWEN3_30B_A3B)
    shapes = family.hub_shapes(family.normalize(QWEN3_30B_A3B))
    expert = ".mlp.experts."
    kinds: dict[str, list[str]] = {}  # a sampled tensor per kind, and every tensor of that kind
    for name in shapes:
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        key = name if layer is None else name.replace(f"layers.{layer}.", "layers.N.")
        if expert in key:
            key = key.split(expert)[0] + expert + "E." + key.split(expert)[1].split(".", 1)[1]
        kinds.setdefault(key, []).append(name)
    full_bf16, fp8_bytes = family.hub_numel(family.normalize(QWEN3_30B_A3B)) * 2, fp8.hub_bytes(shapes, 2)
    lines = [
        f"Qwen3-30B-A3B: a full push is {full_bf16 / 1e9:.1f} GB in bf16, {fp8_bytes / 1e9:.1f} GB in FP8.",
        "",
        "| lr | bf16 elements changed | delta push | FP8 elements changed | FP8 delta push |",
        "|---|---|---|---|---|",
    ]
    g = torch.Generator().manual_seed(0)
    for lr in lrs:
        totals = {"bf16": [0, 0, 0], "fp8": [0, 0, 0]}  # changed, elements, bytes sent (scaled to the model)
        for names in kinds.values():
            shape = shapes[names[0]]
            before = torch.randn(shape, generator=g) * 0.02
            after = before + lr * torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
            scale = len(names)
            for way, pairs in (
                ("bf16", [(names[0], before.bfloat16(), after.bfloat16())]),
                (
                    "fp8",
                    [
                        (n, b, a)
                        for (n, b), (_, a) in zip(
                            fp8.quantize_named([(names[0], before.bfloat16())]),
                            fp8.quantize_named([(names[0], after.bfloat16())]),
                            strict=True,
                        )
                    ],
                ),
            ):
                for name, b, a in pairs:
                    encoding = encode(name, b, a)
                    totals[way][0] += encoding.changed * scale
                    totals[way][1] += encoding.numel * scale
                    totals[way][2] += encoding.sent_bytes * scale
            del before, after
        lines.append(
            f"| {lr:g} | {totals['bf16'][0] / totals['bf16'][1]:.2%} | {totals['bf16'][2] / 1e9:.2f} GB "
            f"({totals['bf16'][2] / full_bf16:.1%}) | {totals['fp8'][0] / totals['fp8'][1]:.3%} | "
            f"{totals['fp8'][2] / 1e9:.2f} GB ({totals['fp8'][2] / full_bf16:.1%}) |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    today = datetime.date.today().isoformat()
    lines = [
        f"## Weight pushes: full, FP8, delta ({today}, {platform.machine()}, {torch.get_num_threads()} threads, "
        "no GPU)",
        "",
        f"The CPU demo, {args.steps} steps each (the first not counted), async mode, lr 2e-3, fp32 trainer and "
        "engines:",
        "",
        *demo(args.steps),
        "",
        *on_paper([1e-6, 1e-5]),
    ]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
