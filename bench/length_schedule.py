#!/usr/bin/env python3
r"""The rollout schedules side by side at production shape, simulated: for each pool, correlation of a prompt's
responses' lengths, schedule policy and mode, the main job against simulated engines and trainer (as
``bench/simulation.py`` runs it), and its ratio to the mode's tail-counted ("clairvoyant") bound.

The profile is ``--profile`` (default bench/profiles/qwen3_30b_a3b_h100.yaml) with its
``engine.response_tokens.correlation`` replaced by each of ``--correlations``: that of the log-lengths of two responses
to the same prompt (0: independent; 0.73: TailSieve, arXiv 2608.22788 App. B, 64.8% + 6.9% of the 97.8% of length
variance its model explains, from the prompt and the prompt x checkpoint). A policy is a named set of overrides of the
job's config:
  groups        rollout.schedule.policy=groups (the job's default)
  length_aware  rollout.schedule.policy=length_aware, plus ``--length-aware-extra``
  tail          length_aware with chunks of 8192 tokens, at most 64 running a replica, tail requests (uncut) from
                12000 tokens, 8 running beside one (the settings bench/schedule_model.py found best)
and ``--policy NAME OVERRIDE...`` defines more (or redefines these). The bounds are bench/simulation.py's (its
docstring); per row: samples/s over the steps after the first, the tail-counted bound and the ratio to it, the ratio to
the full-engine bound, samples/s against the groups policy's, prompts dropped, the staleness lags, and the mean of the
steps' longest trained response.
Defaults differ from bench/simulation.py's where its pages did: a group a step per engine GPU (24 at 8:24, 96 at 32:96)
unless ``--groups``, max staleness 2, time x1 (at x2 the orchestrator fell behind the clock at 8:24 on 2 cores).

Each finished run is written to ``--results`` (JSON) at once, with its metrics rows; a run already there with the same
configuration (the profile's contents among it) is skipped, so a sweep killed part way resumes where it stopped.
``--from-results`` makes the table and the figure from that file without running anything. ``--keep-runs DIR``
keeps each run's directory (its metrics, logs and lengths.jsonl, the draw ``bench/schedule_model.py --lengths``
replays; not its checkpoints or weights) as DIR/<trainer>x<engine>-<correlation>-<mode>-<policy>. The table (markdown,
appended to ``--out``) and the figure (``--figure``: a panel per pool, x the correlation, y the ratio to the
tail-counted bound, a line per mode and policy) cover every run in the results file, the newest where one
configuration was run at two shapes.

    python bench/length_schedule.py --pools 8:24 --groups 24 --time-scale 1 --steps 4 \
        --results bench/results/length_schedule.json [--length-aware-extra rollout.schedule.chunk_tokens=4096] \
        [--out docs/benchmarks/length-schedule.md --figure docs/figures/length_schedule.png]
    python bench/length_schedule.py --from-results bench/results/length_schedule.json \
        --figure docs/figures/length_schedule.png
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from moerl.simulation import Profile  # noqa: E402
from report import publish  # noqa: E402
from simulation import MODES, add_shape_arguments, model_dir, run, summarize  # noqa: E402

POOLS = "8:24,32:96"
CORRELATIONS = "0,0.73,0.9"
POLICIES = "groups,tail"
# the length-aware schedule at the settings bench/schedule_model.py found best at every pool and correlation
TAIL = [
    "rollout.schedule.policy=length_aware",
    "rollout.schedule.chunk_tokens=8192",
    "rollout.schedule.max_running=64",
    "rollout.schedule.tail_tokens=12000",
    "rollout.schedule.tail_running=8",
]
SHAPE_KEYS = (
    "profile",
    "config",
    "groups",
    "samples",
    "max_new_tokens",
    "max_staleness",
    "time_scale",
    "steps",
    "replicas_per_process",
    "extra",
)
TARGET = 0.9  # the goal: async at 0.9 of the tail-counted bound
LAGGING = 2  # a sync's pause this many times the profile's T_sync: the orchestrator fell behind the time scale
SATURATED = 0.9  # the machine's CPUs busy this share of the measured steps: the simulation could not keep pace


def policy_overrides(args) -> dict[str, list[str]]:
    """Every named policy: the three presets, then ``--policy`` definitions (which may replace them)."""
    named = {
        "groups": ["rollout.schedule.policy=groups"],
        "length_aware": ["rollout.schedule.policy=length_aware", *args.length_aware_extra],
        "tail": TAIL,
    }
    for name, *overrides in args.policy or []:
        named[name] = overrides
    return named


def profile_variant(base: Path, correlation: float, out: Path) -> Path:
    """The profile ``base`` with its responses' correlation replaced, written to ``out``. Its ``model`` (a directory
    relative to the profile's file) is made absolute, so it names the same directory from ``out``; the job's model is
    still bench/simulation.py's :func:`model_dir`."""
    raw = yaml.safe_load(base.read_text())
    raw["engine"]["response_tokens"]["correlation"] = correlation
    if raw.get("model") is not None:
        raw["model"] = str((base.parent / raw["model"]).resolve())
    raw["sources"].append(f"engine.response_tokens.correlation: {correlation:g}, set by bench/length_schedule.py")
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    Profile.load(out)  # checked by reading it back
    return out


def repo_relative(path: Path) -> str:
    """``path`` relative to the repository where it lies inside it, so that a results file kept in the repository
    names the same profile and config from any clone."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def shape_of(job, base: Path, extra: list[str]) -> dict:
    """What a run's figures depend on besides its pool, correlation, mode and policy (``job``: its arguments). The
    profile's contents count, not only its path: a profile edited in place (a figure sourced anew) makes new runs."""
    shape = {k: getattr(job, k) for k in SHAPE_KEYS}
    shape.update(
        profile=repo_relative(base),
        profile_sha256=hashlib.sha256(base.read_bytes()).hexdigest()[:16],
        config=repo_relative(Path(job.config)),
        extra=extra,
    )
    return shape


def code_version() -> str | None:
    """The commit the runs are made on (``-dirty`` with changes not committed, the results files' own left out: a
    sweep run in parts adds to them between commits), to keep with each run."""
    try:
        commit, changed = (
            subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()
            for args in (
                ["describe", "--always"],
                ["status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results"],
            )
        )
    except (OSError, subprocess.CalledProcessError):
        return None  # not a git checkout
    return f"{commit}-dirty" if changed else commit


def same_run(entry: dict, key: dict) -> bool:
    return all(entry.get(k) == v for k, v in key.items())


def load_results(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {"runs": [], "failed": []}
    return json.loads(path.read_text())


def save_results(results: dict, path: Path | None) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, path)  # a kill leaves the old file or the new one, never half of one


def sweep(args, results: dict) -> int:
    """Runs every configuration not yet in ``results``, saving each as it finishes; the number that failed."""
    named = policy_overrides(args)
    unknown = [p for p in args.policies if p not in named]
    if unknown:
        raise SystemExit(f"--policies: {', '.join(unknown)} not defined (define one with --policy NAME OVERRIDE...)")
    plan = [
        (spec, c, mode, policy)
        for spec in args.pools
        for c in args.correlations
        for mode in args.modes
        for policy in args.policies
    ]
    base, user_extra = Path(args.profile), list(args.extra)
    failed, start, code = 0, time.monotonic(), code_version()
    with tempfile.TemporaryDirectory(prefix="moerl-length-schedule-") as tmp:
        root = Path(tmp)
        model = model_dir(base, Path(args.config), root)
        for i, (spec, c, mode, policy) in enumerate(plan, 1):
            key = {"pool": spec, "correlation": c, "mode": mode, "policy": policy, "overrides": named[policy]}
            label = f"[{i}/{len(plan)}] {spec} correlation {c:g} {mode} {policy}"
            pool = tuple(int(x) for x in spec.split(":"))
            job = argparse.Namespace(**vars(args))
            job.groups = args.groups or pool[1]  # default: a group per engine GPU, as docs/benchmarks/simulation*.md
            shape = shape_of(job, base, user_extra)
            if any(same_run(e, {**key, "shape": shape}) for e in results["runs"]):
                print(f"{label}: in the results, skipped", file=sys.stderr, flush=True)
                continue
            variant = root / f"profile-{c:g}.yaml"
            if not variant.exists():
                profile_variant(base, c, variant)
            profile = Profile.load(variant)
            job.profile, job.extra = str(variant), [*named[policy], *user_extra]
            work = root / f"{pool[0]}x{pool[1]}-{c:g}-{policy}"
            work.mkdir(exist_ok=True)
            print(f"{label}: started {datetime.datetime.now():%H:%M:%S}", file=sys.stderr, flush=True)
            began = time.monotonic()
            try:
                rows, cfg = run(mode, pool, job, model, profile, work)
                summary = summarize(rows, cfg, mode, pool, job, profile)
            except SystemExit as e:  # run() keeps the failed run's log and directory, and names them
                failed += 1
                results["failed"].append({**key, "shape": shape, "error": str(e), "at": f"{datetime.datetime.now()}"})
                save_results(results, args.results)
                print(f"{label}: FAILED after {(time.monotonic() - began) / 60:.1f} min: {e}", file=sys.stderr)
                continue
            finally:
                run_dir = work / f"{pool[0]}x{pool[1]}-{mode}"
                if args.keep_runs is not None and run_dir.exists():
                    kept = args.keep_runs / f"{pool[0]}x{pool[1]}-{c:g}-{mode}-{policy}"
                    shutil.rmtree(kept, ignore_errors=True)  # a run of the same name made again replaces it
                    shutil.copytree(run_dir, kept, ignore=shutil.ignore_patterns("checkpoints", "weights"))
                shutil.rmtree(run_dir, ignore_errors=True)
            seconds = time.monotonic() - began
            results["runs"].append(
                {
                    **key,
                    "shape": shape,
                    "profile_name": profile.name,
                    "summary": summary,
                    "wall_s": seconds,
                    "finished": f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S}",
                    "code": code,
                    "metrics": rows,
                }
            )
            save_results(results, args.results)
            t = summary["seconds"]
            print(
                f"{label}: {seconds / 60:.1f} min (sweep {(time.monotonic() - start) / 60:.1f} min): "
                f"{summary['samples_per_s']:.3f} samples/s, {summary['ratio_tail']:.2f} of the tail-counted bound "
                f"{summary['bound_tail']:.3f}, {summary['ratio_full']:.2f} of the full-engine bound, dropped "
                f"{summary['dropped']}, longest {summary['longest_mean']:.0f} tokens, manager CPU "
                f"{summary['manager_cpu_s']:.2f} s/step, trainer idle {summary['trainer_idle']:.2f}; "
                + ", ".join(f"{k} {v:.1f} s" for k, v in t.items())
                + f"; sync pause {summary['pause_s']:.1f} s; CPUs {summary['machine_busy']:.0%} busy",
                file=sys.stderr,
                flush=True,
            )
            if summary["pause_s"] > LAGGING * t["T_sync"]:
                print(
                    f"{label}: the engines stood paused {summary['pause_s']:.0f} s a sync against the profile's "
                    f"{t['T_sync']:.0f} s: the orchestrator did not keep pace with time x{job.time_scale:g} on this "
                    "machine, so this run reads low; run it again at a smaller --time-scale",
                    file=sys.stderr,
                    flush=True,
                )
            if summary["machine_busy"] >= SATURATED:
                print(
                    f"{label}: the machine's CPUs were {summary['machine_busy']:.0%} busy over the measured steps: "
                    f"the simulated engines' answers and the orchestrator had no time to spare at time "
                    f"x{job.time_scale:g}, so groups finished late and this run reads low; run it again at a smaller "
                    "--time-scale",
                    file=sys.stderr,
                    flush=True,
                )
    return failed


def pool_order(spec: str) -> tuple[int, ...]:
    return tuple(int(x) for x in spec.split(":"))


def shown(results: dict, args) -> list[dict]:
    """The runs to report: per (pool, correlation, mode, policy), the newest; filtered by the options given."""
    latest: dict[tuple, dict] = {}
    for e in results["runs"]:
        k = (e["pool"], e["correlation"], e["mode"], e["policy"])
        if k in latest:
            print(f"{'/'.join(map(str, k))}: run at two shapes or overrides; the newest shown", file=sys.stderr)
        latest[k] = e
    keep = [
        e
        for e in latest.values()
        if (args.pools is None or e["pool"] in args.pools)
        and (args.correlations is None or e["correlation"] in args.correlations)
        and (args.modes is None or e["mode"] in args.modes)
        and (args.policies is None or e["policy"] in args.policies)
    ]
    policies = list(dict.fromkeys([*(args.policies or POLICIES.split(",")), *sorted(e["policy"] for e in keep)]))
    modes = list(dict.fromkeys([*MODES, *sorted(e["mode"] for e in keep)]))
    return sorted(
        keep,
        key=lambda e: (pool_order(e["pool"]), e["correlation"], modes.index(e["mode"]), policies.index(e["policy"])),
    )


def table(runs: list[dict]) -> list[str]:
    by_key = {(e["pool"], e["correlation"], e["mode"], e["policy"]): e for e in runs}
    lines = [
        f"## Rollout schedules side by side, simulated: {runs[0]['profile_name']}, the correlation of a prompt's "
        "responses' log-lengths varied",
        "",
    ]
    shapes: dict[str, dict[str, list[str]]] = {}
    for e in runs:
        shapes.setdefault(json.dumps(e["shape"], sort_keys=True), {}).setdefault(e["pool"], []).append(e["mode"])
    for text, pools in shapes.items():
        s = json.loads(text)
        which = "; ".join(f"{pool} {', '.join(dict.fromkeys(modes))}" for pool, modes in pools.items())
        lines.append(
            f"- {which}: {s['groups']} x {s['samples']} samples per step, {s['steps']} steps "
            f"({s['steps'] - 1} measured), max {s['max_new_tokens']} new tokens, max staleness {s['max_staleness']} "
            f"(async), time x{s['time_scale']:g}, {s['replicas_per_process']} replicas per engine process"
            + (f", {' '.join(s['extra'])}" if s["extra"] else "")
            + (f", profile sha256 {s['profile_sha256']}" if "profile_sha256" in s else "")
        )
    for policy, overrides in {e["policy"]: e["overrides"] for e in runs}.items():
        lines.append(f"- policy `{policy}`: {' '.join(f'`{o}`' for o in overrides) or 'no overrides'}")
    lines += [
        "",
        "| pool | correlation | mode | policy | samples/s (sim.) | bound, tail counted | ratio | bound, full engines "
        "| ratio | x groups | staleness lag 0/1/2+ | dropped | longest trained (mean) | trainer idle | "
        "async guide ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in runs:
        s = e["summary"]
        base = by_key.get((e["pool"], e["correlation"], e["mode"], "groups"))
        versus = f"{s['samples_per_s'] / base['summary']['samples_per_s']:.2f}" if base else "n/a"
        guide = f"{s['guide']['ratio']:.2f} (c = {s['guide']['concurrency']})" if "guide" in s else ""
        lines.append(
            f"| {e['pool']} | {e['correlation']:g} | {e['mode']} | {e['policy']} | {s['samples_per_s']:.3f} | "
            f"{s['bound_tail']:.3f} | {s['ratio_tail']:.2f} | {s['bound_full']:.3f} | {s['ratio_full']:.2f} | "
            f"{versus} | {'/'.join(f'{x:.2f}' for x in s['lag'])} | {s['dropped']} | {s['longest_mean']:.0f} | "
            f"{s['trainer_idle']:.2f} | {guide} |"
        )
    return lines


def figure(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = sorted({e["pool"] for e in runs}, key=pool_order)
    policies = list(dict.fromkeys(e["policy"] for e in runs))
    modes = list(dict.fromkeys(e["mode"] for e in runs))
    colour = {m: f"C{MODES.index(m) if m in MODES else 3 + i}" for i, m in enumerate(modes)}
    markers = "os^Dv<>"
    fig, axes = plt.subplots(1, len(pools), figsize=(6 * len(pools), 4.5), sharey=True, squeeze=False)
    for ax, pool in zip(axes[0], pools, strict=True):
        for mode in modes:
            for j, policy in enumerate(policies):
                points = sorted(
                    (e["correlation"], e["summary"]["ratio_tail"])
                    for e in runs
                    if e["pool"] == pool and e["mode"] == mode and e["policy"] == policy
                )
                if not points:
                    continue
                overrides = next(e["overrides"] for e in runs if e["policy"] == policy)
                groups = "rollout.schedule.policy=length_aware" not in overrides
                ax.plot(
                    *zip(*points, strict=True),
                    color=colour[mode],
                    linestyle="--" if groups else "-",
                    marker=markers[j % len(markers)],
                    label=f"{mode}, {policy}",
                )
        ax.axhline(TARGET, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{pool} (trainer:engine GPUs)")
        ax.set_xlabel("correlation of a prompt's responses' log-lengths")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")  # each its own: a pool may lack a mode another has
    axes[0][0].set_ylabel("samples/s / tail-counted bound")
    axes[0][0].set_ylim(0, max(1.0, *(e["summary"]["ratio_tail"] for e in runs)) * 1.05)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"figure: {path}", file=sys.stderr)


def listed(text: str | None, kind=str) -> list | None:
    return None if text is None else [kind(x) for x in text.split(",") if x]


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    add_shape_arguments(
        p, profile=str(REPO / "bench" / "profiles" / "qwen3_30b_a3b_h100.yaml"), groups=None, max_staleness=2
    )
    p.set_defaults(time_scale=1.0)
    p.add_argument("--pools", help=f"trainer GPUs:engine GPUs, comma-separated (default {POOLS})")
    p.add_argument(
        "--correlations", help=f"of a prompt's responses' log-lengths, comma-separated (default {CORRELATIONS})"
    )
    p.add_argument("--policies", help=f"policy names, comma-separated (default {POLICIES})")
    p.add_argument("--modes", help=f"comma-separated (default {','.join(MODES)})")
    p.add_argument(
        "--policy",
        nargs="+",
        action="append",
        metavar=("NAME", "OVERRIDE"),
        help="define a policy: its name, then its overrides (section.key=value); may be given again",
    )
    p.add_argument(
        "--length-aware-extra",
        nargs="*",
        default=[],
        help="overrides added to the length_aware policy, e.g. rollout.schedule.chunk_tokens=4096",
    )
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--replicas-per-process", type=int, default=12)
    p.add_argument("--extra", nargs="*", default=[], help="more overrides of every run's config (section.key=value)")
    p.add_argument(
        "--results", type=Path, help="JSON file each finished run is added to; runs already in it are skipped"
    )
    p.add_argument("--from-results", type=Path, help="make the table and figure from this results file; run nothing")
    p.add_argument(
        "--keep-runs",
        type=Path,
        metavar="DIR",
        help="keep each run's directory here (see above), less checkpoints and weights",
    )
    p.add_argument("--out", help="append the table to this markdown file")
    p.add_argument("--figure", type=Path, help="draw the figure to this PNG (none without it)")
    args = p.parse_args()
    args.pools, args.policies, args.modes = listed(args.pools), listed(args.policies), listed(args.modes)
    args.correlations = listed(args.correlations, float)
    failed = 0
    if args.from_results is not None:
        results = load_results(args.from_results)
    else:
        args.pools = args.pools or POOLS.split(",")
        args.correlations = args.correlations or [float(x) for x in CORRELATIONS.split(",")]
        args.policies = args.policies or POLICIES.split(",")
        args.modes = args.modes or list(MODES)
        if args.steps < 2:
            raise SystemExit("--steps must be 2 or more: the first fills the pipeline and is not measured")
        for c in args.correlations:
            if not 0 <= c < 1:
                raise SystemExit(f"--correlations: {c:g} is not in [0, 1)")
        results = load_results(args.results)
        failed = sweep(args, results)
        args.pools = args.correlations = args.policies = args.modes = None  # report the whole results file
    runs = shown(results, args)
    if not runs:
        raise SystemExit("no finished run to report")
    publish(table(runs), args.out)
    if args.figure is not None:
        figure(runs, args.figure)
    if failed:
        print(f"{failed} run(s) failed; their errors are in the results' 'failed' list", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
