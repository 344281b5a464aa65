"""A reward model served as SGLang serves one (/classify): the scores are the model's own, every bad input is refused
naming what is wrong, and ``moerl serve`` serves such a model by its architecture."""

from __future__ import annotations

import asyncio

import pytest
import torch

from moerl.models.tiny import save_tiny_hf
from tests.engine_server import serving_app
from tests.engines.test_engine_requests import _request

ARCH = "Qwen3ForSequenceClassification"
INPUTS = [[5, 6, 7, 8], [9, 10], [40, 41, 42, 43, 44, 45]]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return save_tiny_hf(ARCH, tmp_path_factory.mktemp("reward") / "model")


@pytest.fixture(scope="module")
def engine(reward_model):
    from moerl.engines.embedded.classifier import ClassifierEngine

    return ClassifierEngine(str(reward_model))


def test_served_scores_are_the_models_own_one_input_or_a_batch_by_ids_or_text(reward_model, engine):
    from transformers import AutoModelForSequenceClassification

    from moerl.engines.embedded.classifier import build_classifier_app
    from moerl.engines.embedded.runner import own_weights

    model = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    own_weights(model)  # aligned, as the engine's are: the CPU's matmuls round unaligned operands otherwise
    with torch.no_grad():
        expected = [model(torch.tensor([ids])).logits[0].tolist() for ids in INPUTS]
    text = "2+3=5"
    text_ids = engine.tokenizer(text)["input_ids"]

    async def go():
        async with serving_app(build_classifier_app(engine)) as url:
            status, batch, _ = await _request(url, "/classify", {"input_ids": INPUTS, "rid": ["a", "b", "c"]})
            assert status == 200 and [a["embedding"] for a in batch] == expected
            assert [a["meta_info"] for a in batch] == [
                {"id": rid, "prompt_tokens": len(ids)} for rid, ids in zip("abc", INPUTS, strict=True)
            ]
            status, one, _ = await _request(url, "/classify", {"input_ids": INPUTS[1]}, method="PUT")
            assert status == 200 and one["embedding"] == expected[1]
            _, by_text, _ = await _request(url, "/classify", {"text": text})
            _, by_ids, _ = await _request(url, "/classify", {"input_ids": text_ids})
            assert by_text["embedding"] == by_ids["embedding"]
            assert by_text["meta_info"]["prompt_tokens"] == len(text_ids)
            status, info, _ = await _request(url, "/model_info", method="GET")
            assert status == 200 and info["is_generation"] is False

    asyncio.run(go())


@pytest.mark.parametrize(
    "body, named",
    [
        ({}, "give text or input_ids"),
        ({"text": "a", "input_ids": [1]}, "give text or input_ids"),
        ({"input_ids": []}, "an input is empty"),
        ({"text": []}, "a batch holds 1 to"),
        ({"input_ids": [[1], []]}, "an input is empty"),
        ({"input_ids": [[1, 2], [3, 256]]}, "input_ids[1]: ids must lie in [0, 256)"),
        ({"input_ids": [-1]}, "input_ids[0]: ids must lie in [0, 256)"),
        ({"input_ids": list(range(10)) * 52}, "520 tokens, more than the model's 512"),
        ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid names 1 requests for 2 inputs"),
        ({"input_ids": [1], "sampling_params": None}, "unknown or unsupported field(s): sampling_params"),
        ({"input_ids": [1, "2"]}, "input_ids"),
    ],
)
def test_a_bad_classify_request_is_refused_naming_it(engine, body, named):
    from moerl.engines.embedded.classifier import build_classifier_app

    async def go():
        async with serving_app(build_classifier_app(engine)) as url:
            status, answer, _ = await _request(url, "/classify", body)
            assert status == 400 and named in answer["error"]["message"], answer
            status, answer, _ = await _request(url, "/generate", {"input_ids": [1]})
            assert status == 404  # a reward model generates nothing

    asyncio.run(go())


@pytest.mark.e2e
def test_moerl_serve_serves_a_reward_model_by_its_architecture(reward_model, tmp_path):
    """``moerl serve`` (as the engine pool starts it) reads the architecture and answers /classify, through the
    client's call, with the same scores as the engine in this process."""
    from moerl.engines.client import EngineClient
    from moerl.engines.embedded.classifier import ClassifierEngine
    from tests.engine_server import running_server

    local = ClassifierEngine(str(reward_model))
    expected = [local.scores(ids) for ids in INPUTS]
    with running_server(reward_model, tmp_path / "logs") as url:

        async def go():
            async with EngineClient([url]) as client:
                return await client.classify_on(url, INPUTS)

        assert asyncio.run(go()) == expected


def test_a_colocated_reward_engine_pauses_gives_back_its_weights_and_scores_the_same_after(reward_model):
    """What colocated placement asks of a reward replica while the trainer trains: paused, a request waits; its memory
    is released only while paused, and nothing continues until it is taken back; with --enable-weights-cpu-backup the
    weights come back as they were (a reward model takes no push), so the scores are bitwise the same."""
    from moerl.engines.embedded.classifier import ClassifierEngine, build_classifier_app

    engine = ClassifierEngine(str(reward_model), weights_cpu_backup=True)
    weights = [p.data.clone() for p in engine.model.parameters()]

    async def go():
        async with serving_app(build_classifier_app(engine)) as url:
            _, before, _ = await _request(url, "/classify", {"input_ids": INPUTS})
            status, body, _ = await _request(url, "/release_memory_occupation", {})
            assert status == 400 and "pause generation first" in body["error"]["message"]
            assert (await _request(url, "/pause_generation", {"mode": "retract"}))[0] == 200
            waiting = asyncio.create_task(_request(url, "/classify", {"input_ids": INPUTS}))
            assert (await _request(url, "/release_memory_occupation", {}))[0] == 200
            assert all(p.numel() == 0 for p in engine.model.parameters())  # given back
            status, body, _ = await _request(url, "/continue_generation", {})
            assert status == 400 and "resume it (/resume_memory_occupation)" in body["error"]["message"]
            await asyncio.sleep(0.2)
            assert not waiting.done()
            assert (await _request(url, "/resume_memory_occupation", {}))[0] == 200
            assert (await _request(url, "/continue_generation", {}))[0] == 200
            status, after, _ = await _request(url, "/classify", {"input_ids": INPUTS})
            assert status == 200 and after == before
            assert (await waiting)[1] == before  # the request held by the pause, answered once it continued
            assert all(torch.equal(p.data, w) for p, w in zip(engine.model.parameters(), weights, strict=True))

    asyncio.run(go())
