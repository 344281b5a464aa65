r"""``moerl ablate``: one job config run under a grid of overrides, one run after another with the same seeds and data,
then a comparison table (markdown) and the runs' curves on the same axes (:func:`moerl.orchestrator.metrics.plot`).

    moerl ablate --out runs/replay --grid trainer.replay.routing=off,R2,R3 \
        --grid trainer.replay.sampling_mask=true,false -- run.steps=10

Every combination of the grid's values is a run of the main job (``recipes/qwen_moe_grpo.sh``) in ``OUT/<name>``, the
name made of the varied keys' last parts and values (``routing-R3+sampling_mask-false``); the overrides after ``--``
are every run's. Every combination's config is checked before the first run starts.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from moerl.env import child_env
from moerl.orchestrator.metrics import plot, read_metrics

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "qwen_moe_grpo.sh"
TABLE_KEYS = (
    "rollout/reward_mean",
    "mismatch/k3_kl",
    "mismatch/k3_kl_routing_agree",
    "mismatch/k3_kl_routing_differ",
    "routing/agreement",
    "routing/differs_any_layer",
    "train/grad_norm",
    "time/step_seconds",
)


class AblationError(ValueError):
    """A grid or a run that cannot go ahead; the message says what to change."""


def combinations(axes: list[str]) -> list[list[str]]:
    """``["a.b=1,2", "c=x,y"]`` -> every combination as overrides, the first axis slowest."""
    parsed = []
    for axis in axes:
        key, sep, values = axis.partition("=")
        options = [v for v in values.split(",") if v]
        if not sep or not key or not options:
            raise AblationError(f"--grid {axis!r}: give KEY=VALUE1,VALUE2,... (e.g. trainer.replay.routing=off,R3)")
        parsed.append([f"{key}={v}" for v in options])
    keys = [p[0].partition("=")[0] for p in parsed]
    if len(set(keys)) != len(keys):
        raise AblationError(f"--grid names a key twice: {keys}")
    return [list(combo) for combo in itertools.product(*parsed)]


def run_name(combo: list[str]) -> str:
    """A directory name: the keys' last parts and the values, a value's path separators made underscores."""
    return "+".join(
        f"{key.rsplit('.', 1)[-1]}-{value.replace('/', '_')}" for key, _, value in (o.partition("=") for o in combo)
    )


def table(runs: dict[str, Path], keys: tuple[str, ...], last: int) -> list[str]:
    """Per run, each metric's mean over its last ``last`` steps (NaN steps left out; "n/a" where there is none); a key
    ending in ``:std``, the metric's standard deviation over them instead (``train/grad_norm:std``: how much the
    gradient varies from step to step)."""
    lines = [f"| run | steps | {' | '.join(keys)} |", "|---|---|" + "---|" * len(keys)]
    for name, run_dir in runs.items():
        rows = read_metrics(run_dir)[-last:]
        cells = []
        for key in keys:
            metric, _, stat = key.partition(":")
            values = [r[metric] for r in rows if isinstance(r.get(metric), (int, float)) and not math.isnan(r[metric])]
            cells.append(f"{(np.std if stat == 'std' else np.mean)(values):.4g}" if values else "n/a")
        lines.append(f"| {name} | {rows[-1]['step'] if rows else 0} | {' | '.join(cells)} |")
    return lines


def ablate(out: Path, grid: list[str], shared: list[str], recipe: Path, last: int, keys: tuple[str, ...]) -> None:
    """Run the recipe under every combination of ``grid`` (each with the overrides ``shared``) into ``out``, after
    checking every combination's config; then ``report`` the runs that finished (those before a failed one too)."""
    if not recipe.is_file():
        raise AblationError(f"{recipe} does not exist: run from a moerl checkout, or give --recipe")
    if out.exists() and any(out.iterdir()):
        raise AblationError(f"{out} is not empty: give a new --out (an ablation's runs start from nothing)")
    if last < 1:
        raise AblationError("--last must be >= 1")
    if odd := [k for k in keys if k.partition(":")[2] not in ("", "std")]:
        raise AblationError(f"--keys {' '.join(odd)}: a key is a metric, or a metric and :std (its standard deviation)")
    if any(o.startswith("run.dir=") for o in shared + grid):
        raise AblationError("run.dir is set per run (OUT/<name>): leave it out of the overrides and the grid")
    runs = {run_name(combo): combo for combo in combinations(grid)}
    # The recipe runs $PYTHON: the same interpreter checks and runs every combination.
    python = os.environ.get("PYTHON", sys.executable)
    env = child_env(PYTHON=python)
    config = [] if "--config" in shared else ["--config", str(recipe.with_suffix(".yaml"))]  # as the recipe does
    for name, combo in runs.items():  # every configuration checked before any run: a typo costs seconds, not runs
        check = subprocess.run(
            [python, "-m", "moerl.cli", "train", "--check", *config, f"run.dir={out / name}", *shared, *combo],
            env=env,
            capture_output=True,
            text=True,
        )
        if check.returncode:
            said = (check.stdout + check.stderr).strip().splitlines()
            raise AblationError(
                f"run {name}: {said[-1] if said else f'the config check failed (exit {check.returncode})'}"
            )
    out.mkdir(parents=True, exist_ok=True)
    done: dict[str, Path] = {}
    for number, (name, combo) in enumerate(runs.items(), 1):
        print(f"[{number}/{len(runs)}] {name}", flush=True)
        with open(out / f"{name}.log", "w") as log:
            ran = subprocess.run(
                ["bash", str(recipe), f"run.dir={out / name}", "run.progress=false", *shared, *combo],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if ran.returncode:
            report(done, grid, shared, last, keys, out)  # what did finish is not lost
            raise AblationError(f"run {name} failed (exit {ran.returncode}); its log: {out / f'{name}.log'}")
        done[name] = out / name
    report(done, grid, shared, last, keys, out)


def report(
    runs: dict[str, Path], grid: list[str], shared: list[str], last: int, keys: tuple[str, ...], out: Path
) -> None:
    """OUT/ablation.md and OUT/ablation.png of the runs that finished."""
    if not runs:
        return
    lines = [
        f"Ablation of {', '.join(grid)}; every run: {' '.join(shared) or 'the recipe defaults'}; "
        f"means over each run's last {last} steps",
        "",
        *table(runs, keys, last),
    ]
    (out / "ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(plot(list(runs.values()), out / "ablation.png"))
