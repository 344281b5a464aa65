"""What a run writes for its user: ``metrics.jsonl`` (one JSON object per step), TensorBoard event
files, and ``moerl plot RUN_DIR [RUN_DIR ...]`` (PNG curves of the metrics; several runs on the same axes)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moerl.orchestrator.rollouts import RolloutBuffer

KEY_CURVES = (
    "rollout/reward_mean",
    "rollout/response_len_mean",
    "episode/turns_mean",
    "episode/env_token_fraction",
    "train/loss",
    "routing/agreement",
    "mismatch/k3_kl",
    "mismatch/k3_kl_routing_differ",
    "routing/differs_any_layer",
    "staleness/max",
    "sync/seconds",
    "time/step_seconds",
    "time/trainer_idle_fraction",
    "prompts/trained",
    "prompts/dropped",
    "train/grad_norm",
)


class MetricsWriter:
    def __init__(self, run_dir: str | Path, resume_after: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_after is not None and self.path.exists():
            # A resumed run rewrites the steps after its checkpoint: keep the file one line per step.
            kept = [
                line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= resume_after
            ]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.file = open(self.path, "a")
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(
            str(Path(run_dir) / "tensorboard"), purge_step=None if resume_after is None else resume_after + 1
        )

    def write(self, metrics: dict) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and key != "step":
                self.tb.add_scalar(key, value, metrics["step"])
        self.tb.flush()

    def close(self) -> None:
        self.file.close()
        self.tb.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a moerl run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(run_dirs: str | Path | list, out: str | Path | None = None, keys: tuple[str, ...] = KEY_CURVES) -> Path:
    """A grid of the key curves against step, as one PNG: of one run (default ``RUN_DIR/curves.png``), or of several
    on the same axes, legend by run directory name (default ``compare.png`` beside the first run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dirs = [Path(d) for d in ([run_dirs] if isinstance(run_dirs, (str, Path)) else run_dirs)]
    if len({d.name for d in dirs}) != len(dirs):
        raise ValueError(f"runs to compare need distinct directory names (the legend): {[str(d) for d in dirs]}")
    runs = {d.name: read_metrics(d) for d in dirs}
    for d in dirs:
        if not runs[d.name]:
            raise ValueError(f"{d}/metrics.jsonl has no steps to plot")
    plotted = [k for k in keys if any(k in r for rows in runs.values() for r in rows)]
    if not plotted:
        raise ValueError(f"none of {len(dirs)} run(s) has any of the metrics asked for")
    cols = 3
    fig, axes = plt.subplots(
        math.ceil(len(plotted) / cols), cols, figsize=(4.2 * cols, 2.8 * math.ceil(len(plotted) / cols)), squeeze=False
    )
    # the grid's last row may have axes to spare: they are turned off below
    for ax, key in zip(axes.flat, plotted, strict=False):
        for name, rows in runs.items():
            points = [(r["step"], r[key]) for r in rows if key in r]
            ax.plot(
                [p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 50 else None, label=name
            )
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(plotted) :]:
        ax.axis("off")
    if len(runs) == 1:
        ((name, rows),) = runs.items()
        fig.suptitle(f"{name} ({rows[-1].get('mode', '')}, {len(rows)} steps)")
    else:
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper center", ncol=min(len(runs), 4), fontsize=8)
        fig.suptitle(" ", fontsize=22)  # room for the legend
    fig.tight_layout()
    out = Path(out) if out else dirs[0] / "curves.png" if len(dirs) == 1 else dirs[0].parent / "compare.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


class CpuMeter:
    """The orchestrator's own CPU cost per step, never scaled in a simulation: the rollout manager process's (the engine
    client, rewards, and the completions its generation workers hand it), its helper processes' (the generation
    workers: engine requests and decoding), and rank 0's rollout buffer's (taking in the finished groups). The manager's
    own is the figure that must stay well below the step: it is one process. Beside them, how busy rank 0's machine
    was: a simulation runs its engines and trainer on the wall clock of that machine, and keeps pace only while its
    CPUs have time to spare."""

    def __init__(self, manager_pid: int, rollouts: RolloutBuffer):
        import psutil

        self.manager, self.rollouts = psutil.Process(manager_pid), rollouts
        self.helpers: dict[int, float] = {}  # each helper's CPU when last seen: one that ended keeps its last reading
        self.manager_s = self.helpers_s = self.rollouts_s = 0.0
        self.machine = (0.0, 0.0)  # (busy, all) CPU seconds at the step's start

    @staticmethod
    def _machine_times() -> tuple[float, float]:
        """(busy, all) CPU seconds of this machine, every core, since boot. Linux counts guest time inside user time,
        and iowait as idle (a core waiting on a disk could run something else)."""
        import psutil

        t = psutil.cpu_times()
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        return total - t.idle - getattr(t, "iowait", 0.0), total

    def _manager_total(self) -> float:
        import psutil

        try:
            t = self.manager.cpu_times()
        except psutil.Error:  # it stopped: its time so far is all there is
            return self.manager_s
        return t.user + t.system

    def _helpers_total(self) -> float:
        import psutil

        try:
            helpers = self.manager.children(recursive=True)
        except psutil.Error:
            helpers = []
        for p in helpers:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            self.helpers[p.pid] = t.user + t.system
        return sum(self.helpers.values())

    def start_step(self) -> None:
        self.manager_s, self.helpers_s, self.rollouts_s = (
            self._manager_total(),
            self._helpers_total(),
            self.rollouts.cpu_s,
        )
        self.machine = self._machine_times()

    def step_metrics(self, wall_s: float) -> dict[str, float]:
        manager = self._manager_total() - self.manager_s
        busy, total = (now - then for now, then in zip(self._machine_times(), self.machine, strict=True))
        return {
            "cpu/manager_seconds": manager,
            "cpu/manager_fraction": manager / wall_s,
            "cpu/manager_helpers_seconds": self._helpers_total() - self.helpers_s,
            "cpu/buffer_seconds": self.rollouts.cpu_s - self.rollouts_s,
            "cpu/machine_busy_fraction": busy / total if total > 0 else 0.0,
        }
