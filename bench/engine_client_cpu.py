#!/usr/bin/env python3
"""The rollout manager's CPU per response: what one engine client process spends to get a long response of a large MoE
model, with its generation workers (HTTP and decoding in other processes) and without.

One simulated replica of the profile's model (its Hub config: real layer count and top-k, so routing and kept sets
travel at their true sizes) answers ``--requests`` requests of exactly ``--tokens`` tokens each, ``--concurrency`` at
once, at a time scale that makes generation itself instant. Measured: this process's CPU seconds (every thread) per
response, the workers' CPU per response, and the wall time; the median of ``--repeats`` rounds, after one round to
warm up (worker start, imports).

    python bench/engine_client_cpu.py [--tokens 8192 --requests 16 --workers 0,4] [--out docs/benchmarks/simulation.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from moerl.engines.client import EngineClient, Returns  # noqa: E402
from moerl.engines.pool import EnginePool, EnginePoolConfig  # noqa: E402
from moerl.models import model_shape  # noqa: E402
from moerl.simulation import Profile  # noqa: E402
from report import publish  # noqa: E402
from simulation import model_dir  # noqa: E402


def cpu(process: psutil.Process) -> float:
    t = process.cpu_times()
    return t.user + t.system


async def rounds(url: str, shape, args, workers: int) -> list[tuple[float, float, float]]:
    """(client CPU s, workers' CPU s, wall s) per response, for each measured round."""
    me = psutil.Process()
    params = {"n": 1, "max_new_tokens": args.tokens, "ignore_eos": True, "top_k": 16}
    out = []
    async with EngineClient([url], shape=shape, workers=workers, timeout_s=3600) as client:
        gate = asyncio.Semaphore(args.concurrency)

        async def one(i: int):
            async with gate:
                (completion,) = await client.generate(
                    list(range(1, 65)),
                    {**params, "sampling_seed": i},
                    Returns(routing_from=0, sampling_mask=True),
                )
                assert len(completion.output_ids) == args.tokens and completion.routing.shape[0] >= args.tokens

        for r in range(args.repeats + 1):  # round 0 starts the workers and is not counted
            helpers = [psutil.Process(pid) for pid in client.worker_pids()]
            mine, theirs, wall = cpu(me), sum(map(cpu, helpers)), time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(args.requests)))
            if r:
                spent = (cpu(me) - mine, sum(map(cpu, helpers)) - theirs, time.perf_counter() - wall)
                out.append(tuple(x / args.requests for x in spent))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=str(REPO / "bench" / "profiles" / "qwen3_30b_a3b_h100.yaml"))
    p.add_argument(
        "--config",
        default=str(REPO / "tests" / "data" / "qwen3_30b_a3b" / "config.json"),
        help="the model's Hub config.json",
    )
    p.add_argument("--tokens", type=int, default=8192, help="tokens of each response")
    p.add_argument("--requests", type=int, default=16, help="responses per round")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", default="0,4", help="generation workers to compare, comma-separated")
    p.add_argument("--out")
    args = p.parse_args()
    profile = Profile.load(args.profile)
    config = json.loads(Path(args.config).read_text())
    shape = model_shape(config)
    lines = [
        f"## Engine client CPU per response: {profile.name} ({shape.num_layers} layers, top-{shape.topk}), "
        f"{args.tokens}-token responses with routing and top-16 kept sets, {args.requests} per round, "
        f"{args.concurrency} in flight (median of {args.repeats} rounds)",
        "",
        "| generation workers | client process CPU ms/response | workers' CPU ms/response | wall ms/response |",
        "|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory(prefix="moerl-client-cpu-") as tmp:
        model = model_dir(Path(args.profile), Path(args.config), Path(tmp))
        pool = EnginePool(
            EnginePoolConfig(
                model_path=str(model),
                server="simulated",
                simulate=args.profile,
                time_scale=1e6,
                base_port=0,
                dtype=profile.dtype,
                log_dir=tmp,
            )
        )
        with pool:
            for workers in (int(w) for w in args.workers.split(",")):
                measured = asyncio.run(rounds(pool.urls[0], shape, args, workers))
                client_s, workers_s, wall_s = (statistics.median(x[i] for x in measured) for i in range(3))
                lines.append(f"| {workers} | {client_s * 1e3:.1f} | {workers_s * 1e3:.1f} | {wall_s * 1e3:.1f} |")
                print(lines[-1], file=sys.stderr, flush=True)
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
