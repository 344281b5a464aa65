"""Start a real ``moerl serve`` process on loopback for the engine tests (the job's own engine pool), or, in the
test's own event loop, an aiohttp app standing for a server that misbehaves."""

from __future__ import annotations

from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from moerl.engines.pool import EnginePool, EnginePoolConfig


@contextmanager
def running_server(model_dir: Path, log_dir: Path, *extra: str):
    """One embedded engine serving ``model_dir`` in float32 (``extra``: more ``moerl serve`` flags, which win)."""
    with running_servers(model_dir, log_dir, 1, *extra) as urls:
        yield urls[0]


@contextmanager
def running_servers(model_dir: Path, log_dir: Path, replicas: int, *extra: str):
    """As :func:`running_server`, ``replicas`` of them, each logging to a file of its own in ``log_dir``; yields their
    URLs."""
    with running_pool(model_dir, log_dir, replicas, *extra) as pool:
        yield pool.urls


@contextmanager
def running_pool(model_dir: Path, log_dir: Path, replicas: int, *extra: str):
    """As :func:`running_servers`, yielding the pool that started them (to kill and revive its replicas)."""
    with EnginePool(
        EnginePoolConfig(
            model_path=str(model_dir),
            server="embedded",
            base_port=0,
            dtype="float32",
            replicas=replicas,
            log_dir=str(log_dir),
            extra_args=list(extra),
        )
    ) as pool:
        yield pool


async def weights_by_name(url: str, name: str) -> list:
    """The engine's copy of the Hub tensor ``name``, whole, as nested lists: SGLang's /get_weights_by_name, which no
    moerl code asks (a sync verifies by log-probs and checksums)."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": 1 << 30}) as resp:
            resp.raise_for_status()
            return await resp.json()


@asynccontextmanager
async def serving(routes: dict[tuple[str, str], object]):
    """An aiohttp app on a free loopback port, in this event loop: ``{(method, path): handler}``; yields its base
    URL."""
    from aiohttp import web

    app = web.Application()
    for (method, path), handler in routes.items():
        app.router.add_route(method, path, handler)
    async with serving_app(app) as url:
        yield url


@asynccontextmanager
async def serving_app(app):
    """``app`` on a free loopback port, in this event loop, run as ``moerl serve`` runs it (aiohttp's TestServer instead
    cancels a handler whose client left); yields its base URL."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def two_token_answer(body: dict, version: str, layers: int, topk: int, cached: int = 0):
    """A stand-in engine's /generate answer to ``body``: each of its ``n`` completions two tokens long under weight
    ``version``, with zero routing over ``layers`` and ``topk`` and ``cached`` prompt tokens from the prefix cache."""
    import base64

    import numpy as np
    from aiohttp import web

    prompt = len(body["input_ids"])
    routing = base64.b64encode(np.zeros((prompt + 1, layers, topk), dtype=np.int32).tobytes()).decode()
    meta = {
        "finish_reason": {"type": "stop"},
        "prompt_tokens": prompt,
        "completion_tokens": 2,
        "cached_tokens": cached,
        "weight_version": version,
        "weight_versions": [{"version": version, "start": 0, "end": 2}],
        "output_token_logprobs": [[-1.0, 5, None], [-1.0, 6, None]],
        "routed_experts": routing,
    }
    return web.json_response(
        [
            {"text": "", "output_ids": [5, 6], "meta_info": {**meta, "id": f"{body['rid']}-{i}"}}
            for i in range(body["sampling_params"]["n"])
        ]
    )


def ask_sglang(python: str, asked: dict, scratch: Path) -> dict:
    """What SGLang's own code makes of ``asked`` (check name -> its inputs, tests/engines/sglang_side.py): one run of
    that script in SGLang's interpreter ``python``. Its output goes to a file in ``scratch``, not a pipe: a CPU tensor
    handover's torch_shm_manager keeps an inherited pipe open."""
    import json
    import subprocess

    with open(scratch / "sglang_side.json", "w+") as out:
        subprocess.run(
            [python, str(Path(__file__).parent / "engines" / "sglang_side.py")],
            input=json.dumps(asked).encode(),
            stdout=out,
            check=True,
            timeout=300,
        )
        out.seek(0)
        return json.load(out)
