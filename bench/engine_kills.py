#!/usr/bin/env python3
r"""Engines killed under a running job: the main job in async mode while a killer SIGKILLs a random engine process
at a random moment, again and again, each time once the job has restarted the last one. Then (unless
``--baseline-steps 0``) the same job without kills, for the throughput ratio.

Two shapes:
- the CPU demo (default): the tiny model, one trainer rank, two embedded replicas; each kill waits until the last
  killed replica is back in rotation (in a metrics row), so one replica is down at a time;
- ``--profile PROFILE --pool T:E``: the job at production shape against simulated engines and a simulated trainer
  (as ``bench/simulation.py`` runs it), one process per replica as on GPUs. A replica rejoins rotation only at the
  next weight sync (one a step; a catch-up sync only once none serves), so each kill waits until the job has started
  every killed replica again (all processes answering) and fewer than ``--max-down`` replicas hold no policy
  (restarted, not yet synced): up to that many may be out of rotation at once.

Reported: kills, steps completed, prompts lost (issued, neither trained nor dropped with a reason: target 0),
prompts dropped as engine_failure, re-issues, whether the accounting balances, and samples per second against the
run without kills. The killed run is stopped (SIGTERM, a clean teardown) once the kills are done and it has trained
a few more steps.

    python bench/engine_kills.py --kills 100 [--out docs/benchmarks/fault-tolerance.md]
    python bench/engine_kills.py --kills 100 --profile bench/profiles/qwen3_30b_a3b_h100.yaml --pool 8:24 \
        --baseline-steps 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

import simulation  # noqa: E402
from moerl.engines.client import EngineClient, EngineError  # noqa: E402
from moerl.engines.health import names_a_policy  # noqa: E402
from report import publish  # noqa: E402

RECIPE = REPO / "recipes" / "qwen_moe_grpo.sh"
# Every replica may be restarted without end, and a dead one is found within half a second.
FAULTS = [
    "run.mode=async",
    "run.progress=false",
    "engines.health_interval_s=0.2",
    "engines.health_failures=2",
    "engines.max_restarts=100000",
]
DEMO = ["trainer.ep=1", "engines.replicas=2", "rollout.groups_per_step=4", "sync.verify=false"]


@dataclass
class Shape:
    title: str  # what the table's heading says of the job
    overrides: Callable[[Path, int], list[str]]  # (run dir, steps) -> the job's config
    replicas: int
    time_scale: float  # simulated seconds per real second (1: a real run)
    in_rotation: bool  # each kill waits for the last killed replica back in rotation, else only started again


def demo_shape(cache: Path) -> Shape:
    return Shape(
        "x86_64, 2 cores, no GPU; async, tiny demo model, 1 trainer rank, 2 embedded replicas",
        lambda run_dir, steps: [f"run.dir={run_dir}", f"run.cache_dir={cache}", f"run.steps={steps}", *DEMO, *FAULTS],
        replicas=2,
        time_scale=1.0,
        in_rotation=True,
    )


def simulated_shape(args, root: Path) -> Shape:
    from moerl.simulation import Profile

    profile = Profile.load(args.profile)
    pool = tuple(int(x) for x in args.pool.split(":"))
    model = simulation.model_dir(Path(args.profile), Path(args.config), root)
    job = argparse.Namespace(**vars(args), replicas_per_process=1, extra=[])  # one replica a process: a kill takes one

    def overrides(run_dir: Path, steps: int) -> list[str]:
        job.steps = steps
        return [*simulation.job_overrides(run_dir, "async", pool, job, model, profile), *FAULTS]

    replicas = pool[1] // profile.engine.gpus
    return Shape(
        f"simulated, {profile.name}, {pool[0]}:{pool[1]} GPUs ({replicas} replicas, one process each), async, max "
        f"staleness {args.max_staleness}, {args.groups} x {args.samples} samples per step, max {args.max_new_tokens} "
        f"new tokens, time x{args.time_scale:g}; x86_64, 2 cores",
        overrides,
        replicas,
        args.time_scale,
        in_rotation=False,
    )


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def engines(job: subprocess.Popen) -> list[psutil.Process]:
    found = []
    for p in psutil.Process(job.pid).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "serve" in p.cmdline():
                found.append(p)
        except psutil.Error:
            pass
    return found


def urls(engine: psutil.Process) -> list[str]:
    """The replicas an engine process serves (``--port`` or ``--ports``)."""
    try:
        args = engine.cmdline()
    except psutil.Error:
        return []
    flag = "--ports" if "--ports" in args else "--port"
    if flag not in args:  # forked, not yet the server: it serves nothing yet
        return []
    return [f"http://127.0.0.1:{port}" for port in args[args.index(flag) + 1].split(",")]


def memory_gb(job: subprocess.Popen) -> float:
    """The resident memory of the job's whole process family."""
    total = 0
    for p in [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 1e9


def start(shape: Shape, run_dir: Path, steps: int) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", str(RECIPE), *shape.overrides(run_dir, steps)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=open(run_dir.with_suffix(".log"), "w"),
        start_new_session=True,
        env={**os.environ, "PYTHON": sys.executable},
    )


def weight_versions(served: list[str]) -> list[str] | None:
    """What each replica reports holding (None: one does not answer)."""

    async def ask():
        async with EngineClient(served, retries=0) as client:
            return await client.weight_versions()

    try:
        return asyncio.run(ask())
    except EngineError:
        return None


def ready_for_a_kill(shape: Shape, run_dir: Path, job: subprocess.Popen, kills: int, max_down: int) -> bool:
    """Whether the job has brought back every replica killed so far (``kills``), as the shape counts it."""
    if shape.in_rotation:
        return (
            bool(last := rows(run_dir))
            and last[-1]["engines/restarts"] >= kills
            and last[-1]["engines/healthy"] == shape.replicas
        )
    # Every process up and answering, and fewer than max_down replicas without a policy a sync left (a restarted one
    # holds the base weights, version "default", until the next sync or a catch-up reaches it).
    served = [url for engine in engines(job) for url in urls(engine)]
    versions = weight_versions(served) if len(served) == shape.replicas else None
    return versions is not None and sum(not names_a_policy(v) for v in versions) < max_down


def killed_run(shape: Shape, run_dir: Path, kills: int, after: int, seed: int, max_down: int) -> dict:
    rng = random.Random(seed)
    run_dir.mkdir(parents=True)
    job = start(shape, run_dir, steps=1_000_000)
    done, started, peak = 0, time.monotonic(), 0.0
    try:
        while done < kills:
            while not ready_for_a_kill(shape, run_dir, job, done, max_down):
                if job.poll() is not None:
                    raise RuntimeError(f"the job ended (exit {job.returncode}); see {run_dir.with_suffix('.log')}")
                time.sleep(0.2)
            time.sleep(rng.uniform(0, 2))
            live = engines(job)
            if len(live) < shape.replicas:
                continue
            peak = max(peak, memory_gb(job))
            os.killpg(rng.choice(live).pid, signal.SIGKILL)
            done += 1
            print(f"kill {done}/{kills} after step {len(rows(run_dir))}", flush=True)
        target = len(rows(run_dir)) + after
        while len(rows(run_dir)) < target:
            if job.poll() is not None:
                raise RuntimeError(f"the job ended (exit {job.returncode}); see {run_dir.with_suffix('.log')}")
            time.sleep(0.2)
    finally:
        os.killpg(job.pid, signal.SIGTERM)  # torchrun stops the rank, which tears down: accounting written
        job.wait(timeout=300)
    return summary(shape, run_dir, time.monotonic() - started, done) | {"peak_gb": peak}


def baseline_run(shape: Shape, run_dir: Path, steps: int) -> dict:
    run_dir.mkdir(parents=True)
    started = time.monotonic()
    job = start(shape, run_dir, steps)
    if job.wait() != 0:
        raise RuntimeError(f"the baseline run failed; see {run_dir.with_suffix('.log')}")
    return summary(shape, run_dir, time.monotonic() - started, 0)


def summary(shape: Shape, run_dir: Path, seconds: float, kills: int) -> dict:
    done = rows(run_dir)
    acct = json.loads((run_dir / "accounting.json").read_text())
    samples = sum(r["rollout/samples"] for r in done)
    step_seconds = sum(r["time/step_seconds"] for r in done) * shape.time_scale
    lost = acct["issued"] - acct["trained"] - sum(acct["dropped"].values()) - acct["live"]
    return {
        "kills": kills,
        "steps": len(done),
        "seconds": seconds,
        "samples_per_s": samples / step_seconds,
        "lost": lost,
        "engine_failure": acct["dropped"].get("engine_failure", 0),
        "dropped": acct["dropped"],
        "balanced": acct["balanced"],
        "reissues": sum(r["rollout/retries_engine_failure"] for r in done),
        "restarts": done[-1]["engines/restarts"] if done else 0,
        "staleness_max": max((r["staleness/max"] for r in done), default=0),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--after", type=int, default=5, help="steps trained after the last kill before the run is stopped")
    p.add_argument("--baseline-steps", type=int, default=100, help="steps of the run without kills (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="where the runs go (default: a temporary directory)")
    p.add_argument("--out", help="append the table to this markdown file")
    sim = p.add_argument_group(
        "the job at production shape, simulated (as bench/simulation.py runs it; without --profile: "
        "the CPU demo, for real)"
    )
    simulation.add_shape_arguments(sim, profile=None, groups=24, max_staleness=2)
    sim.add_argument("--pool", default="8:24", help="trainer GPUs:engine GPUs")
    sim.add_argument(
        "--max-down", type=int, default=3, help="a kill waits until fewer replicas than this hold no policy"
    )
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="moerl-kills-"))
    work.mkdir(parents=True, exist_ok=True)
    shape = simulated_shape(args, work) if args.profile else demo_shape(work / "cache")
    base = baseline_run(shape, work / "baseline", args.baseline_steps) if args.baseline_steps else None
    killed = killed_run(shape, work / "killed", args.kills, args.after, args.seed, args.max_down)
    wait = (
        "it is back in rotation"
        if shape.in_rotation
        else f"the job has started every killed replica again and fewer than {args.max_down} hold no policy "
        "(restarted, not yet synced)"
    )
    lines = [
        f"## Engines killed under the main job ({shape.title}; a replica SIGKILLed {killed['kills']} times, each 0-2 s "
        f"after {wait})",
        "",
        "| run | kills | engine restarts | steps | prompts lost | dropped engine_failure | re-issues | accounting "
        "balanced | max staleness | samples/s (training time) | vs no kills |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in (("no kills", base), ("kills", killed)):
        if r is not None:
            versus = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "n/a"
            lines.append(
                f"| {name} | {r['kills']} | {r['restarts']:.0f} | {r['steps']} | {r['lost']} | {r['engine_failure']} | "
                f"{r['reissues']:.0f} | {r['balanced']} | {r['staleness_max']:.0f} | {r['samples_per_s']:.3g} | "
                f"{versus} |"
            )
    lines += [
        "",
        f"Dropped, by reason (killed run): {killed['dropped']}. Wall time of the killed run: {killed['seconds']:.0f} "
        f"s; the job's processes held at most {killed['peak_gb']:.1f} GB.",
        "",
    ]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
