"""The benchmarks' one way of reporting: print the markdown, and append it to ``--out`` when given; and of reading
what a run of the main job measured."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_demo_job(work: Path, run_dir: Path, model: Path, steps: int, *overrides: str) -> tuple[list[dict], float]:
    """The main job (recipes/qwen_moe_grpo.sh) as the CPU benchmarks run it, with ``overrides``: the random tiny model
    ``model`` with four stop characters (it draws one every ~20 tokens, so lengths spread out to the 64-token cap),
    8 groups x 8 samples a step. Its :func:`measured_steps` and its wall seconds; exits with its stderr if it fails."""
    from moerl.models.tiny import tiny_tokenizer

    stops = ",".join(str(tiny_tokenizer().convert_tokens_to_ids(c)) for c in "eat ")
    args = [
        "bash",
        str(REPO / "recipes/qwen_moe_grpo.sh"),
        f"run.dir={run_dir}",
        f"run.steps={steps}",
        "run.progress=false",
        f"run.cache_dir={work / 'cache'}",
        f"model.path={model}",
        "rollout.max_new_tokens=64",
        f"rollout.stop_token_ids=[{stops}]",
        "rollout.groups_per_step=8",
        "rollout.samples_per_prompt=8",
        *overrides,
    ]
    start = time.perf_counter()
    out = subprocess.run(args, env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{run_dir.name} failed:\n{out.stderr[-4000:]}")
    return measured_steps(run_dir), time.perf_counter() - start


def measured_steps(run_dir: Path) -> list[dict]:
    """The metrics rows of a finished run, less its first step, which warms up."""
    from moerl.orchestrator.metrics import read_metrics

    return read_metrics(run_dir)[1:]


def mode_summary(rows: list[dict]) -> dict:
    """Samples/s and the trainer's idle fraction over the steps' own time, response lengths, the worst staleness and
    the prompts dropped, of ``rows`` (:func:`measured_steps`)."""
    seconds = sum(r["time/step_seconds"] for r in rows)
    return {
        "samples_per_s": sum(r["rollout/samples"] for r in rows) / seconds,
        "idle": sum(r["time/trainer_idle_fraction"] * r["time/step_seconds"] for r in rows) / seconds,
        "len_mean": statistics.mean(r["rollout/response_len_mean"] for r in rows),
        "len_max": max(r["rollout/response_len_max"] for r in rows),
        "staleness_max": max(r["staleness/max"] for r in rows),
        "dropped": rows[-1]["prompts/dropped"],
    }


def publish(lines: list[str], out: str | None) -> None:
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text)
