"""``moerl serve``: the embedded engine, or with ``--simulate`` a simulated one, over SGLang's HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import signal
from pathlib import Path

from aiohttp import web

from moerl.checkpoint.hf import read_config
from moerl.dtypes import MODEL_DTYPES
from moerl.engines import protocol
from moerl.engines.embedded.classifier import ClassifierEngine, ProcessRewardEngine, build_classifier_app
from moerl.engines.embedded.engine import EmbeddedEngine
from moerl.engines.embedded.scheduler import DEFAULT_PREFIX_CACHE_TOKENS
from moerl.engines.embedded.server import build_app
from moerl.engines.simulated import SimulatedEngine
from moerl.errors import ConfigError, MoerlError
from moerl.models import is_classifier, is_process_reward_model
from moerl.simulation import Profile

log = logging.getLogger("moerl.serve")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moerl serve",
        description="Serve a HF MoE model with moerl's embedded engine over SGLang's HTTP API "
        "(routed experts, sampling masks, weight versions, pause/continue, weight updates).",
    )
    p.add_argument(
        "--model",
        help="local HF model directory (with --simulate: its config and tokenizer, in place of the profile's); a "
        "sequence-classification model is served as a reward model, at /classify; a token-classification one as a "
        "process reward model, at /step_scores",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", choices=sorted(MODEL_DTYPES), default="float32")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--sampling-mask-max-tokens", type=int, default=protocol.DEFAULT_SAMPLING_MASK_MAX_TOKENS)
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        help="tokens the prefix cache holds at most, KV and routing of earlier prompts and completions, reused "
        "within the same extra_key / cache_salt / adapter as SGLang's radix cache (0: no prefix cache; default "
        f"{DEFAULT_PREFIX_CACHE_TOKENS}, or with --simulate the profile's engine.prefix_cache_tokens where it names "
        "one)",
    )
    p.add_argument(
        "--enable-weights-cpu-backup",
        action="store_true",
        help="keep released weights in host memory and restore them on resume, as SGLang's flag of this name (for a "
        "model no weight update reaches, such as a colocated reward model); without it they come back uninitialised",
    )
    p.add_argument(
        "--simulate",
        metavar="PROFILE",
        help="serve no model: a simulated engine with this profile's throughput "
        "and response lengths (a YAML file: see moerl/simulation.py; the tests' is tests/data/simulation/tiny.yaml)",
    )
    p.add_argument("--time-scale", type=float, default=1.0, help="with --simulate: simulated seconds per real second")
    p.add_argument(
        "--ports",
        type=_ports,
        help="with --simulate: serve one replica on each of these ports (comma-separated), "
        "all in this process, in place of --port: many simulated replicas cost one interpreter",
    )
    return p


def _ports(text: str) -> list[int]:
    try:
        ports = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ports") from None
    if len(set(ports)) != len(ports):
        raise argparse.ArgumentTypeError(f"{text!r} names a port twice")
    return ports


Served = EmbeddedEngine | ClassifierEngine


def _app(engine: Served) -> web.Application:
    return build_classifier_app(engine) if isinstance(engine, ClassifierEngine) else build_app(engine)


def _engines(args: argparse.Namespace) -> list[Served]:
    """One engine per port served: a model that generates, a simulated one, a reward model or a process reward
    model."""
    if args.ports and not args.simulate:
        raise ConfigError(
            "--ports serves several simulated replicas: it needs --simulate (a model's engine serves on --port)"
        )
    profile = None
    if args.simulate:
        profile = Profile.load(args.simulate)
    model = args.model or (profile.model if profile is not None else None)
    if model is None:
        raise ConfigError(
            "give --model (a HF model directory)" + (f"; profile {args.simulate} names none" if profile else "")
        )
    if not Path(model, "config.json").is_file():
        raise ConfigError(f"{model} is not a HF model directory (no config.json)")
    if profile is not None:
        _return_freed_answers()
        return [
            SimulatedEngine(profile, model, args.time_scale, args.sampling_mask_max_tokens, args.prefix_cache_tokens)
            for _ in args.ports or [args.port]
        ]
    architectures = read_config(model).get("architectures") or []
    if is_classifier(architectures):
        # a reward model: /classify
        return [ClassifierEngine(model, MODEL_DTYPES[args.dtype], args.device, args.enable_weights_cpu_backup)]
    if is_process_reward_model(architectures):
        # a process reward model: /step_scores
        return [ProcessRewardEngine(model, MODEL_DTYPES[args.dtype], args.device, args.enable_weights_cpu_backup)]
    return [
        EmbeddedEngine(
            model,
            MODEL_DTYPES[args.dtype],
            args.device,
            args.max_running_requests,
            args.sampling_mask_max_tokens,
            DEFAULT_PREFIX_CACHE_TOKENS if args.prefix_cache_tokens is None else args.prefix_cache_tokens,
            args.enable_weights_cpu_backup,
        )
    ]


def _return_freed_answers() -> None:
    """glibc raises its mmap threshold to the largest block freed (up to 32 MB). After the first long answer, a
    simulated replica's answers of tens of MB come from the heap and stay in the process once freed: a process of 4
    replicas of Qwen3-30B-A3B held 1.2 GB instead of 0.9. A fixed threshold keeps each in a mapping of its own, returned
    when freed."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # glibc's; other C libraries keep their own ways
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, 256 << 10)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        engines = _engines(args)
    except MoerlError as e:
        print(f"error: {e}", flush=True)
        return 2
    ports = args.ports or [args.port]
    if len(engines) == 1:
        # On SIGTERM, requests still open (a join whose peers never came, say) get a few seconds, not a minute.
        engine = engines[0]
        web.run_app(
            _app(engine),
            host=args.host,
            port=ports[0],
            shutdown_timeout=5,
            print=lambda *a: log.info("serving %s on http://%s:%d", engine.model_dir, args.host, ports[0]),
        )
    else:
        asyncio.run(_serve_all(engines, args.host, ports))
    return 0


async def _serve_all(engines: list[Served], host: str, ports: list[int]) -> None:
    """Each engine's app on its port, in this one event loop, until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runners: list[web.AppRunner] = []
    try:
        for engine, port in zip(engines, ports, strict=True):  # one engine per port (_engines)
            runner = web.AppRunner(_app(engine), shutdown_timeout=5)
            runners.append(runner)
            await runner.setup()
            await web.TCPSite(runner, host, port).start()
        log.info(
            "serving %d simulated replicas of %s on http://%s:{%s}",
            len(engines),
            engines[0].model_dir,
            host,
            ",".join(map(str, ports)),
        )
        await stop.wait()
    finally:
        # All at once: each may wait its shutdown_timeout for open requests, within the pool's grace for the process.
        await asyncio.gather(*(runner.cleanup() for runner in runners), return_exceptions=True)
