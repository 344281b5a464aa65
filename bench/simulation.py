#!/usr/bin/env python3
r"""The main job at production shape without GPUs: the real orchestrator against simulated engines and a simulated
trainer (``simulation.profile``), in sync, periodic and async mode, at the pool sizes given.

For each pool (trainer GPUs : engine GPUs) and mode: simulated samples/s over the steps after the first, the mode's
ideal bound and the ratio to it, the trainer's idle fraction, the staleness histogram, prompts dropped, and the
orchestrator's own CPU per step (the rollout manager's and rank 0's buffer's, real seconds, never scaled).

The bounds, per step of B samples whose responses hold D tokens, on E replicas of the profile's engine:
  T_gen   = D / (E * R(c)), R(c) the profile's decode tokens/s of one replica running c = min(max_running, F / E)
            requests, F the requests the mode lets be in flight (B; async: rollout.max_outstanding_groups x samples, by
            default B * max(1, max_staleness)):
            generation with every replica full all the time (no replica idle behind the batch's slowest response)
  T_train = D / (trainer.tokens_per_s_per_gpu * trainer GPUs) + optimizer_step_s (prompt tokens left out of D and T_gen)
  T_sync  = model bytes / weight_update_gb_per_s: every replica loads at once, the engines and the trainer both wait
  sync      B / (T_gen + T_train + T_sync)                 nothing overlaps; the bound counts no tail
  periodic  B / (T_sync + max(T_gen + T_train / G, T_train)) training overlaps generation, the last of G groups after it
  async     B / (T_sync + max(T_gen, T_train))             generation and training overlap fully (across steps too: over
                                                           several, the totals of T_gen and T_train are compared)
sync's measured rate against its bound is what the tail of the batch costs; async's against sync's measured rate is
what the overlap and the full engines buy together.

No mode keeps the engines full through a long tail. A group may be trained only while its oldest token is at most s
versions old (s: rollout.max_staleness in async mode, 0 in the on-policy modes), so each of its responses is
generated within the s + 1 steps between the sync that brought its first token's policy and the step that trains it,
less the syncs (the engines decode nothing while they load). The step's longest trained response L decodes at most
at the rate of a request running alone, R(1) (the profile's highest per-request rate), so
  T_tail  = L / ((s + 1) * R(1))   per step, of its time besides the sync (async: on average over consecutive steps)
The tail-counted bounds put it beside T_gen:
  sync, on-policy      B / (max(T_gen, T_tail) + T_train + T_sync)                 step by step (s = 0)
  periodic, on-policy  B / (T_sync + max(max(T_gen, T_tail) + T_train / G, T_train))  step by step (s = 0)
  async, staleness s   B / (T_sync + max(T_gen, T_train, T_tail))                  over the steps' totals
A run's ratio to its tail-counted bound is how close its scheduling gets to what its mode allows; its ratio to the
full-engine bound is what the tail costs. Async's tail-counted bound lets the longest response decode at R(1) while the
replicas stay full, which no schedule can do when lengths are known only once decoded; beside it, a guide (not a bound:
a schedule may change a replica's concurrency within a step): the best async rate with every replica at one
concurrency c throughout, which slows the longest response to R(c) / c,
  async, one concurrency   max over c of B / (T_sync + max(D / (E * R(c)), T_train, c * L / ((s + 1) * R(c))))
The first measured steps' responses may have begun in the fill step, which is not measured, so over N measured steps
async's tail-counted ratio may read high by up to about s / N.

    python bench/simulation.py --pools 8:24 [--groups 48 --samples 8 --steps 4 --time-scale 4] \
        [--out docs/benchmarks/simulation.md]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from moerl.orchestrator.config import RunConfig, load_config  # noqa: E402
from moerl.orchestrator.metrics import read_metrics  # noqa: E402
from moerl.simulation import Profile  # noqa: E402
from report import publish  # noqa: E402

RECIPE = REPO / "recipes" / "qwen_moe_grpo.sh"
MODES = ("sync", "periodic", "async")


def model_dir(profile_path: Path, config: Path, root: Path) -> Path:
    """The profile's model as a HF directory: its Hub config and the tiny tokenizer (ids past its vocabulary decode to
    nothing, which is all the rewards need here)."""
    from moerl.models.tiny import tiny_tokenizer

    out = root / "model"
    out.mkdir()
    (out / "config.json").write_text(config.read_text())
    tiny_tokenizer().save_pretrained(out)
    return out


def add_shape_arguments(parser, profile: str | None, groups: int, max_staleness: int) -> None:
    """The options that give the simulated job its shape, which :func:`job_overrides` reads (bench/engine_kills.py
    takes them too)."""
    parser.add_argument("--profile", default=profile, help="a simulation profile (bench/profiles/*.yaml)")
    parser.add_argument(
        "--config",
        default=str(REPO / "tests" / "data" / "qwen3_30b_a3b" / "config.json"),
        help="the model's Hub config.json",
    )
    parser.add_argument("--groups", type=int, default=groups, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="responses per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32768)
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=max_staleness,
        help="async: versions a group may lag (its in-flight depth: groups x this)",
    )
    parser.add_argument("--time-scale", type=float, default=4.0, help="simulated seconds per real second")


def job_overrides(run_dir: Path, mode: str, pool: tuple[int, int], args, model: Path, profile: Profile) -> list[str]:
    """The job's config at ``pool`` (trainer GPUs, engine GPUs) under the profile ``args.profile``, from this script's
    arguments (``args``: profile, steps, time_scale, replicas_per_process, groups, samples, max_new_tokens,
    max_staleness, extra)."""
    trainer_gpus, engine_gpus = pool
    return [
        f"run.dir={run_dir}",
        "run.progress=false",
        f"run.mode={mode}",
        f"run.steps={args.steps}",
        f"model.path={model}",
        f"simulation.profile={args.profile}",
        f"simulation.time_scale={args.time_scale}",
        f"simulation.trainer_gpus={trainer_gpus}",
        f"simulation.replicas_per_process={args.replicas_per_process}",
        f"engines.replicas={engine_gpus // profile.engine.gpus}",
        f"rollout.groups_per_step={args.groups}",
        f"rollout.samples_per_prompt={args.samples}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.max_staleness={args.max_staleness}",
        "task.name=gsm8k",
        *args.extra,
    ]


def run(
    mode: str, pool: tuple[int, int], args, model: Path, profile: Profile, root: Path
) -> tuple[list[dict], RunConfig]:
    run_dir = root / f"{pool[0]}x{pool[1]}-{mode}"
    log = run_dir.with_suffix(".log")
    with open(log, "w") as f:
        done = subprocess.run(
            ["bash", str(RECIPE), *job_overrides(run_dir, mode, pool, args, model, profile)],
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    if done.returncode:  # kept out of the temporary directory, which goes with the script's exit
        kept = Path(tempfile.mkdtemp(prefix=f"moerl-sim-failed-{pool[0]}x{pool[1]}-{mode}-"))
        shutil.copy(log, kept)
        if run_dir.exists():
            shutil.copytree(run_dir, kept / run_dir.name, ignore=shutil.ignore_patterns("checkpoints"))
        raise SystemExit(
            f"{mode} at {pool[0]}:{pool[1]} failed; its log and run directory (metrics, the manager's log): {kept}"
        )
    return read_metrics(run_dir), load_config(run_dir / "config.yaml")


def step_times(
    profile: Profile,
    pool: tuple[int, int],
    samples: int,
    response_tokens: float,
    longest: float,
    model_bytes: float,
    in_flight: int,
    staleness: int,
) -> dict:
    """One step's T_gen, T_tail, T_train and T_sync (the module's docstring); ``longest``: its longest trained response;
    ``staleness``: the versions a group may lag in this mode (0: on-policy)."""
    trainer_gpus, engine_gpus = pool
    e, t = profile.engine, profile.trainer
    replicas = engine_gpus // e.gpus
    running = max(1, round(min(e.max_running_requests, in_flight / replicas)))
    generate = samples * response_tokens / (replicas * e.decode_rate(running) * running)
    alone = max(e.decode_rate(c) for c in range(1, e.max_running_requests + 1))  # R(1), whatever the profile's shape
    return {
        "T_gen": generate,
        "T_tail": longest / ((staleness + 1) * alone),
        "T_train": t.seconds(samples * response_tokens, trainer_gpus) + t.optimizer_step_s,
        "T_sync": model_bytes / (e.weight_update_gb_per_s * 1e9),
    }


def bounds(steps: list[dict], samples: int, groups: int) -> dict:
    """Each mode's bounds in samples/s over ``steps`` (their :func:`step_times`). Sync and periodic wait for each step's
    generation, so their times add step by step; async overlaps generation and training across steps, so only the
    totals bound it."""
    total = {k: sum(s[k] for s in steps) for k in steps[0]}
    on_policy = [max(s["T_gen"], s["T_tail"]) for s in steps]
    seconds = {
        "sync": total["T_gen"] + total["T_train"] + total["T_sync"],
        "periodic": sum(s["T_sync"] + max(s["T_gen"] + s["T_train"] / groups, s["T_train"]) for s in steps),
        "async": total["T_sync"] + max(total["T_gen"], total["T_train"]),
        "sync_tail": sum(on_policy) + total["T_train"] + total["T_sync"],
        "periodic_tail": sum(
            s["T_sync"] + max(gen + s["T_train"] / groups, s["T_train"])
            for s, gen in zip(steps, on_policy, strict=True)
        ),
        "async_tail": total["T_sync"] + max(total["T_gen"], total["T_train"], total["T_tail"]),
    }
    return {mode: samples / t for mode, t in seconds.items()}


def one_concurrency_guide(
    profile: Profile,
    pool: tuple[int, int],
    samples: float,
    tokens: float,
    longest: float,
    steps: list[dict],
    staleness: int,
) -> tuple[float, int]:
    """Async's guide (the module's docstring) over ``steps`` (their :func:`step_times`), which trained ``samples``
    responses of ``tokens`` in all, ``longest`` the sum of each step's longest: (samples/s, the concurrency giving
    it)."""
    e = profile.engine
    replicas = pool[1] // e.gpus
    sync, train = sum(s["T_sync"] for s in steps), sum(s["T_train"] for s in steps)

    def rate(c: int) -> float:
        tokens_per_s = e.decode_rate(c) * c  # one replica's
        return samples / (
            sync + max(tokens / (replicas * tokens_per_s), train, c * longest / ((staleness + 1) * tokens_per_s))
        )

    best = max(range(1, e.max_running_requests + 1), key=rate)
    return rate(best), best


def summarize(rows: list[dict], cfg, mode: str, pool: tuple[int, int], args, profile: Profile) -> dict:
    """One run's figures over its measured steps (the first fills the pipeline): its rate, bounds and ratios, staleness,
    drops, the orchestrator's CPU; async, the one-concurrency guide."""
    rows = rows[1:]
    if not rows:
        raise SystemExit("no measured step: --steps must be 2 or more (the first fills the pipeline)")
    wall = sum(r["time/step_seconds"] for r in rows)
    trained = sum(r["rollout/samples"] for r in rows)
    rate = trained / (wall * args.time_scale)
    staleness = args.max_staleness if mode == "async" else 0
    in_flight = cfg.rollout.outstanding * args.samples if mode == "async" else args.groups * args.samples
    steps = [
        step_times(
            profile,
            pool,
            r["rollout/samples"],
            r["rollout/response_len_mean"],
            r["rollout/response_len_max"],
            r["sync/full_weight_bytes"],
            in_flight,
            staleness,
        )
        for r in rows
    ]
    bound = bounds(steps, trained, args.groups)
    lag = [float(np.mean([r[k] for r in rows])) for k in ("staleness/lag_0", "staleness/lag_1")]
    out = {
        "samples_per_s": rate,
        "bound_full": bound[mode],
        "bound_tail": bound[f"{mode}_tail"],
        "ratio_full": rate / bound[mode],
        "ratio_tail": rate / bound[f"{mode}_tail"],
        "dropped": rows[-1]["prompts/dropped"],
        "lag": [lag[0], lag[1], 1 - sum(lag)],
        "longest_mean": float(np.mean([r["rollout/response_len_max"] for r in rows])),
        "response_mean": float(np.mean([r["rollout/response_len_mean"] for r in rows])),
        "trainer_idle": float(np.mean([r["time/trainer_idle_fraction"] for r in rows])),
        # simulated seconds the engines stood paused at a sync: near the bounds' T_sync where the orchestrator kept
        # pace with the time scale, far above it where it did not (the simulation runs on the wall clock)
        "pause_s": float(np.mean([r["sync/pause_seconds"] for r in rows])) * args.time_scale,
        "manager_cpu_s": float(np.mean([r["cpu/manager_seconds"] for r in rows])),
        # of a real run's step: the manager's CPU is real seconds, the step simulated
        "manager_fraction": float(np.mean([r["cpu/manager_seconds"] for r in rows]))
        / (wall / len(rows) * args.time_scale),
        "helpers_cpu_s": float(np.mean([r["cpu/manager_helpers_seconds"] for r in rows])),
        "buffer_cpu_s": float(np.mean([r["cpu/buffer_seconds"] for r in rows])),
        # the share of the machine's CPU time that was busy: near 1, the orchestrator and the simulated engines had no
        # time to spare, and the run fell behind its clock whatever the pauses read
        "machine_busy": float(np.mean([r["cpu/machine_busy_fraction"] for r in rows])),
        "seconds": {k: float(np.mean([s[k] for s in steps])) for k in steps[0]},
        "measured_steps": len(rows),
    }
    if mode == "async":
        best, at = one_concurrency_guide(
            profile,
            pool,
            trained,
            sum(r["rollout/samples"] * r["rollout/response_len_mean"] for r in rows),
            sum(r["rollout/response_len_max"] for r in rows),
            steps,
            staleness,
        )
        out["guide"] = {"samples_per_s": best, "concurrency": at, "ratio": rate / best}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(
        p, profile=str(REPO / "bench" / "profiles" / "qwen3_30b_a3b_h100.yaml"), groups=48, max_staleness=1
    )
    p.add_argument("--pools", default="8:24", help="trainer GPUs:engine GPUs, comma-separated")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--replicas-per-process", type=int, default=12)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--extra", nargs="*", default=[], help="more overrides of the job's config (section.key=value)")
    p.add_argument("--out")
    args = p.parse_args()
    profile = Profile.load(args.profile)
    lines = [
        f"## Simulated job: {profile.name}, {args.groups} x {args.samples} samples per step, max {args.max_new_tokens} "
        f"new tokens, max staleness {args.max_staleness}, time "
        f"x{args.time_scale:g}{', ' + ' '.join(args.extra) if args.extra else ''}",
        "",
        "| pool (trainer:engine GPUs) | mode | samples/s (sim.) | bound, full engines | ratio | bound, tail counted | "
        "ratio | x sync | trainer idle | staleness lag 0/1/2+ | dropped | manager CPU s/step (of the simulated step) | "
        "its generation workers' CPU s/step | buffer CPU s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory(prefix="moerl-sim-") as tmp:
        root = Path(tmp)
        model = model_dir(Path(args.profile), Path(args.config), root)
        for spec in args.pools.split(","):
            pool = tuple(int(x) for x in spec.split(":"))
            sync_rate = None
            for mode in args.modes.split(","):
                rows, cfg = run(mode, pool, args, model, profile, root)
                s = summarize(rows, cfg, mode, pool, args, profile)
                rate = s["samples_per_s"]
                sync_rate = rate if mode == "sync" else sync_rate
                versus_sync = f"{rate / sync_rate:.2f}" if sync_rate else "n/a"
                lag = s["lag"]
                lines.append(
                    f"| {pool[0]}:{pool[1]} | {mode} | {rate:.3f} | {s['bound_full']:.3f} | {s['ratio_full']:.2f} | "
                    f"{s['bound_tail']:.3f} | {s['ratio_tail']:.2f} | {versus_sync} | {s['trainer_idle']:.2f} | "
                    f"{lag[0]:.2f}/{lag[1]:.2f}/{lag[2]:.2f} | {s['dropped']} | {s['manager_cpu_s']:.2f} "
                    f"({s['manager_fraction']:.1%}) | {s['helpers_cpu_s']:.2f} | {s['buffer_cpu_s']:.2f} |"
                )
                guide = ""
                if "guide" in s:
                    g = s["guide"]
                    guide = (
                        f", one-concurrency guide {g['samples_per_s']:.3f} samples/s (c = {g['concurrency']}; ratio "
                        f"{g['ratio']:.2f})"
                    )
                print(
                    lines[-1],
                    ", ".join(f"{k} {v:.1f} s" for k, v in s["seconds"].items()),
                    f"mean response {s['response_mean']:.0f} tokens{guide}",
                    file=sys.stderr,
                    flush=True,
                )
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
