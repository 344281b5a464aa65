#!/usr/bin/env python3
"""The async step a scheduler that knows every length could run, training every group it draws: a linear program.

bench/simulation.py's tail-counted bound is computed from the responses a run trained. A run that drops long groups as
stale trains a shorter set, whose bound is higher; this is the bound of the draw itself, no group dropped. Groups are
drawn from the profile's lengths (its correlation replaced by ``--rho``), ``--steps`` steps of ``--groups`` each, and a
steady step T is found by bisection, each T checked by a linear program (scipy's HiGHS) whether some schedule fits:

- each response is decoded part at each concurrency c of a few levels (1-128), at the profile's per-request rate R(c);
- it ends within its staleness window, ``max_staleness + 1`` steps of engine time (a step less its sync): it may be
  issued when its window opens, which a scheduler that knows lengths can arrange;
- the replicas' time at each level holds the requests decoding there (c slots a replica), over all the steps;
- the groups in flight (each from its issue to its last response's end) average at most the job's depth,
  ``groups x max(1, max_staleness)``;
- and T holds the trainer's step (its tokens and optimizer step) and the sync.

Replicas and slots are fractional, so where the tail term binds (a step's longest response at R(1) over its window)
the answer is that term, and the program shows the other constraints leave room for it. A steady T is the smallest
mean step wherever every step draws a response at the max_new_tokens cap (each window of s + 1 steps then holds one);
with fewer responses a step, steps of different lengths could do better, and T is then an upper bound on the best
mean step, not the best. Needs scipy (``pip install scipy``), which moerl does not depend on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from moerl.simulation import Profile  # noqa: E402
from report import publish  # noqa: E402
from simulation import bounds, step_times  # noqa: E402

LEVELS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # concurrencies a response may decode at


class Draw:
    """``steps`` x ``groups`` groups of ``samples`` lengths from ``profile`` (correlation ``rho``), capped."""

    def __init__(self, profile: Profile, rho: float, groups: int, samples: int, steps: int, cap: int, seed: int):
        lengths = profile.engine.response_tokens.model_copy(update={"correlation": rho})
        rng = np.random.default_rng(seed)
        drawn = [lengths.draw_group(rng, samples) for _ in range(steps * groups)]
        self.lengths = np.minimum(np.maximum(np.round(np.stack(drawn)), 1), cap)  # [steps * groups, samples]
        self.groups, self.steps = groups, steps

    def step(self, k: int) -> np.ndarray:
        return self.lengths[k * self.groups : (k + 1) * self.groups]


def fits(T: float, draw: Draw, profile: Profile, replicas: int, depth: int, staleness: int, sync: float) -> bool:
    """Whether a schedule with a steady step of ``T`` seconds trains every group of ``draw`` (module docstring)."""
    import scipy.sparse as sparse
    from scipy.optimize import linprog

    engine_s = T - sync  # the engines decode nothing during a sync
    if engine_s <= 0:
        return False
    e = profile.engine
    levels = np.array([c for c in LEVELS if c <= e.max_running_requests])
    rate = np.array([e.decode_rate(int(c)) for c in levels])
    lengths = draw.lengths.reshape(-1)
    n, c, g = len(lengths), len(levels), draw.lengths.shape[0]
    # Variables: share[i, l] (the share of response i decoded at level l), then each group's time in flight, then the
    # replicas at each level.
    shares, in_flight, at_level = 0, n * c, n * c + g
    i, level = np.repeat(np.arange(n), c), np.tile(np.arange(c), n)
    seconds = lengths[i] / rate[level]  # response i's time, were all of it decoded at that level
    group = np.repeat(np.arange(g), draw.lengths.shape[1])
    rows = [
        i,  # a response's time <= its group's time in flight
        np.arange(n),
        n + level,  # the time decoded at a level <= its slots' time over the steps
        n + np.arange(c),
        np.full(c, n + c),  # replicas
        np.full(g, n + c + 1),  # groups in flight, on average
    ]
    columns = [
        shares + i * c + level,
        in_flight + group,
        shares + i * c + level,
        at_level + np.arange(c),
        at_level + np.arange(c),
        in_flight + np.arange(g),
    ]
    values = [seconds, -np.ones(n), seconds, -levels * draw.steps * engine_s, np.ones(c), np.ones(g)]
    variables = n * c + g + c
    upper = sparse.csr_matrix(
        (np.concatenate(values), (np.concatenate(rows), np.concatenate(columns))), shape=(n + c + 2, variables)
    )
    limits = np.concatenate([np.zeros(n + c), [replicas, depth * draw.steps * engine_s]])
    whole = sparse.csr_matrix((np.ones(n * c), (i, shares + i * c + level)), shape=(n, variables))  # shares sum to 1
    window = (staleness + 1) * engine_s
    ranges = [(0, None)] * (n * c) + [(0, window)] * g + [(0, None)] * c
    result = linprog(
        np.zeros(variables), A_ub=upper, b_ub=limits, A_eq=whole, b_eq=np.ones(n), bounds=ranges, method="highs"
    )
    return result.status == 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=str(REPO / "bench" / "profiles" / "qwen3_30b_a3b_h100.yaml"))
    p.add_argument("--pool", default="32:96", help="trainer GPUs:engine GPUs")
    p.add_argument("--groups", type=int, default=96, help="groups a step trains")
    p.add_argument("--samples", type=int, default=8, help="responses a group")
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=32768)
    p.add_argument("--model-gb", type=float, default=61.1, help="the weights a sync moves")
    p.add_argument("--steps", type=int, default=6, help="steps drawn")
    p.add_argument("--seeds", type=int, default=2, help="draws, each reported")
    p.add_argument("--correlations", type=float, nargs="+", default=[0.0, 0.73, 0.9])
    p.add_argument("--out", help="a markdown file the table is appended to (it is printed either way)")
    args = p.parse_args()
    try:
        import scipy  # noqa: F401
    except ImportError:
        raise SystemExit("bench/clairvoyant_bound.py needs scipy: pip install scipy") from None
    profile = Profile.load(args.profile)
    trainer_gpus, engine_gpus = (int(x) for x in args.pool.split(":"))
    replicas = engine_gpus // profile.engine.gpus
    depth = args.groups * max(1, args.max_staleness)
    sync = args.model_gb / profile.engine.weight_update_gb_per_s
    lines = [
        f"## The clairvoyant bound of the draw: {profile.name}, pool {args.pool}, {args.groups} x {args.samples} "
        f"samples a step, max staleness {args.max_staleness}, {args.steps} steps drawn",
        "",
        "| correlation | seed | steps at the cap | steady step T (s) | samples/s | tail-counted bound of the draw | "
        "ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for rho in args.correlations:
        for seed in range(args.seeds):
            draw = Draw(profile, rho, args.groups, args.samples, args.steps, args.max_new_tokens, seed)
            times = [
                step_times(
                    profile,
                    (trainer_gpus, engine_gpus),
                    args.groups * args.samples,
                    float(draw.step(k).mean()),
                    float(draw.step(k).max()),
                    args.model_gb * 1e9,
                    depth * args.samples,
                    args.max_staleness,
                )
                for k in range(args.steps)
            ]
            bound = bounds(times, args.steps * args.groups * args.samples, args.groups)["async_tail"]
            low = sync + max(t["T_train"] for t in times)  # the trainer's step and the sync, whatever the engines
            high = 2 * low
            while not fits(high, draw, profile, replicas, depth, args.max_staleness, sync):
                high *= 2
            while high - low > 0.05:
                mid = (low + high) / 2
                if fits(mid, draw, profile, replicas, depth, args.max_staleness, sync):
                    high = mid
                else:
                    low = mid
            rate = args.groups * args.samples / high
            capped = sum(bool((draw.step(k) >= args.max_new_tokens).any()) for k in range(args.steps))
            lines.append(
                f"| {rho:g} | {seed} | {capped} of {args.steps} | {high:.1f} | {rate:.2f} | {bound:.2f} | "
                f"{rate / bound:.2f} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
