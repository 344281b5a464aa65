#!/usr/bin/env python3
r"""Agentic episodes at production shape without GPUs: the main job in async mode with the simulated agent
(``rollout.agent=simulated``) against simulated engines and a simulated trainer, at the pool given.

The profile's engine and trainer figures are kept; its response lengths become a turn's, and an ``episodes`` section is
added from the options: turns per episode, a tool's seconds between turns, and the tokens of its output. Measured over
the steps after the first: episodes and turns per simulated second; the rollout manager's CPU per turn (real
milliseconds, never scaled: what one manager process spends on a turn's request, its tokens, routing and kept sets,
and the episode's bookkeeping), and its generation workers'; and the routing each episode brings back, in the bytes
SGLang sends (int32 over every layer and top-k, before base64): moerl asks each turn only for the rows it has not got
(``routed_experts_start_len``), against what asking for every turn's whole sequence would bring (what verl and SkyRL
request), counted from the same turns.

    python bench/episodes.py [--pool 8:24 --groups 32 --turns 4,12 --tool-seconds 2,30 --observation-tokens 300,4000 \
        --turn-tokens 400,3000] [--out docs/benchmarks/episodes.md]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from moerl.models import model_shape  # noqa: E402
from moerl.simulation import Profile  # noqa: E402
from report import publish  # noqa: E402
from simulation import add_shape_arguments, model_dir, run  # noqa: E402


def median_p99(text: str) -> dict[str, float]:
    median, p99 = (float(x) for x in text.split(","))
    return {"median": median, "p99": p99}


def agentic_profile(args, out: Path) -> Path:
    """The profile ``args.profile`` with a turn's lengths and the episodes section from the options."""
    raw = yaml.safe_load(Path(args.profile).read_text())
    raw["engine"]["response_tokens"] = median_p99(args.turn_tokens)
    raw["episodes"] = {
        "turns": median_p99(args.turns),
        "tool_seconds": median_p99(args.tool_seconds),
        "observation_tokens": median_p99(args.observation_tokens),
    }
    raw["sources"].append(f"episodes and turn lengths: bench/episodes.py's options ({' '.join(sys.argv[1:])})")
    out.write_text(yaml.safe_dump(raw))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(
        p, profile=str(REPO / "bench" / "profiles" / "qwen3_30b_a3b_h100.yaml"), groups=32, max_staleness=1
    )
    p.add_argument("--pool", default="8:24", help="trainer GPUs:engine GPUs")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--replicas-per-process", type=int, default=12)
    p.add_argument("--turns", default="4,12", help="turns per episode: median,p99")
    p.add_argument("--tool-seconds", default="2,30", help="a tool's simulated seconds between turns: median,p99")
    p.add_argument("--observation-tokens", default="300,4000", help="a tool's output tokens: median,p99")
    p.add_argument("--turn-tokens", default="400,3000", help="a turn's generated tokens: median,p99")
    p.add_argument("--max-episode-tokens", type=int, default=32768)
    p.add_argument("--workers", type=int, default=0, help="the rollout manager's generation workers")
    p.add_argument("--out")
    args = p.parse_args()
    args.max_new_tokens = min(args.max_new_tokens, args.max_episode_tokens - 1)
    shape = model_shape(json.loads(Path(args.config).read_text()))
    row_bytes = shape.num_layers * shape.topk * 4
    pool = tuple(int(x) for x in args.pool.split(":"))
    with tempfile.TemporaryDirectory(prefix="moerl-episodes-") as tmp:
        root = Path(tmp)
        args.profile = str(agentic_profile(args, root / "profile.yaml"))
        profile = Profile.load(args.profile)
        args.extra = [
            "rollout.agent=simulated",
            f"rollout.max_episode_tokens={args.max_episode_tokens}",
            f"rollout.generation_workers={args.workers}",
        ]
        rows, _ = run("async", pool, args, model_dir(Path(args.profile), Path(args.config), root), profile, root)
    rows = rows[1:]  # the first step fills the pipeline
    simulated_s = sum(r["time/step_seconds"] for r in rows) * args.time_scale
    episodes = sum(r["rollout/samples"] - r["episode/forks"] for r in rows)  # a sample per episode, and per fork
    turns = sum(r["episode/turns_mean"] * (r["rollout/samples"] - r["episode/forks"]) for r in rows)
    manager_ms = 1e3 * sum(r["cpu/manager_seconds"] for r in rows) / turns
    workers_ms = 1e3 * sum(r["cpu/manager_helpers_seconds"] for r in rows) / turns
    received = sum(r["routing/rows_received"] for r in rows) * row_bytes / episodes
    full = sum(r["routing/rows_full_sequence"] for r in rows) * row_bytes / episodes
    env = float(np.mean([r["episode/env_token_fraction"] for r in rows]))
    lines = [
        f"## Agentic episodes, simulated: {profile.name} at {pool[0]}:{pool[1]} (trainer:engine GPUs), async "
        f"(max staleness {args.max_staleness}), {args.groups} x {args.samples} episodes per step, time "
        f"x{args.time_scale:g}, {args.workers} generation workers",
        "",
        f"Turns per episode {args.turns} (median,p99), a tool's seconds {args.tool_seconds}, its output tokens "
        f"{args.observation_tokens}, a turn's tokens {args.turn_tokens}; {len(rows)} measured steps.",
        "",
        "| episodes/s (sim.) | turns/s (sim.) | turns/episode | env. token share | manager CPU ms/turn | "
        "its workers' CPU ms/turn | routing MB/episode, moerl | whole sequence per turn | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {episodes / simulated_s:.2f} | {turns / simulated_s:.1f} | {turns / episodes:.2f} | {env:.2f} | "
        f"{manager_ms:.2f} | {workers_ms:.2f} | {received / 1e6:.2f} | {full / 1e6:.2f} | {full / received:.2f} |",
    ]
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
