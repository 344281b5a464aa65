"""Weight updates, versions, pause/continue and abort on a real embedded server (own process, since
these tests change its weights)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest

from moerl.engines.client import EngineClient
from moerl.models.tiny import save_tiny_hf
from tests.engine_server import running_server

ARCH = "Qwen2MoeForCausalLM"
PROMPT = [5, 80, 33, 140, 2, 19]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture
def models(tmp_path):
    return save_tiny_hf(ARCH, tmp_path / "base"), save_tiny_hf(ARCH, tmp_path / "other", seed=1)


@pytest.fixture
def server(models, tmp_path):
    with running_server(models[0], tmp_path / "serve.log") as url:
        yield url


async def _stream_until_tokens(session, url, body, n):
    """Start a streaming /generate; return (task finishing the stream, last chunk) once n tokens are out."""
    resp = await session.post(url + "/generate", json={**body, "stream": True})
    chunks = []
    async for line in resp.content:
        if line.startswith(b"data: {"):
            chunks.append(json.loads(line[6:]))
            if len(chunks[-1]["output_ids"]) >= n:
                break

    async def rest():
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[6:]))
        resp.release()
        return chunks[-1]

    return asyncio.ensure_future(rest())


def test_weight_update_from_disk_changes_outputs_and_bumps_the_version(server, models):
    async def go():
        async with EngineClient([server]) as client:
            before = (await client.generate(PROMPT, GREEDY))[0]
            assert await client.weight_versions() == ["default"]
            await client.update_weights_from_disk(str(models[1]), weight_version="v2")
            after = (await client.generate(PROMPT, GREEDY))[0]
            assert await client.weight_versions() == ["v2"]
            await client.update_weights_from_disk(str(models[0]), weight_version="v3")
            restored = (await client.generate(PROMPT, GREEDY))[0]
            return before, after, restored

    before, after, restored = asyncio.run(go())
    assert not np.array_equal(before.output_ids, after.output_ids)
    assert np.array_equal(before.output_ids, restored.output_ids)
    assert after.weight_versions == [{"version": "v2", "start": 0, "end": 8}]
    assert restored.weight_versions == [{"version": "v3", "start": 0, "end": 8}]


def test_in_place_update_mid_generation_splits_the_version_spans(server, models):
    async def go():
        async with aiohttp.ClientSession() as session, EngineClient([server]) as client:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "sampling_seed": 0}}
            finish = await _stream_until_tokens(session, server, body, 3)
            await client.pause("in_place")
            await client.update_weights_from_disk(str(models[1]), weight_version="v2")
            await client.resume()
            return await finish

    final = asyncio.run(go())
    spans = final["meta_info"]["weight_versions"]
    assert len(final["output_ids"]) == 400
    assert [s["version"] for s in spans] == ["default", "v2"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 400
    assert 3 <= spans[0]["end"] < 400


def test_abort_returns_the_partial_output(server):
    async def go():
        async with aiohttp.ClientSession() as session, EngineClient([server]) as client:
            body = {"input_ids": PROMPT, "rid": "long-one", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
            finish = await _stream_until_tokens(session, server, body, 2)
            await client.abort("long-one")
            return await finish

    final = asyncio.run(go())
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert 2 <= len(final["output_ids"]) < 2000


def test_pause_holds_requests_until_continue(server):
    async def go():
        async with EngineClient([server]) as client:
            await client.pause("in_place")
            task = asyncio.ensure_future(client.generate(PROMPT, GREEDY))
            await asyncio.sleep(1.0)
            held = not task.done()
            await client.resume()
            (c,) = await asyncio.wait_for(task, 60)
            return held, c

    held, c = asyncio.run(go())
    assert held and len(c.output_ids) == 8


def test_pause_with_abort_finishes_running_requests(server):
    async def go():
        async with aiohttp.ClientSession() as session, EngineClient([server]) as client:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
            finish = await _stream_until_tokens(session, server, body, 2)
            await client.pause("abort")
            final = await finish
            await client.resume()
            (after,) = await client.generate(PROMPT, GREEDY)
            return final, after

    final, after = asyncio.run(go())
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(after.output_ids) == 8


def test_retract_resumes_with_the_same_output_prefix(server, models):
    async def go():
        async with aiohttp.ClientSession() as session, EngineClient([server]) as client:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True, "sampling_seed": 4}}
            finish = await _stream_until_tokens(session, server, body, 3)
            await client.pause("retract")
            await client.resume()
            return await finish

    final = asyncio.run(go())
    assert len(final["output_ids"]) == 300
    assert final["meta_info"]["finish_reason"]["type"] == "length"
