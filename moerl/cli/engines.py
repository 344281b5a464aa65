"""``moerl engines``: SGLang replicas on this node for a job whose trainer runs on other nodes."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import signal
import socket
import sys
from pathlib import Path
from typing import get_args

from moerl.engines import sglang
from moerl.engines.pool import EnginePool, route_address
from moerl.engines.sglang import lora_target_modules, sglang_problem
from moerl.megatron.lora_config import LoRAConfig
from moerl.orchestrator.config import EngineDtype, EngineSection


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moerl engines",
        description=(
            "Start SGLang replicas on this node's GPUs with the flags moerl's RL loop needs (routed experts, sampling "
            "masks, memory saver, LoRA), wait until each is healthy, print their URLs and keep them up until "
            "interrupted. Give the URLs to the job: engines.urls=[...]."
        ),
    )
    p.add_argument("--model", required=True, help="HF model directory (the one the job trains)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--gpus-per-replica", type=int, default=1, help="tensor-parallel size of each replica")
    p.add_argument("--base-port", type=int, default=30000, help="replica i serves on base-port + i")
    p.add_argument("--dtype", choices=get_args(EngineDtype), default="bfloat16")
    p.add_argument("--mem-fraction-static", type=float, default=0.8)
    p.add_argument(
        "--lora-max-rank", type=int, default=None, help="serve LoRA adapters up to this rank (the job's lora.rank)"
    )
    p.add_argument(
        "--lora-targets",
        nargs="+",
        default=LoRAConfig().targets,
        metavar="PATTERN",
        help="the job's lora.targets (megatron module patterns; default: %(default)s): the replicas serve LoRA on "
        "their Hub modules only",
    )
    p.add_argument("--log-dir", default="engine-logs")
    p.add_argument(
        "--server",
        choices=["sglang", "embedded"],
        default="sglang",
        help="sglang, or moerl's embedded engine (the same HTTP API, one device or the CPU, no tensor parallelism)",
    )
    p.add_argument(
        "--host",
        default=None,
        help="the address the replicas serve on and the job reaches them at (default: this node's address on its "
        "default route)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = (sglang_problem() or sglang.served_wrong(args.model)) if args.server == "sglang" else None
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    host = args.host or route_address()
    if host is None or (not args.host and ipaddress.ip_address(host).is_loopback):
        print(
            f"error: {socket.gethostname()} has no default route and resolves to a loopback address: pass --host, the "
            "address the trainer nodes reach this node at",
            file=sys.stderr,
        )
        return 2
    # the job's own engine settings (components.pool_config), on the ports asked for rather than free ones
    section = EngineSection(
        replicas=args.replicas,
        gpus_per_replica=args.gpus_per_replica,
        dtype=args.dtype,
        mem_fraction_static=args.mem_fraction_static,
    )
    from moerl.orchestrator.components import pool_config  # imports megatron-core: after --help and the checks

    config = pool_config(
        section,
        args.model,
        args.server,
        Path(args.log_dir),
        0,
        host=host,
        lora_max_rank=args.lora_max_rank,
        lora_target_modules=lora_target_modules(args.model, args.lora_targets) if args.lora_max_rank else None,
    )
    pool = EnginePool(dataclasses.replace(config, base_port=args.base_port))
    pool.start()
    print("engines.urls=[" + ",".join(pool.replica_urls) + "]", flush=True)
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # delivered to sigwait, not as KeyboardInterrupt
    try:
        signal.sigwait(stop)
    finally:
        pool.stop()
    return 0
