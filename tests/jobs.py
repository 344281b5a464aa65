"""The main job as the end-to-end tests run it: started on the CPU demo's recipe, watched through its metrics rows,
its processes found and killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from moerl.env import child_env
from moerl.orchestrator.metrics import read_metrics
from tests import REPO

RECIPE = REPO / "recipes" / "qwen_moe_grpo.sh"

GROUPS = 4


def on_policy(row: dict) -> None:
    """A step of rollouts its engine sampled from the trainer's own policy, both in fp32: the trainer scores every token
    as the engine did and routes it alike, but where two experts tie to rounding: the engine's kernels and batches are
    not the trainer's (SGLang's batches change from run to run), and either of a tie may come out on top."""
    assert row["routing/max_logit_gap"] < 1e-4 and row["mismatch/k3_kl"] < 1e-6, row


def job_args(cache: Path, run_dir: Path, *overrides: str) -> list[str]:
    # sync.verify: after every update each engine must serve the trainer's policy (fp32: probe log-probs within 1e-4).
    return [
        "bash",
        str(RECIPE),
        f"run.dir={run_dir}",
        f"run.cache_dir={cache}",
        "run.progress=false",
        f"rollout.groups_per_step={GROUPS}",
        "sync.verify=true",
        *overrides,
    ]


def job(cache: Path, run_dir: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The job; where it fails, its stderr ends with the end of each of its processes' logs (run.dir/logs), which a
    failed assertion's tail of it shows: an engine or manager that died says why there."""
    out = subprocess.run(
        job_args(cache, run_dir, *overrides),
        env=child_env(PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    if out.returncode != 0:
        logs = sorted((run_dir / "logs").rglob("*.log")) if (run_dir / "logs").is_dir() else []
        out.stderr += "".join(f"\n--- the end of {log}:\n{log.read_text(errors='replace')[-600:]}" for log in logs)
    return out


def start_job(cache: Path, run_dir: Path, *overrides: str) -> subprocess.Popen:
    """The job in the background, in a session of its own, its stderr kept."""
    return subprocess.Popen(
        job_args(cache, run_dir, *overrides),
        env=child_env(PYTHON=sys.executable),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def rows_so_far(run_dir: Path) -> list[dict]:
    """The metrics rows a running job has written completely."""
    metrics = run_dir / "metrics.jsonl"
    return (
        [json.loads(line) for line in metrics.read_text().splitlines(keepends=True) if line.endswith("\n")]
        if metrics.exists()
        else []
    )


def wait_while_running(proc: subprocess.Popen, condition, what: str, timeout_s: float = 300) -> None:
    """Until ``condition()``, as long as the job runs (it must not end first)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended ({proc.returncode}) before {what}:\n" + proc.stderr.read()[-6000:])
        assert time.monotonic() < deadline, f"no sign of {what} in {timeout_s} s"
        time.sleep(0.1)


def engines_of(proc: subprocess.Popen) -> list[psutil.Process]:
    return [p for p in psutil.Process(proc.pid).children(recursive=True) if is_engine(p)]


def ended_well(proc: subprocess.Popen, run_dir: Path, steps: int) -> tuple[list[dict], str]:
    """The metrics rows and the stderr of the job started in the background, once it has ended well with all its
    ``steps`` steps."""
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    rows = rows_so_far(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    return rows, stderr


def the_error_after(proc: subprocess.Popen, run_dir: Path, steps: int, kill) -> str:
    """The one error line the job ends with once ``kill()`` has run after its first ``steps`` steps."""
    try:
        wait_while_running(proc, lambda: len(rows_so_far(run_dir)) >= steps, f"its step {steps}")
        kill()
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode != 0
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-4000:]
    return errors[0]


def is_engine(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE and "serve" in process.cmdline()
    except psutil.Error:  # gone, or a zombie not yet reaped
        return False


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the job and everything it started (engines run in sessions of their own)."""
    family = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    kill_tree_of(family)
    proc.wait()


def kill_tree_of(family: list[psutil.Process]) -> None:
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def start_until_checkpoint(cache: Path, run_dir: Path, overrides: list[str], step: int) -> subprocess.Popen:
    """The job, started in the background and running once its checkpoint of ``step`` is complete."""
    proc = start_job(cache, run_dir, *overrides)  # its stderr kept: it says why, if the job ends first
    try:
        wait_while_running(proc, (run_dir / "checkpoints" / f"step_{step}" / "run_state.json").exists, "its checkpoint")
    except BaseException:
        kill_tree(proc)
        raise
    return proc


def kill_after_the_first_step(proc: subprocess.Popen, run_dir: Path, model: str) -> list[dict]:
    """SIGKILL the engines serving the model whose directory names ``model`` once the job's first step is in, and the
    metrics rows of the job, ended well."""

    def serving() -> list[psutil.Process]:
        return [p for p in engines_of(proc) if model in " ".join(p.cmdline())]

    wait_while_running(proc, lambda: len(rows_so_far(run_dir)) >= 1 and bool(serving()), "the first step")
    for engine in serving():
        os.killpg(engine.pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    return read_metrics(run_dir)
