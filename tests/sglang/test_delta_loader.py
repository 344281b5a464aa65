"""moerl's delta loader in SGLang 0.5.23's own server (``--custom-weight-loader moerl.engines.delta.apply_delta``): a
delta push leaves the engine holding, bit for bit, what a full push of the same weights does. Payloads travel in the
request (moerl.engines.delta.inline_payload), not in shared memory."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from moerl.engines.client import EngineClient
from moerl.engines.delta import LOAD_FORMAT, SEP, encode, inline_payload
from moerl.engines.pool import EnginePool, EnginePoolConfig

pytestmark = [pytest.mark.sglang, pytest.mark.e2e, pytest.mark.usefixtures("sglang_python")]

PROMPT = [3, 17, 42, 99, 7, 23, 5, 61, 11, 255, 18, 150]


def changed(tensor: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    which = torch.rand(tensor.shape, generator=g) < fraction
    return torch.where(which, tensor + 0.05 * torch.randn(tensor.shape, generator=g), tensor)


async def push(client: EngineClient, named: list[tuple[str, torch.Tensor]], load_format: str | None) -> None:
    """One update, as moerl's pushes make them: within a weight-update session, the bytes inline."""
    (url,) = client.urls
    await client.begin_weight_update()
    body = {"serialized_named_tensors": [inline_payload(named)], "load_format": load_format, "flush_cache": True}
    async with aiohttp.ClientSession() as session, session.post(f"{url}/update_weights_from_tensor", json=body) as r:
        assert r.status == 200, await r.text()
    await client.end_weight_update()


async def state(client: EngineClient) -> tuple[str | None, np.ndarray]:
    ((checksum,), (logprobs,)) = await asyncio.gather(client.weight_checksums(), client.prompt_logprobs(PROMPT))
    return checksum, logprobs


def test_delta_push_equals_full_push(sglang_python, model, tmp_path, monkeypatch):
    # The pool registers the loader with every generating server, and puts moerl on its path: the server starts away
    # from this checkout, where nothing else would let it import moerl.
    monkeypatch.chdir(tmp_path)
    cfg = EnginePoolConfig(model_path=str(model), server="sglang", base_port=0, dtype="float32", log_dir=str(tmp_path))
    a = load_file(model / "model.safetensors")
    # Most tensors a few elements changed (indices), some a fifth (mask), the norms all (whole), one none.
    b = {
        name: changed(t, 1.0 if "norm" in name else [0.01, 0.2][i % 2], seed=i) for i, (name, t) in enumerate(a.items())
    }
    b["model.layers.0.mlp.experts.3.up_proj.weight"] = a["model.layers.0.mlp.experts.3.up_proj.weight"]

    def delta(previous, current):
        return [pair for name in current for pair in encode(name, previous[name], current[name]).named]

    forth, back = delta(a, b), delta(b, a)
    assert {name.partition(SEP)[2] for name, _ in forth} == {"", "shape", "indices", "mask", "values"}
    assert sum(t.numel() * t.element_size() for _, t in forth) < sum(t.numel() * t.element_size() for t in b.values())

    async def run():
        async with EngineClient(pool.urls) as client:
            served_a = await state(client)
            await push(client, list(b.items()), None)
            full_b = await state(client)
            await push(client, list(a.items()), None)
            assert (await client.weight_checksums()) == [served_a[0]]  # a full push of A: A again
            await push(client, forth, LOAD_FORMAT)
            delta_b = await state(client)
            await push(client, back, LOAD_FORMAT)  # through the copies recorded on the way forth
            delta_a = await state(client)
        return served_a, full_b, delta_b, delta_a

    pool = EnginePool(cfg, python=sglang_python)
    pool.start(timeout_s=300)
    try:
        served_a, full_b, delta_b, delta_a = asyncio.run(run())
    finally:
        pool.stop()
    # stopped, not crashed: on the CPU no diagnostics (a 5 s wait, a py-spy dump) at each stop
    assert "crash diagnostics" not in (tmp_path / "sglang-0.log").read_text()
    assert served_a[0] is not None and full_b[0] != served_a[0]
    assert delta_b[0] == full_b[0]
    assert np.array_equal(delta_b[1], full_b[1])
    assert delta_a[0] == served_a[0]
    assert np.array_equal(delta_a[1], served_a[1])
