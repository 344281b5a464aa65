#!/usr/bin/env python3
"""Engines killed under a running job: the main job (async, the CPU demo's tiny model, one trainer rank, two
embedded engine replicas) while a killer SIGKILLs a random replica at a random moment, again and again, each time
once the job has restarted the last one and it is back in rotation. Then the same job without kills, for the
throughput ratio.

Reported: kills, steps completed, prompts lost (issued, neither trained nor dropped with a reason: target 0),
prompts dropped as engine_failure, re-issues, whether the accounting balances, and samples per second against the
run without kills. The killed run is stopped (SIGTERM, a clean teardown) once the kills are done and it has trained
a few more steps.

    python bench/engine_kills.py --kills 100 [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from report import publish  # noqa: E402

RECIPE = REPO / "recipes" / "qwen_moe_grpo.sh"
JOB = ["run.mode=async", "run.progress=false", "trainer.ep=1", "engines.replicas=2", "engines.health_interval_s=0.2",
       "engines.health_failures=2", "engines.max_restarts=100000", "rollout.groups_per_step=4", "sync.verify=false"]


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


def start(run_dir: Path, cache: Path, steps: int) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(RECIPE), f"run.dir={run_dir}", f"run.cache_dir={cache}", f"run.steps={steps}", *JOB],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(run_dir.with_suffix(".log"), "w"),
                            start_new_session=True, env={**os.environ, "PYTHON": sys.executable})


def killed_run(run_dir: Path, cache: Path, kills: int, after: int, seed: int) -> dict:
    rng = random.Random(seed)
    run_dir.mkdir(parents=True)
    job = start(run_dir, cache, steps=1_000_000)
    done, started = 0, time.monotonic()
    try:
        while done < kills:
            # The job has restarted every replica killed so far, and both are in rotation again.
            while not ((last := rows(run_dir)) and last[-1]["engines/restarts"] >= done and last[-1]["engines/healthy"] == 2):
                if job.poll() is not None:
                    raise RuntimeError(f"the job ended (exit {job.returncode}); see {run_dir.with_suffix('.log')}")
                time.sleep(0.1)
            time.sleep(rng.uniform(0, 2))
            live = engines(job)
            if len(live) < 2:
                continue
            os.killpg(rng.choice(live).pid, signal.SIGKILL)
            done += 1
            print(f"kill {done}/{kills} after step {len(rows(run_dir))}", flush=True)
        target = len(rows(run_dir)) + after
        while len(rows(run_dir)) < target:
            time.sleep(0.2)
    finally:
        os.killpg(job.pid, signal.SIGTERM)  # torchrun stops the rank, which tears down: accounting written
        job.wait(timeout=300)
    return summary(run_dir, time.monotonic() - started, done)


def baseline_run(run_dir: Path, cache: Path, steps: int) -> dict:
    run_dir.mkdir(parents=True)
    started = time.monotonic()
    job = start(run_dir, cache, steps)
    if job.wait() != 0:
        raise RuntimeError(f"the baseline run failed; see {run_dir.with_suffix('.log')}")
    return summary(run_dir, time.monotonic() - started, 0)


def summary(run_dir: Path, seconds: float, kills: int) -> dict:
    done = rows(run_dir)
    acct = json.loads((run_dir / "accounting.json").read_text())
    samples = sum(r["rollout/samples"] for r in done)
    step_seconds = sum(r["time/step_seconds"] for r in done)
    lost = acct["issued"] - acct["trained"] - sum(acct["dropped"].values()) - acct["live"]
    return {"kills": kills, "steps": len(done), "seconds": seconds, "samples_per_s": samples / step_seconds, "lost": lost,
            "engine_failure": acct["dropped"].get("engine_failure", 0), "dropped": acct["dropped"], "balanced": acct["balanced"],
            "reissues": sum(r["rollout/retries_engine_failure"] for r in done), "restarts": done[-1]["engines/restarts"] if done else 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--after", type=int, default=5, help="steps trained after the last kill before the run is stopped")
    p.add_argument("--baseline-steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="where the runs go (default: a temporary directory)")
    p.add_argument("--out", help="append the table to this markdown file")
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="moerl-kills-"))
    cache = work / "cache"
    base = baseline_run(work / "baseline", cache, args.baseline_steps)
    killed = killed_run(work / "killed", cache, args.kills, args.after, args.seed)
    lines = [f"### Engines killed under the main job (x86_64, 2 cores, no GPU; async, tiny demo model, 1 trainer rank, 2 embedded "
             f"replicas; a replica SIGKILLed {killed['kills']} times, each after the last one was back)", "",
             "| run | kills | engine restarts | steps | prompts lost | dropped engine_failure | re-issues | accounting balanced | "
             "samples/s (training time) | vs no kills |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in (("no kills", base), ("kills", killed)):
        lines.append(f"| {name} | {r['kills']} | {r['restarts']:.0f} | {r['steps']} | {r['lost']} | {r['engine_failure']} | {r['reissues']:.0f} | "
                     f"{r['balanced']} | {r['samples_per_s']:.1f} | {r['samples_per_s'] / base['samples_per_s']:.2f}x |")
    lines += ["", f"Dropped, by reason (killed run): {killed['dropped']}. Wall time of the killed run: {killed['seconds']:.0f} s.", ""]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
