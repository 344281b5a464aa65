#!/usr/bin/env python3
r"""The simulator against the real job, at the CPU demo's shape: do simulated and real sync/periodic/async agree?

1. The real job (recipes/qwen_moe_grpo.sh: 2 trainer ranks at EP2, one embedded engine, a random tiny Qwen3-MoE whose
   responses end at four stop characters, capped at 64 tokens) runs in each mode.
2. A profile of this machine is measured: the embedded engine's decode tokens/s by running requests and its prefill
   rate (requests of fixed length, the job's sampling and routing flags); from the real sync run, the response lengths
   (their mean, and the fraction that reaches the cap), the trainer's seconds per fed token and per step (fitted to
   its steps), and the weight update's bytes/s. It is written as a profile file.
3. The same job with ``simulation.profile`` set to it runs in each mode: simulated engine and trainer, the rest the
   job's own code, time not scaled.
Reported: each mode's samples/s and its ratio to sync, real and simulated, and how far the simulated ratio is from the
real one.

The simulator stands for separate pools: its engines and trainer take time without taking CPU. On this 2-core machine
the real engine and trainer would share the cores, so both runs pin them apart: every engine process to the first CPU,
everything else (trainer ranks, rollout manager, this script) to the second. The real job's figures are then those of
a one-CPU engine pool beside a one-CPU trainer pool, the shape the simulator models.

    python bench/simulator_vs_job.py [--steps 8] [--profile-out bench/profiles/cpu_demo.yaml] \
        [--out docs/benchmarks/simulator-vs-job.md]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path
from statistics import NormalDist

import numpy as np
import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from moerl.simulation import Z99  # noqa: E402
from report import measured_steps, mode_summary, publish  # noqa: E402

RECIPE = REPO / "recipes" / "qwen_moe_grpo.sh"
MODES = ("sync", "periodic", "async")
ENGINE_CPUS, JOB_CPUS = {0}, {1}
MAX_NEW_TOKENS, GROUPS, SAMPLES = 64, 8, 8
CONCURRENCY = (
    1,
    8,
    16,
    32,
    64,
)  # running requests the engine's decode rate is measured at (64: its max_running_requests)


class EnginePinning:
    """Keeps every engine process under this one (``moerl ... serve``), each of its threads, on ENGINE_CPUS."""

    def __init__(self):
        self._stop = threading.Event()
        self._pinned: set[int] = set()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> EnginePinning:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            for proc in psutil.Process().children(recursive=True):
                try:
                    if "serve" not in proc.cmdline():
                        continue
                    for thread in proc.threads():
                        if thread.id not in self._pinned:
                            os.sched_setaffinity(thread.id, ENGINE_CPUS)
                            self._pinned.add(thread.id)
                except (psutil.Error, OSError):  # it ended meanwhile
                    pass


def stop_ids() -> list[int]:
    from moerl.models.tiny import tiny_tokenizer

    # Four stop characters: the random model draws one now and then, so lengths spread out to the cap.
    return [tiny_tokenizer().convert_tokens_to_ids(c) for c in "eat "]


def run_job(run_dir: Path, mode: str, steps: int, model: Path, extra: list[str]) -> list[dict]:
    args = [
        "bash",
        str(RECIPE),
        f"run.dir={run_dir}",
        f"run.mode={mode}",
        f"run.steps={steps}",
        "run.progress=false",
        f"run.cache_dir={run_dir.parent / 'cache'}",
        f"model.path={model}",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
        f"rollout.stop_token_ids=[{','.join(map(str, stop_ids()))}]",
        f"rollout.groups_per_step={GROUPS}",
        f"rollout.samples_per_prompt={SAMPLES}",
        *extra,
    ]
    with EnginePinning():
        done = subprocess.run(args, env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{mode} ({' '.join(extra) or 'real'}) failed:\n{done.stderr[-4000:]}")
    rows = measured_steps(run_dir)
    print(run_dir.name, mode_summary(rows), file=sys.stderr, flush=True)
    return rows


def prompts(model: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from moerl.orchestrator.config import load_config
    from moerl.tasks import PromptStream

    cfg = load_config(REPO / "recipes" / "qwen_moe_grpo.yaml", [])
    stream = PromptStream(cfg.task, AutoTokenizer.from_pretrained(model))
    return [stream.get(i)[1] for i in range(count)]


async def measure_engine(url: str, model: Path, prompt_ids: list[list[int]]) -> dict:
    """Decode tokens/s by running requests and prefill tokens/s of the engine at ``url`` (each from a request set of
    fixed length 1 and MAX_NEW_TOKENS, so the fixed costs cancel)."""
    from moerl.checkpoint.hf import read_config
    from moerl.engines.client import EngineClient, Returns
    from moerl.engines.protocol import SamplingParams
    from moerl.models import model_shape
    from moerl.orchestrator.config import RolloutSection

    r = RolloutSection()
    async with EngineClient([url], shape=model_shape(read_config(model))) as client:

        async def batch(count: int, tokens: int, **params) -> float:
            start = time.perf_counter()
            await asyncio.gather(
                *(
                    client.generate(
                        prompt_ids[i % len(prompt_ids)],
                        SamplingParams(
                            temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, max_new_tokens=tokens, **params
                        ),
                        Returns(routing_from=0, sampling_mask=True),
                    )
                    for i in range(count)
                )
            )
            return time.perf_counter() - start

        await batch(8, MAX_NEW_TOKENS, ignore_eos=True)  # warm-up
        decode, prefill = {}, 0.0
        for count in CONCURRENCY:
            short, long = [
                min([await batch(count, tokens, ignore_eos=True) for _ in range(3)]) for tokens in (1, MAX_NEW_TOKENS)
            ]
            decode[count] = round(count * (MAX_NEW_TOKENS - 1) / (long - short), 1)
            # the last, largest set: the fixed costs matter least
            prefill = count * statistics.mean(map(len, prompt_ids)) / short
    return {"decode": decode, "prefill": round(prefill, 1)}


def length_profile(rows: list[dict]) -> dict:
    """The profile's log-normal (median, p99; capped at max_new_tokens, as the real lengths are) with the run's mean
    response length and the same fraction at the cap."""
    mean = float(np.mean([r["rollout/response_len_mean"] for r in rows]))
    capped = float(np.mean([r["rollout/truncated_fraction"] for r in rows]))
    if capped == 0:
        raise SystemExit("no response reached the cap: its fraction there cannot fix the lengths' spread")
    if capped == 1:
        return {"median": float(MAX_NEW_TOKENS), "p99": float(MAX_NEW_TOKENS)}
    normal, cap = NormalDist(), math.log(MAX_NEW_TOKENS)
    z = normal.inv_cdf(1 - capped)

    def capped_mean(sigma: float) -> float:  # E[min(X, cap)] of the log-normal with P(X >= cap) = capped
        mu = cap - sigma * z
        return math.exp(mu + sigma**2 / 2) * normal.cdf((cap - mu - sigma**2) / sigma) + MAX_NEW_TOKENS * capped

    low, high = 1e-3, 10.0  # capped_mean falls as sigma grows: the mass below the cap spreads down
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if capped_mean(mid) > mean else (low, mid)
    mu = cap - low * z
    return {"median": round(math.exp(mu), 1), "p99": round(math.exp(mu + low * Z99), 1)}


def trainer_profile(rows: list[dict], prompt_tokens: float) -> dict:
    """Seconds per fed token and per step, least squares over the sync run's steps (the trainer's busy time: the step
    less its wait for groups and its sync)."""
    fed = np.array([r["train/tokens"] + r["rollout/samples"] * (prompt_tokens - 1) for r in rows])
    busy = np.array([r["time/train_seconds"] - r["time/trainer_idle_fraction"] * r["time/step_seconds"] for r in rows])
    per_token, per_step = np.polyfit(fed, busy, 1)
    if per_step < 0 or per_token <= 0:  # too few or too alike steps to tell the two apart
        per_token, per_step = busy.sum() / fed.sum(), 0.0
    return {"tokens_per_s_per_gpu": round(float(1 / per_token), 1), "optimizer_step_s": round(float(per_step), 3)}


def write_profile(path: Path, engine: dict, lengths: dict, trainer: dict, update: float, rows: int) -> None:
    today = date.today().isoformat()
    where = f"{platform.machine()}, {os.cpu_count()} cores, {today}"
    profile = {
        "name": "cpu-demo",
        "dtype": "float32",
        "sources": [
            f"engine: measured by bench/simulator_vs_job.py ({where}): one embedded engine on one CPU serving the "
            f"random tiny Qwen3-MoE, requests of 1 and {MAX_NEW_TOKENS} tokens with the job's sampling and routing "
            "flags, best of 3",
            f"trainer: 2 ranks at EP2 on one CPU, fitted to the {rows} measured steps of the real sync run (busy "
            "seconds against fed tokens); weight update: that run's full-weight bytes over its sync seconds; response "
            f"lengths: that run's mean and its fraction reaching the cap of {MAX_NEW_TOKENS} tokens",
        ],
        "engine": {
            "gpus": 1,
            "max_running_requests": max(CONCURRENCY),
            "prefill_tokens_per_s": engine["prefill"],
            "decode_tokens_per_s": engine["decode"],
            "weight_update_gb_per_s": round(update, 4),
            "response_tokens": lengths,
        },
        "trainer": trainer,
    }
    path.write_text(
        "# The CPU demo's shape, measured here (bench/simulator_vs_job.py wrote this file).\n"
        + yaml.safe_dump(profile, sort_keys=False, width=1000)
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--profile-out", default=str(REPO / "bench" / "profiles" / "cpu_demo.yaml"))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out")
    args = p.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("this check pins the engine and the job to different CPUs: it needs 2")
    os.sched_setaffinity(0, JOB_CPUS)  # the job and everything it starts; the engines are moved to ENGINE_CPUS
    from moerl.dtypes import resolve
    from moerl.engines.pool import EnginePool, EnginePoolConfig
    from moerl.models.tiny import save_tiny_hf

    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory(prefix="moerl-simcheck-") as tmp:
        work = Path(tmp)
        model = save_tiny_hf("Qwen3MoeForCausalLM", work / "random-tiny")
        real = {mode: run_job(work / f"real-{mode}", mode, args.steps, model, []) for mode in modes}
        prompt_ids = prompts(model, 64)
        with (
            EnginePinning(),
            EnginePool(
                EnginePoolConfig(
                    model_path=str(model),
                    server="embedded",
                    base_port=0,
                    dtype=resolve("auto"),
                    log_dir=str(work / "engine-logs"),
                )
            ) as pool,
        ):
            engine = asyncio.run(measure_engine(pool.urls[0], model, prompt_ids))
        print("engine", engine, file=sys.stderr, flush=True)
        sync = real["sync"]
        trainer = trainer_profile(sync, statistics.mean(map(len, prompt_ids)))
        update = float(np.median([r["sync/full_weight_bytes"] / r["sync/seconds"] / 1e9 for r in sync]))
        profile = Path(args.profile_out)
        write_profile(profile, engine, length_profile(sync), trainer, update, len(sync))
        simulated = {
            mode: run_job(
                work / f"sim-{mode}",
                mode,
                args.steps,
                model,
                [f"simulation.profile={profile}", "simulation.trainer_gpus=1", "simulation.replicas_per_process=1"],
            )
            for mode in modes
        }
    real_s = {m: mode_summary(rows) for m, rows in real.items()}
    sim_s = {m: mode_summary(rows) for m, rows in simulated.items()}
    lines = [
        f"## Simulated against real, the CPU demo's shape ({platform.machine()}, {os.cpu_count()} cores, engine and "
        f"job pinned to a CPU each, {args.steps - 1} measured steps, {GROUPS} x {SAMPLES} samples, "
        f"{date.today().isoformat()})",
        "",
        "| mode | real samples/s | x sync | trainer idle | simulated samples/s | x sync | trainer idle | simulated x "
        "sync against real |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        r, s = real_s[mode], sim_s[mode]
        real_x, sim_x = (
            r["samples_per_s"] / real_s["sync"]["samples_per_s"],
            s["samples_per_s"] / sim_s["sync"]["samples_per_s"],
        )
        lines.append(
            f"| {mode} | {r['samples_per_s']:.1f} | {real_x:.2f} | {r['idle']:.2f} | {s['samples_per_s']:.1f} | "
            f"{sim_x:.2f} | {s['idle']:.2f} | {sim_x / real_x - 1:+.1%} |"
        )
    lines += [
        "",
        f"Profile written to `{os.path.relpath(args.profile_out, REPO)}`: decode tokens/s {engine['decode']}, prefill "
        f"{engine['prefill']}, trainer {trainer}, weight update {update:.4f} GB/s; mean response real "
        f"{real_s['sync']['len_mean']:.1f}, simulated {sim_s['sync']['len_mean']:.1f} tokens.",
    ]
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
