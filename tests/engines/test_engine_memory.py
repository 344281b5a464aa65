"""The embedded engine's memory occupation routes (SGLang's, for colocated training): released memory is given back,
generation waits while it is, and after the weights are resumed and pushed the engine serves them bitwise."""

from __future__ import annotations

import asyncio

import psutil
import pytest

from moerl.models.tiny import save_tiny_hf
from tests.engine_server import serving_app
from tests.engines.test_engine_requests import GREEDY, _request

# Weights large enough to see in the resident memory of this process: about 200 MB in fp32.
LARGE = dict(hidden_size=256, moe_intermediate_size=512, num_experts=32, num_hidden_layers=4)


@pytest.fixture(scope="module")
def large_model(tmp_path_factory):
    return save_tiny_hf("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("memory") / "model", **LARGE)


def resident() -> int:
    return psutil.Process().memory_info().rss


def test_released_memory_is_given_back_and_the_pushed_weights_are_served_bitwise(large_model):
    from moerl.engines.embedded.server import EmbeddedEngine, build_app

    engine = EmbeddedEngine(str(large_model))
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert weight_bytes > 150e6

    async def go():
        async with serving_app(build_app(engine)) as url:
            status, before, _ = await _request(url, "/generate", GREEDY)
            assert status == 200
            _, checked, _ = await _request(url, "/weights_checker", {})
            # As SGLang's: only while nothing runs.
            status, answer, _ = await _request(url, "/release_memory_occupation", {})
            assert status == 400 and "pause generation" in answer["error"]["message"]
            assert (await _request(url, "/pause_generation", {"mode": "retract"}))[0] == 200
            held = resident()
            status, answer, _ = await _request(url, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
            assert status == 200, answer
            released = resident()
            assert held - released > 0.8 * weight_bytes
            assert "weights" in engine.released and all(p.numel() == 0 for p in engine.model.parameters())
            # A request while released waits, as it would while paused; nothing is generated with no weights.
            waiting = asyncio.create_task(_request(url, "/generate", GREEDY))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            status, answer, _ = await _request(url, "/continue_generation", {})
            assert status == 400 and "kv_cache, weights" in answer["error"]["message"]
            for path, body in (
                ("/update_weights_from_disk", {"model_path": str(large_model)}),
                ("/weights_checker", {}),
                ("/get_weights_by_name", {"name": "model.norm.weight"}),
            ):
                status, answer, _ = await _request(url, path, body)
                assert status == 400 and "weights are released" in answer["error"]["message"], (path, answer)
            status, answer, _ = await _request(url, "/release_memory_occupation", {"tags": ["weights", "heap"]})
            assert status == 400 and "tags" in answer["error"]["message"]
            # The peers' order: the weights back, the push, then the KV cache, then generation.
            assert (await _request(url, "/resume_memory_occupation", {"tags": ["weights"]}))[0] == 200
            status, answer, _ = await _request(url, "/update_weights_from_disk", {"model_path": str(large_model)})
            assert status == 200, answer
            assert resident() - released > 0.8 * weight_bytes
            status, answer, _ = await _request(url, "/continue_generation", {})
            assert status == 400 and "kv_cache" in answer["error"]["message"]
            assert (await _request(url, "/resume_memory_occupation", {}))[0] == 200
            assert (await _request(url, "/continue_generation", {}))[0] == 200
            status, after, _ = await waiting
            assert status == 200 and after["output_ids"] == before["output_ids"]
            assert (await _request(url, "/weights_checker", {}))[1] == checked

    asyncio.run(go())
    assert not engine.released
