"""The benchmarks' one way of reporting: print the markdown, and append it to ``--out`` when given; and of reading
what a run of the main job measured."""

from __future__ import annotations

import statistics
from pathlib import Path


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
