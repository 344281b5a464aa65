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
    from moerl.engines.embedded.engine import EmbeddedEngine
    from moerl.engines.embedded.server import build_app

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
            # Only what was released: SGLang's scheduler fails on a tag it did not release.
            status, answer, _ = await _request(url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
            assert status == 400 and "cuda_graph were not released" in answer["error"]["message"], answer
            assert (await _request(url, "/resume_memory_occupation", {"tags": ["kv_cache"]}))[0] == 200
            assert (await _request(url, "/continue_generation", {}))[0] == 200
            status, after, _ = await waiting
            assert status == 200 and after["output_ids"] == before["output_ids"]
            assert (await _request(url, "/weights_checker", {}))[1] == checked

    asyncio.run(go())
    assert not engine.released


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return save_tiny_hf("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("tensor") / "model")


def test_weights_handed_over_in_shared_memory_are_served_bitwise(small_model):
    """/update_weights_from_tensor, the colocated push: flattened buckets in shared memory, after the weights were
    released and resumed (uninitialised), serve what was pushed; a push of other values serves those."""
    from moerl.engines import tensor_ipc
    from moerl.engines.embedded.engine import EmbeddedEngine
    from moerl.engines.embedded.server import build_app

    engine = EmbeddedEngine(str(small_model))
    named = engine.read_model_dir(str(small_model))
    halves = [named[: len(named) // 2], named[len(named) // 2 :]]

    def body(part, **extra):
        payload = tensor_ipc.serialize(tensor_ipc.flattened_bucket(part))
        return {"serialized_named_tensors": [payload], "load_format": "flattened_bucket", **extra}

    scored = {**GREEDY, "return_logprob": True}

    async def go():
        async with serving_app(build_app(engine)) as url:
            _, before, _ = await _request(url, "/generate", scored)
            _, checked, _ = await _request(url, "/weights_checker", {})
            assert (await _request(url, "/pause_generation", {"mode": "retract"}))[0] == 200
            assert (await _request(url, "/release_memory_occupation", {}))[0] == 200
            status, answer, _ = await _request(url, "/update_weights_from_tensor", body(halves[0]))
            assert status == 400 and "must run between /begin_weight_update" in answer["error"]["message"]  # as SGLang
            assert (await _request(url, "/begin_weight_update", {}))[0] == 200
            status, answer, _ = await _request(url, "/update_weights_from_tensor", body(halves[0]))
            assert status == 400 and "weights are released" in answer["error"]["message"]
            assert (await _request(url, "/resume_memory_occupation", {"tags": ["weights"]}))[0] == 200
            for i, part in enumerate(halves):
                status, answer, _ = await _request(
                    url, "/update_weights_from_tensor", body(part, weight_version="7" if i else None)
                )
                assert status == 200, answer
            assert (await _request(url, "/end_weight_update", {}))[0] == 200
            assert (await _request(url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}))[0] == 200
            assert (await _request(url, "/continue_generation", {}))[0] == 200
            status, after, _ = await _request(url, "/generate", scored)
            assert status == 200 and after["output_ids"] == before["output_ids"]
            # to the last bit: weights allocated again compute as those loaded did (the loaded ones are aligned too)
            logprobs = [answer["meta_info"]["output_token_logprobs"] for answer in (before, after)]
            assert logprobs[0] == logprobs[1]
            assert (await _request(url, "/weights_checker", {}))[1] == checked
            assert (await _request(url, "/model_info", method="GET"))[1]["weight_version"] == "7"
            # Other values, as (name, tensor) pairs: served as pushed.
            name, norm = next((n, t) for n, t in named if n == "model.norm.weight")
            pairs = {"serialized_named_tensors": [tensor_ipc.serialize([(name, norm * 3)])]}
            assert (await _request(url, "/begin_weight_update", {}))[0] == 200
            assert (await _request(url, "/update_weights_from_tensor", pairs))[0] == 200
            assert (await _request(url, "/end_weight_update", {}))[0] == 200
            _, values, _ = await _request(url, "/get_weights_by_name", {"name": name})
            assert values == (norm * 3).float().tolist()

    asyncio.run(go())


def test_the_globals_a_cuda_handle_names_are_admitted():
    """torch's reduction of a CUDA tensor names its rebuild and its storage's class, a TypedStorage (the CPU's file
    handles name an UntypedStorage): the engine's unpickler admits both, or no colocated push on a GPU is taken."""
    import io
    import pickle

    import torch
    from torch.multiprocessing import reductions

    from moerl.engines import tensor_ipc

    storage_class = type(torch.zeros(1)._typed_storage())  # what reduce_tensor passes as rebuild_cuda_tensor's
    raw = pickle.dumps([reductions.rebuild_cuda_tensor, storage_class, torch.bfloat16, torch.Size([2])])
    rebuild, storage, dtype, size = tensor_ipc._Unpickler(io.BytesIO(raw)).load()
    assert storage is storage_class and dtype is torch.bfloat16 and size == torch.Size([2])
    assert rebuild is not reductions.rebuild_cuda_tensor  # moerl's, which maps a GPU's UUID to its index


def test_a_bad_tensor_payload_is_refused_naming_it_and_changes_nothing(small_model):
    import base64
    import os
    import pickle
    import types

    import torch

    from moerl.engines import tensor_ipc
    from moerl.engines.embedded.engine import EmbeddedEngine
    from moerl.engines.embedded.server import build_app

    engine = EmbeddedEngine(str(small_model))
    name, norm = next((n, t) for n, t in engine.read_model_dir(str(small_model)) if n == "model.norm.weight")
    bucket = tensor_ipc.flattened_bucket([(name, norm)])
    outside = {**bucket, "metadata": [types.SimpleNamespace(**{**vars(bucket["metadata"][0]), "end_idx": 10**6})]}
    code = base64.b64encode(pickle.dumps((os.system, ("true",)))).decode()
    field = "serialized_named_tensors"
    cases = [  # (body, what the refusal names)
        ({field: [code]}, (field, "posix.system is not allowed")),
        ({field: ["%%%"]}, (field, "not base64")),
        ({field: [tensor_ipc.serialize(bucket)] * 2}, (field, "one entry")),
        ({field: [tensor_ipc.serialize([(name, norm)])], "load_format": "flattened_bucket"}, (field, "bucket")),
        ({field: [tensor_ipc.serialize(outside)], "load_format": "flattened_bucket"}, (field, "metadata[0]")),
        ({field: [tensor_ipc.serialize({"x": norm})]}, (field, "(name, tensor) pairs")),
        ({field: []}, (field,)),
        ({field: [tensor_ipc.serialize([("model.nothing", norm)])]}, ("model.nothing",)),
        ({field: [tensor_ipc.serialize([(name, norm[:3])])]}, (name,)),
        ({field: [tensor_ipc.serialize(bucket)], "load_format": "direct"}, ("load_format",)),
    ]

    async def go():
        async with serving_app(build_app(engine)) as url:
            _, checked, _ = await _request(url, "/weights_checker", {})
            assert (await _request(url, "/begin_weight_update", {}))[0] == 200
            for payload, named in cases:
                status, answer, _ = await _request(url, "/update_weights_from_tensor", payload)
                assert status == 400 and all(part in answer["error"]["message"] for part in named), (named, answer)
            assert (await _request(url, "/weights_checker", {}))[1] == checked

    asyncio.run(go())
    assert torch.equal(dict(engine.read_model_dir(str(small_model)))[name], norm)
