"""Reward models served by engines of their own: a discriminative model's and a judge's scores are those a direct
transformers forward gives, they combine with the task's reward as configured, and a replica that dies costs a retry,
never a score."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from moerl.models.tiny import save_tiny_hf
from tests.engine_server import running_pool, serving_app

PROMPT, ANSWER = "What is 2+3?", "5"
RESPONSES = ["5", "It is 6.", "2+3=5, so 5"]


def char_sum(text: str) -> float:
    """A verdict that reads every character of the judge's answer (the tiny judge writes no grade)."""
    return sum(map(ord, text)) / 1000


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return save_tiny_hf("Qwen3ForSequenceClassification", tmp_path_factory.mktemp("rm") / "model")


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    return save_tiny_hf("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("judge") / "model", seed=3)


def test_a_discriminative_models_scores_are_a_direct_forwards_and_combine_with_the_tasks_reward(classifier):
    """Each response is scored with the prompt as one conversation of the model's chat template; the reward is
    combine(the task's reward, the score)."""
    from transformers import AutoModelForSequenceClassification

    from moerl.engines.embedded.classifier import ClassifierEngine, build_classifier_app
    from moerl.engines.embedded.runner import own_weights
    from moerl.rewards import Rewarder
    from moerl.rewards.combine import rule_times_model
    from moerl.rewards.model import Classifier, Replicas, Stats
    from moerl.tasks import TaskConfig

    model = AutoModelForSequenceClassification.from_pretrained(classifier).eval()
    own_weights(model)  # aligned, as the engine's are: the CPU's matmuls round unaligned operands otherwise

    async def go():
        async with serving_app(build_classifier_app(ClassifierEngine(str(classifier)))) as url:
            reward_model = Classifier(classifier, Replicas([url]))
            ids = [reward_model.conversation_ids(PROMPT, r) for r in RESPONSES]
            with torch.no_grad():
                expected = [model(torch.tensor([i])).logits[0, 0].item() for i in ids]
            stats = Stats(float)
            rewarder = Rewarder(TaskConfig(reward="exact"), reward_model, rule_times_model)
            rewards = [s.outcome for s in await rewarder.score(RESPONSES, ANSWER, PROMPT, stats)]
            await rewarder.close()
            return ids, expected, rewards, stats

    ids, expected, rewards, stats = asyncio.run(go())
    assert len(set(map(tuple, ids))) == 3 and all(PROMPT in decoded for decoded in map(_text, ids))
    assert rewards == pytest.approx([expected[0], 0.0, 0.0], abs=1e-5)  # only the first is exactly the answer
    assert stats["reward_engines/requests"] == 1 and stats["reward_engines/retries"] == 0
    assert stats["reward_engines/scored"] == len(RESPONSES)
    assert stats["reward_engines/score_sum"] == pytest.approx(sum(expected), abs=1e-5)


def _text(ids: list[int]) -> str:
    from moerl.models.tiny import tiny_tokenizer

    return tiny_tokenizer().decode(ids)


@pytest.mark.e2e
def test_a_judges_scores_are_its_greedy_answers_read_by_the_verdict(judge, tmp_path):
    """A generative reward model answers the judge's question (the configured template, through its chat template)
    greedily; the verdict function reads the answer. The same as transformers' own greedy generation of it."""
    from transformers import AutoModelForCausalLM

    from moerl.engines.embedded.runner import own_weights
    from moerl.rewards.judge import Judge, Judging
    from moerl.rewards.model import Replicas
    from tests.engine_server import running_server

    model = AutoModelForCausalLM.from_pretrained(judge).eval()
    own_weights(model)
    template = "Q: {prompt} Gold: {answer} Said: {response} Grade?"
    with running_server(judge, tmp_path / "logs") as url:

        async def go():
            reward_model = Judge(judge, Replicas([url]), Judging(template, f"{__name__}:char_sum", max_new_tokens=6))
            scores = await reward_model.score(PROMPT, RESPONSES, ANSWER)
            ids = [reward_model.judge_ids(PROMPT, r, ANSWER) for r in RESPONSES]
            await reward_model.close()
            return scores, ids

        scores, ids = asyncio.run(go())
    expected = []
    for i, response in zip(ids, RESPONSES, strict=True):
        assert template.format(prompt=PROMPT, answer=ANSWER, response=response) in _text(i)
        with torch.no_grad():
            out = model.generate(torch.tensor([i]), do_sample=False, max_new_tokens=6)[0, len(i) :]
        expected.append(char_sum(_text_skipping_special(out.tolist())))
    assert scores == pytest.approx(expected, abs=1e-9) and len(set(scores)) > 1


def _text_skipping_special(ids: list[int]) -> str:
    from moerl.models.tiny import tiny_tokenizer

    return tiny_tokenizer().decode(ids, skip_special_tokens=True)


@pytest.mark.e2e
def test_a_reward_replica_that_dies_costs_a_retry_and_one_started_again_scores_what_waited(classifier, tmp_path):
    """Two replicas, one SIGKILLed: its request fails, is counted, and is asked again of the other; every score is
    the one a live replica gives. Then the only replica left dies: the scores wait for it, started again, and are
    the same once it answers; with none back for reward.engines.down_timeout_s the run stops with one error."""
    from moerl.errors import EnginesDown
    from moerl.rewards.model import Classifier, Replicas, Stats

    with running_pool(classifier, tmp_path / "logs", 2) as pool:
        first, second = pool.urls

        async def go():
            reward_model = Classifier(classifier, Replicas(pool.urls, health_interval_s=0.2))
            try:
                before = await reward_model.score(PROMPT, RESPONSES, ANSWER)
                os.killpg(pool.procs[0].pid, signal.SIGKILL)
                pool.procs[0].wait()
                reward_model.client.in_flight[second] = 1  # the dead one is the least loaded: asked first
                stats = Stats(float)
                after = await reward_model.score(PROMPT, RESPONSES, ANSWER, stats)
                reward_model.client.in_flight[second] = 0
                assert after == before and stats["reward_engines/retries"] == 1
                assert reward_model.client.health.usable() == [second]
                os.killpg(pool.procs[1].pid, signal.SIGKILL)
                pool.procs[1].wait()
                waiting = asyncio.create_task(reward_model.score(PROMPT, RESPONSES, ANSWER, stats))
                await asyncio.sleep(1.0)
                assert not waiting.done()
                assert sorted(await asyncio.to_thread(pool.revive, 3)) == sorted(pool.urls)
                assert await waiting == before
                for proc in pool.procs:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                reward_model.replicas.down_timeout_s = 1.0
                gone = "no engine replica has been healthy for reward.engines.down_timeout_s=1 s"
                with pytest.raises(EnginesDown, match=gone):
                    await reward_model.score(PROMPT, RESPONSES, ANSWER)
            finally:
                await reward_model.close()

        asyncio.run(go())


@pytest.mark.e2e
def test_a_paused_reward_replica_holds_its_scores_past_the_down_timeout_and_serves_them_after(classifier, tmp_path):
    """Colocated reward replicas are paused for the trainer's phase, however long. A score asked meanwhile times out,
    and /health fails while paused (as SGLang's does), yet the replica answers /model_info: it is paused, not down, so
    the score waits past reward.engines.down_timeout_s and is the live replica's once generation continues."""
    from moerl.engines.client import EngineClient
    from moerl.rewards.model import Classifier, Replicas, Stats

    with running_pool(classifier, tmp_path / "logs", 1) as pool:

        async def go():
            reward_model = Classifier(
                classifier, Replicas(pool.urls, timeout_s=0.5, down_timeout_s=1.0, health_interval_s=0.2)
            )
            try:
                before = await reward_model.score(PROMPT, RESPONSES, ANSWER)
                async with EngineClient(pool.urls) as lead:
                    await lead.pause("retract")
                    assert await lead.healthy() == [False] and await lead.healthy(paused=True) == [True]
                    stats = Stats(float)
                    waiting = asyncio.create_task(reward_model.score(PROMPT, RESPONSES, ANSWER, stats))
                    await asyncio.sleep(3.0)  # three down timeouts
                    assert not waiting.done() and reward_model.client.health.usable() == []  # its request timed out
                    await lead.resume()
                assert await waiting == before and stats["reward_engines/retries"] >= 1
            finally:
                await reward_model.close()

        asyncio.run(go())


def test_the_demo_reward_model_ranks_each_prompts_sum_above_every_other_answer(demo_reward_model):
    """reward.model=demo: the tiny classifier, warmed up on the task's right and wrong answers, scores each prompt's
    sum above every other answer the tiny policy could give, and right answers above zero and wrong ones below: a
    policy rewarded by it alone learns the task. (Made once in the session by what reward.model=demo runs,
    :func:`moerl.tasks.tiny.save_tiny_reward_model`.)"""
    from transformers import AutoModelForSequenceClassification

    from moerl.rewards.model import Classifier, Replicas
    from moerl.tasks.tiny import DIGITS, records

    directory = demo_reward_model
    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    reading = Classifier(directory, Replicas(["http://127.0.0.1:9"]))  # how the job reads a conversation
    for item in records():
        answers = [str(s) for s in range(2 * DIGITS - 1)]
        with torch.no_grad():
            scores = [
                model(torch.tensor([reading.conversation_ids(item["prompt"], a)])).logits[0, 0].item() for a in answers
            ]
        assert max(answers, key=dict(zip(answers, scores, strict=True)).__getitem__) == item["answer"], item
        assert all((score > 0) == (a == item["answer"]) for a, score in zip(answers, scores, strict=True)), item
