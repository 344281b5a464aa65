"""``moerl serve``: the embedded engine, or with ``--simulate`` a simulated one, over SGLang's HTTP API."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from aiohttp import web

from moerl.dtypes import MODEL_DTYPES
from moerl.engines import protocol
from moerl.engines.embedded.server import EmbeddedEngine, build_app
from moerl.engines.simulated import Profile, SimulatedEngine
from moerl.errors import ConfigError, MoerlError

log = logging.getLogger("moerl.serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moerl serve",
        description="Serve a HF MoE model with moerl's embedded engine over SGLang's HTTP API "
        "(routed experts, sampling masks, weight versions, pause/continue, weight updates).",
    )
    p.add_argument("--model", help="local HF model directory (with --simulate: its config and tokenizer, in place of the profile's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", choices=sorted(MODEL_DTYPES), default="float32")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--sampling-mask-max-tokens", type=int, default=protocol.DEFAULT_SAMPLING_MASK_MAX_TOKENS)
    p.add_argument("--simulate", metavar="PROFILE", help="serve no model: a simulated engine with this profile's throughput "
                   "and response lengths (a YAML file: see moerl/engines/simulated.py; the tests' is tests/data/simulation/tiny.yaml)")
    p.add_argument("--time-scale", type=float, default=1.0, help="with --simulate: simulated seconds per real second")
    return p


def _engine(args: argparse.Namespace) -> EmbeddedEngine:
    profile = None
    if args.simulate:
        profile = Profile.load(args.simulate)
    model = args.model or (profile.model if profile is not None else None)
    if model is None:
        raise ConfigError("give --model (a HF model directory)" + (f"; profile {args.simulate} names none" if profile else ""))
    if not Path(model, "config.json").is_file():
        raise ConfigError(f"{model} is not a HF model directory (no config.json)")
    if profile is not None:
        return SimulatedEngine(profile, model, args.time_scale, args.sampling_mask_max_tokens)
    return EmbeddedEngine(model, MODEL_DTYPES[args.dtype], args.device, args.max_running_requests, args.sampling_mask_max_tokens)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        engine = _engine(args)
    except MoerlError as e:
        print(f"error: {e}", flush=True)
        return 2
    # On SIGTERM, requests still open (a join whose peers never came, say) get a few seconds, not a minute.
    web.run_app(build_app(engine), host=args.host, port=args.port, shutdown_timeout=5,
                print=lambda *a: log.info("serving %s on http://%s:%d", engine.model_dir, args.host, args.port))
    return 0
