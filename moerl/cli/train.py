"""``moerl train``: the main job's command line, one trainer rank; ``--launch`` (what ``recipes/qwen_moe_grpo.sh``
runs) checks the run, then starts its ranks through torchrun. The job itself is :mod:`moerl.orchestrator.job`, imported
only to run it: checking a run, its config or its memory plan needs none of megatron-core.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from types import FrameType

import torch
import torch.distributed as dist

from moerl.errors import ConfigError, MoerlError
from moerl.orchestrator.config import load_config, to_yaml
from moerl.orchestrator.preflight import memory_plan, preflight, trainer_world_size


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="moerl train",
        description="GRPO on a Qwen MoE model: Megatron trainer + SGLang (or embedded) engines, with routing and "
        "sampling-mask replay, in sync, periodic or async mode. Run through recipes/qwen_moe_grpo.sh (torchrun).",
        epilog="Overrides are omegaconf dotlist entries, e.g. run.mode=sync run.steps=20 trainer.ep=2 "
        "model.path=/models/Qwen3-30B-A3B",
    )
    p.add_argument("--config", help="YAML config (default: none; the schema's defaults)")
    p.add_argument(
        "--check",
        action="store_true",
        help="check the config, model, task and engine URLs as the job would, print the number of trainer ranks it "
        "needs, and exit",
    )
    p.add_argument(
        "--launch",
        action="store_true",
        help="check the run as --check does, then start its trainer ranks on this node through torchrun "
        "(torch.distributed.run --standalone, in this process; MOERL_MAX_RESTARTS=N: its --max-restarts)",
    )
    p.add_argument(
        "--show-config",
        action="store_true",
        help="print the whole resolved config (every key, with overrides) and exit",
    )
    p.add_argument(
        "--show-plan",
        action="store_true",
        help="print the memory plan (per trainer rank and engine GPU, from the model's config.json alone) and exit",
    )
    p.add_argument("overrides", nargs="*", help="section.key=value")
    return p.parse_intermixed_args(argv)  # flags and overrides in any order


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("megatron").setLevel(
        logging.WARNING
    )  # its per-bucket parameter listings drown the run's own lines
    try:
        cfg = load_config(args.config, args.overrides)
    except MoerlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.show_config:
        print(to_yaml(cfg), end="")
        return 0
    try:
        if args.check or args.launch:  # a single-node launch: torchrun starts this many ranks here
            world = trainer_world_size(cfg)
            if torch.cuda.is_available() and world > torch.cuda.device_count():
                raise ConfigError(
                    f"the trainer needs {world} GPUs and this node has {torch.cuda.device_count()}: launch it across "
                    "nodes with torchrun --nnodes N ... --no-python recipes/qwen_moe_grpo.sh (see "
                    "recipes/qwen3_30b_a3b.yaml)"
                )
            preflight(cfg, world)
            if args.launch:
                return launch(world, [arg for arg in (sys.argv[1:] if argv is None else argv) if arg != "--launch"])
            print(world)
            return 0
        if args.show_plan:
            plan = memory_plan(cfg, int(os.environ.get("WORLD_SIZE", trainer_world_size(cfg))), checked=False)
            print(plan.table())
            for problem in plan.problems:
                print(f"error: memory plan: {problem}", file=sys.stderr)
            return 2 if plan.problems else 0
        # torchrun stops the other ranks with SIGTERM when one fails: the job's teardown still runs (engines and
        # rollout manager stopped, accounting written).
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        from moerl.orchestrator.job import Job

        summary = Job(cfg).run()
    except MoerlError as e:
        if not (e.relayed or e.said):
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if summary is not None:
        print(
            f"done: {cfg.run.dir} (metrics.jsonl, tensorboard/, accounting.json; plot with: moerl plot {cfg.run.dir})"
        )
    return 0


def launch(world: int, argv: list[str]) -> int:
    """``torchrun --standalone --nproc-per-node WORLD -m moerl.cli train ARGV`` in this process, whose interpreter and
    torch import serve the check and torchrun alike (seconds of every job's start on a CPU). A rank that fails raises
    torchrun's ChildFailedError, as the torchrun command does."""
    from torch.distributed.run import main as torchrun

    logging.getLogger().setLevel(logging.WARNING)  # torchrun's own INFO lines, as its command shows them: not at all
    torchrun(
        ["--standalone", "--max-restarts", os.environ.get("MOERL_MAX_RESTARTS", "0"), "--nproc-per-node", str(world)]
        + ["-m", "moerl.cli", "train", *argv]
    )
    return 0


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Once: a second SIGTERM (torchrun's, then the rank's own once torchrun is gone) would cut the teardown short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)
