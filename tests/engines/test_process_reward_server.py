"""A process reward model served by the embedded engine at /step_scores (SGLang has no per-token head): each step's
score is the model's own p(label 1) at that step's separator, as a direct forward computes it; a bad request, or a
route of the other kind of reward model, is refused naming what is wrong; ``moerl serve`` serves such a model by its
architecture, and SGLang is never asked to."""

from __future__ import annotations

import asyncio

import pytest
import torch

from moerl.models.tiny import save_tiny_hf, tiny_param_count
from tests.engine_server import serving_app
from tests.engines.test_engine_requests import _request

ARCH = "Qwen3ForTokenClassification"
STEP = "<extra_0>"  # Qwen2.5-Math-PRM's step separator
# Two inputs of different lengths: a question and a response of 1 step, and one of 3 steps.
TEXTS = [
    "Q: 2+3?\nA: 2+3=5" + STEP,
    "Q: what is 7*6-2?\nA: 7*6=42" + STEP + "42-2=40" + STEP + "so the answer is 40" + STEP,
]


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory):
    """A tiny 2-label token classifier with its tokenizer and the step separator added to it."""
    from transformers import AutoTokenizer

    out = save_tiny_hf(ARCH, tmp_path_factory.mktemp("prm") / "model")
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_tokens([STEP])
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tokenized(prm_dir):
    """(the inputs' ids, the step token's id)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prm_dir)
    step_id = tokenizer.convert_tokens_to_ids(STEP)
    return [tokenizer(text)["input_ids"] for text in TEXTS], step_id


@pytest.fixture(scope="module")
def engine(prm_dir):
    from moerl.engines.embedded.classifier import ProcessRewardEngine

    return ProcessRewardEngine(str(prm_dir), device="cpu")


def _direct(model_dir, inputs: list[list[int]], step_id: int) -> list[torch.Tensor]:
    """Each input's step scores from transformers' own forward, one input at a time."""
    from transformers import AutoModelForTokenClassification

    from moerl.engines.embedded.runner import own_weights

    model = AutoModelForTokenClassification.from_pretrained(model_dir).eval()
    own_weights(model)  # aligned, as the engine's are: the CPU's matmuls round unaligned operands otherwise
    expected = []
    with torch.no_grad():
        for ids in inputs:
            input_ids = torch.tensor([ids])
            positions = (input_ids[0] == step_id).nonzero().flatten()
            expected.append(torch.softmax(model(input_ids).logits, -1)[0, positions, 1])
    return expected


def test_the_tiny_process_reward_model_saves_its_heads_bias_and_its_step_token_fits_the_vocabulary(prm_dir, tokenized):
    from safetensors.torch import load_file

    from moerl.models import is_classifier, is_process_reward_model

    tensors = load_file(prm_dir / "model.safetensors")
    assert tensors["score.weight"].shape == (2, 64) and tensors["score.bias"].shape == (2,)  # transformers' own bias
    assert sum(t.numel() for t in tensors.values()) == tiny_param_count(ARCH)
    inputs, step_id = tokenized
    assert step_id < 256 and [ids.count(step_id) for ids in inputs] == [1, 3]
    assert is_process_reward_model([ARCH]) and not is_classifier([ARCH])
    assert not is_process_reward_model(["Qwen3ForSequenceClassification"])


def test_served_step_scores_equal_a_direct_forward(prm_dir, tokenized, engine):
    from moerl.engines.client import EngineClient
    from moerl.engines.embedded.classifier import build_classifier_app

    inputs, step_id = tokenized
    expected = _direct(prm_dir, inputs, step_id)

    async def go():
        async with serving_app(build_classifier_app(engine)) as url:
            status, answers, _ = await _request(url, "/step_scores", {"input_ids": inputs, "step_token_id": step_id})
            assert status == 200 and [len(a["scores"]) for a in answers] == [1, 3]
            async with EngineClient([url]) as client:
                by_client = await client.step_scores_on(url, inputs, step_id)
                alone = [(await client.step_scores_on(url, [ids], step_id))[0] for ids in inputs]
            status, info, _ = await _request(url, "/model_info", method="GET")
            assert status == 200 and info["is_generation"] is False
            return [a["scores"] for a in answers], by_client, alone

    served, by_client, alone = asyncio.run(go())
    for got, want in zip(served, expected, strict=True):
        torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=1e-6)
    assert by_client == served and alone == served  # no input's scores depend on another's


def test_a_one_label_head_scores_a_step_by_the_sigmoid_of_its_logit(tmp_path, tokenized):
    from transformers import AutoModelForTokenClassification

    from moerl.engines.embedded.classifier import ProcessRewardEngine
    from moerl.engines.embedded.runner import own_weights

    model_dir = save_tiny_hf(ARCH, tmp_path / "prm1", num_labels=1)
    inputs, step_id = tokenized
    engine = ProcessRewardEngine(str(model_dir), device="cpu")
    model = AutoModelForTokenClassification.from_pretrained(model_dir).eval()
    own_weights(model)
    for ids in inputs:
        positions = [i for i, t in enumerate(ids) if t == step_id]
        with torch.no_grad():
            want = torch.sigmoid(model(torch.tensor([ids])).logits[0, positions, 0])
        torch.testing.assert_close(torch.tensor(engine.step_probs(ids, step_id)), want, rtol=0, atol=1e-6)


def test_a_head_of_more_than_two_labels_is_no_process_reward_model(tmp_path):
    from moerl.engines.embedded.classifier import ProcessRewardEngine
    from moerl.errors import ConfigError

    model_dir = save_tiny_hf(ARCH, tmp_path / "prm3", num_labels=3)
    with pytest.raises(ConfigError, match="1 label .* or 2 .*, not 3"):
        ProcessRewardEngine(str(model_dir), device="cpu")


def test_an_input_without_a_step_has_no_scores_and_the_other_kind_of_reward_route_is_refused(
    tmp_path, tokenized, engine
):
    from moerl.engines.embedded.classifier import ClassifierEngine, build_classifier_app

    inputs, step_id = tokenized
    classifier = ClassifierEngine(str(save_tiny_hf("Qwen3ForSequenceClassification", tmp_path / "rm")), device="cpu")

    async def go():
        async with serving_app(build_classifier_app(engine)) as url:
            status, answers, _ = await _request(
                url, "/step_scores", {"input_ids": [[5, 6, 7]], "step_token_id": step_id}
            )
            assert status == 200 and answers == [{"scores": []}]
            status, answer, _ = await _request(url, "/classify", {"input_ids": inputs[0]})
            assert status == 400 and "is a process reward model" in answer["error"]["message"], answer
            assert "/classify scores a sequence with a sequence classifier" in answer["error"]["message"]
        async with serving_app(build_classifier_app(classifier)) as url:
            status, answer, _ = await _request(url, "/step_scores", {"input_ids": inputs, "step_token_id": step_id})
            assert status == 400 and "is a sequence classifier" in answer["error"]["message"], answer
            assert "process reward model (*ForTokenClassification)" in answer["error"]["message"]
            assert (await _request(url, "/classify", {"input_ids": inputs[0]}))[0] == 200

    asyncio.run(go())


@pytest.mark.parametrize(
    "body, named",
    [
        ({}, "input_ids"),
        ({"input_ids": [[1]]}, "step_token_id"),
        ({"input_ids": [], "step_token_id": 1}, "a batch holds 1 to"),
        ({"input_ids": [[1], []], "step_token_id": 1}, "input_ids[1] is empty"),
        ({"input_ids": [1, 2], "step_token_id": 1}, "input_ids"),
        ({"input_ids": [[1, 2], [3, 256]], "step_token_id": 1}, "input_ids[1]: ids must lie in [0, 256)"),
        ({"input_ids": [[-1]], "step_token_id": 1}, "input_ids[0]: ids must lie in [0, 256)"),
        ({"input_ids": [[1]], "step_token_id": 256}, "step_token_id=256 lies outside the vocabulary [0, 256)"),
        ({"input_ids": [[1]], "step_token_id": -1}, "step_token_id"),
        ({"input_ids": [[1]], "step_token_id": "1"}, "step_token_id"),
        ({"input_ids": [list(range(10)) * 52], "step_token_id": 1}, "520 tokens, more than the model's 512"),
        ({"input_ids": [[1]], "step_token_id": 1, "rid": "a"}, "unknown or unsupported field(s): rid"),
    ],
)
def test_a_bad_step_scores_request_is_refused_naming_it(engine, body, named):
    from moerl.engines.embedded.classifier import build_classifier_app

    async def go():
        async with serving_app(build_classifier_app(engine)) as url:
            status, answer, _ = await _request(url, "/step_scores", body)
            assert status == 400 and named in answer["error"]["message"], answer
            assert (await _request(url, "/generate", {"input_ids": [1]}))[0] == 404  # it generates nothing

    asyncio.run(go())


def test_a_paused_process_reward_engine_holds_requests_until_it_continues(prm_dir, tokenized):
    """Colocated, as the classifier: paused, a request waits; its weights are given back and taken back (with a CPU
    backup) and the scores after are bitwise the same."""
    from moerl.engines.embedded.classifier import ProcessRewardEngine, build_classifier_app

    inputs, step_id = tokenized
    engine = ProcessRewardEngine(str(prm_dir), device="cpu", weights_cpu_backup=True)
    body = {"input_ids": inputs, "step_token_id": step_id}

    async def go():
        async with serving_app(build_classifier_app(engine)) as url:
            _, before, _ = await _request(url, "/step_scores", body)
            assert (await _request(url, "/pause_generation", {"mode": "retract"}))[0] == 200
            assert (await _request(url, "/health", method="GET"))[0] == 503
            waiting = asyncio.create_task(_request(url, "/step_scores", body))
            assert (await _request(url, "/release_memory_occupation", {}))[0] == 200
            assert all(p.numel() == 0 for p in engine.model.parameters())
            await asyncio.sleep(0.2)
            assert not waiting.done()
            assert (await _request(url, "/resume_memory_occupation", {}))[0] == 200
            assert (await _request(url, "/continue_generation", {}))[0] == 200
            status, after, _ = await _request(url, "/step_scores", body)
            assert status == 200 and after == before
            assert (await waiting)[1] == before

    asyncio.run(go())


def test_moerl_serve_dispatches_a_token_classifier_to_the_process_reward_engine(prm_dir):
    from moerl.cli.serve import _engines, build_parser
    from moerl.engines.embedded.classifier import ProcessRewardEngine

    (engine,) = _engines(build_parser().parse_args(["--model", str(prm_dir), "--device", "cpu"]))
    assert type(engine) is ProcessRewardEngine


def test_sglang_is_never_asked_to_start_a_process_reward_model(prm_dir):
    from moerl.engines.pool import EnginePoolConfig, server_args
    from moerl.models import SGLANG_PRM_GAP

    with pytest.raises(ValueError, match="is a process reward model: SGLang 0.5.23 serves no per-token head"):
        server_args(EnginePoolConfig(model_path=str(prm_dir)), port=1)
    assert "\n" not in SGLANG_PRM_GAP and "embedded" in SGLANG_PRM_GAP


@pytest.mark.e2e
def test_moerl_serve_serves_a_process_reward_model_by_its_architecture(prm_dir, tokenized, engine, tmp_path):
    """``moerl serve`` (as the engine pool starts it) answers /step_scores, through the client's call, with the same
    scores as the engine in this process."""
    from moerl.engines.client import EngineClient
    from tests.engine_server import running_server

    inputs, step_id = tokenized
    expected = [engine.step_probs(ids, step_id) for ids in inputs]
    with running_server(prm_dir, tmp_path / "logs") as url:

        async def go():
            async with EngineClient([url]) as client:
                return await client.step_scores_on(url, inputs, step_id)

        assert asyncio.run(go()) == expected


def test_a_groups_steps_are_scored_by_the_process_reward_model_as_a_direct_forward_scores_them(prm_dir, engine):
    """moerl.rewards.process end to end: each sample's response cut at its separator, its steps' texts read by the
    process reward model as the Qwen2.5-Math-PRM convention lays them out (the prompt, then each step and its step
    token, through the chat template), one request for the group; each step's score is the direct forward's."""
    import numpy as np
    from transformers import AutoTokenizer

    from moerl.engines.embedded.classifier import build_classifier_app
    from moerl.rewards.model import Replicas, Stats
    from moerl.rewards.process import ProcessRewardModel, ProcessRewards, StepCutter
    from moerl.sample import Sample

    policy = AutoTokenizer.from_pretrained(prm_dir)  # the tiny tokenizer (the step token aside)
    responses = ["4\n6\n6", "11\n3", "7"]  # 3 steps, 2, 1 (a response its budget cut, without a separator)
    samples = []
    for text in responses:
        ids = np.array(policy(text, add_special_tokens=False)["input_ids"] + [policy.eos_token_id], np.int32)
        samples.append(Sample(ids[:1], ids, np.zeros(len(ids), np.float32), np.zeros(len(ids), np.int64)))
    cutter = StepCutter(policy, "\n")

    async def go():
        async with serving_app(build_classifier_app(engine)) as url:
            model = ProcessRewardModel(prm_dir, Replicas([url]), STEP, cutter)
            process = ProcessRewards(cutter, model, credit=False)
            for sample in samples:
                process.attach([sample], None, "task.reward=sums")
            stats = Stats(float)
            await process.score(samples, "1+3+2+0=", stats)
            inputs = [model.input_ids("1+3+2+0=", cutter.texts(s)) for s in samples]
            # the step token's text in a prompt or a step is left out: it stands after each step, once
            stray = model.input_ids("1+3<extra_0>", ["4<extra_0>", "6"])
            await process.close()
            return inputs, stray, stats

    inputs, stray, stats = asyncio.run(go())
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n{}<|im_end|>\n"
    assert policy.decode(inputs[0]) == chat.format("1+3+2+0=", "4<extra_0>6<extra_0>6<extra_0>")
    assert policy.decode(stray) == chat.format("1+3", "4<extra_0>6<extra_0>")
    assert inputs[0].count(policy.convert_tokens_to_ids(STEP)) == 3
    assert [s.step_ends.tolist() for s in samples] == [[2, 4, 6], [3, 5], [2]]
    assert [cutter.texts(s) for s in samples] == [["4", "6", "6"], ["11", "3"], ["7"]]
    expected = _direct(prm_dir, inputs, AutoTokenizer.from_pretrained(prm_dir).convert_tokens_to_ids(STEP))
    for sample, direct in zip(samples, expected, strict=True):
        np.testing.assert_allclose(sample.step_rewards, direct.numpy(), rtol=0, atol=1e-6)
    assert stats["process_engines/requests"] == 1 and stats["process_engines/steps"] == 6
