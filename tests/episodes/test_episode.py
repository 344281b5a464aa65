"""Episodes against a scripted engine (a model that writes given texts): message-level tool exchanges, forks where the
history renders otherwise, the token budget, and the checks on what an engine answers."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from moerl.engines.protocol import SamplingParams
from moerl.episodes import CALCULATOR, Episode, EpisodeDone, EpisodeError, EpisodeSettings, tool_agent
from tests.episodes.conftest import ScriptedEngine, assert_only_seen, routing_of

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
RECORD = {"prompt": "What is 2 + 3?", "answer": "5"}
PARAMS = SamplingParams(max_new_tokens=100, top_k=20)


def episode_of(engine: ScriptedEngine, tokenizer, **kwargs) -> Episode:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": RECORD["prompt"]}], add_generation_prompt=True)
    kwargs.setdefault("sampling_mask", True)
    return Episode(
        prompt["input_ids"], RECORD, engine, EpisodeSettings(tokenizer, PARAMS, tools=[CALCULATOR], **kwargs)
    )


def test_tool_exchange_trains_the_model_turns_and_feeds_the_tool_output_as_context(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL, "The answer is 5."])
    episode = episode_of(engine, tokenizer)
    assert asyncio.run(tool_agent(episode, RECORD)) is None
    assert episode.final_text == "The answer is 5."
    stats = episode.stats
    assert (stats.turns, stats.tool_calls, stats.tool_failures, stats.forks) == (2, 1, 0, 0)
    (sample,) = episode.samples(reward=1.0, temperature=1.0)
    # The first chat rendered the tools into the prompt: the stream, without actions yet, was replaced, not forked.
    user = [{"role": "user", "content": RECORD["prompt"]}]
    prompt = tokenizer.apply_chat_template(user, tools=[CALCULATOR.schema()], add_generation_prompt=True)
    assert sample.prompt_ids.tolist() == prompt["input_ids"]
    call_ids, answer_ids = (c.completion.output_ids.tolist() for c in engine.calls)
    mask = sample.loss_mask.astype(bool)
    response = sample.response_ids.tolist()
    assert response[: len(call_ids)] == call_ids and response[-len(answer_ids) :] == answer_ids
    context = tokenizer.decode(sample.response_ids[~mask])
    assert context == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert mask.sum() == len(call_ids) + len(answer_ids) == stats.model_tokens
    assert np.all(sample.versions[~mask] == -1) and np.all(sample.versions[mask] == 5)
    assert np.all(sample.behaviour_logprobs[~mask] == 0) and np.all(sample.selected_logprobs[~mask] == 0)
    np.testing.assert_array_equal(sample.routing, routing_of(sample.fed_ids().tolist()))
    assert [c.start for c in engine.calls] == [0, len(prompt["input_ids"]) + len(call_ids) - 1]
    assert_only_seen(sample, engine.calls)
    reply = episode.turns[0].message
    assert reply["content"] is None
    assert reply["tool_calls"] == [
        {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2 + 3"}'}}
    ]
    assert episode.turns[0].finish_reason == "tool_calls" and episode.turns[1].finish_reason == "stop"
    assert episode.turns[1].prompt_tokens == len(engine.calls[1].input_ids)
    assert episode.turns[1].completion_tokens == len(answer_ids)


def test_reasoning_the_template_drops_forks_the_episode(tokenizer):
    engine = ScriptedEngine(tokenizer, ["<think>\n2 and 3 make 5\n</think>\n\n" + CALL, "5"])
    episode = episode_of(engine, tokenizer)
    asyncio.run(tool_agent(episode, RECORD))
    assert episode.turns[0].message["reasoning_content"] == "2 and 3 make 5"
    assert episode.stats.forks == 1 and episode.stats.tool_calls == 1
    first, second = episode.samples(reward=1.0, temperature=1.0)
    assert first.loss_mask.all() and second.loss_mask.all()  # each ends at its last action: no trailing context
    assert "<think>" not in tokenizer.decode(second.prompt_ids)
    assert second.prompt_ids.tolist() == engine.calls[1].input_ids
    assert [c.start for c in engine.calls] == [0, 0]
    for sample in (first, second):
        np.testing.assert_array_equal(sample.routing, routing_of(sample.fed_ids().tolist()))
        assert_only_seen(sample, engine.calls)


def test_a_malformed_call_stays_content_and_ends_the_agent(tokenizer):
    broken = '<tool_call>\n{"name": "calculator", "arguments": {"expression": }\n</tool_call>'
    episode = episode_of(ScriptedEngine(tokenizer, [broken]), tokenizer)
    asyncio.run(tool_agent(episode, RECORD))
    assert episode.stats.tool_calls == 0 and episode.stats.malformed_tool_calls == 1
    assert episode.final_text == broken and "tool_calls" not in episode.turns[0].message


def test_the_token_budget_ends_the_episode_cleanly(tokenizer):
    engine = ScriptedEngine(tokenizer, [CALL, "The answer is 5."])
    user = [{"role": "user", "content": RECORD["prompt"]}]
    prompt = tokenizer.apply_chat_template(user, tools=[CALCULATOR.schema()], add_generation_prompt=True)["input_ids"]
    episode = episode_of(engine, tokenizer, max_total_tokens=len(prompt) + 100)
    asyncio.run(tool_agent(episode, RECORD))
    # The tool turn fit; the answer turn was cut at the budget, and the episode ended there.
    assert episode.done and episode.finish_reason == "length"
    assert episode.turns[-1].finish_reason == "length"
    (sample,) = episode.samples(reward=0.0, temperature=1.0)
    assert sample.prompt_len + sample.response_len == episode.max_total_tokens
    assert sample.finish_reason == "length"
    with pytest.raises(EpisodeDone):
        asyncio.run(episode.generate([5]))


def test_context_past_the_budget_ends_the_episode_without_a_request(tokenizer):
    engine = ScriptedEngine(tokenizer, ["ok"], stop=None)
    episode = Episode([5, 6, 7], {}, engine, EpisodeSettings(tokenizer, PARAMS, max_total_tokens=10))
    assert asyncio.run(episode.generate()) == tokenizer("ok")["input_ids"]
    assert asyncio.run(episode.generate([8] * 5)) == []
    assert episode.done and len(engine.calls) == 1
    (sample,) = episode.samples(reward=0.0, temperature=1.0)
    assert sample.response_ids.tolist() == tokenizer("ok")["input_ids"]  # the context after the last action: left out


def test_a_turn_that_stops_on_the_budgets_last_token_leaves_the_agent_free_to_be_done(tokenizer):
    """The engine's stop token is the budget's last: the turn is complete and the episode stays open. An agent that
    answers there is not truncated; one that asks for more ends the episode, truncated, without a request, and its
    sample says so."""
    prompt = [5, 6, 7]
    answer = tokenizer("The answer is 5.", add_special_tokens=False)["input_ids"]
    for asks_more in (False, True):
        engine = ScriptedEngine(tokenizer, ["The answer is 5."])
        budget = len(prompt) + len(answer) + 1  # the answer and its stop token fill it
        episode = Episode(prompt, {}, engine, EpisodeSettings(tokenizer, PARAMS, max_total_tokens=budget))
        asyncio.run(episode.generate())
        assert episode.turns[-1].finish_reason == "stop" and not episode.done
        if asks_more:
            assert asyncio.run(episode.generate([8])) == []
            assert episode.finish_reason == "length" and len(engine.calls) == 1
        (sample,) = episode.samples(reward=0.0, temperature=1.0)
        assert sample.prompt_len + sample.response_len == budget
        assert sample.finish_reason == ("length" if asks_more else "stop")


def test_a_turn_aborted_before_its_first_token_ends_the_episode_with_what_it_had(tokenizer):
    """An abort in the engine's waiting queue (or at its shutdown) answers no token and no log-probs, kept sets or
    routing: the episode ends as aborted, its earlier turns intact, without calling the answer broken."""
    import dataclasses

    engine = ScriptedEngine(tokenizer, ["ok", "never"], stop=None)

    async def aborted_second(input_ids, params, start, top_logprobs=0):
        completion, versions = await engine(input_ids, params, start, top_logprobs)
        if len(engine.calls) == 2:
            empty = np.zeros(0, np.int32)
            completion = dataclasses.replace(
                completion,
                output_ids=empty,
                finish_reason={"type": "abort"},
                logprobs=None,
                routing=None,
                mask_offsets=None,
                mask_ids=None,
                sampling_logprobs=None,
                weight_versions=[],
            )
        return completion, versions

    episode = Episode([5, 6, 7], {}, aborted_second, EpisodeSettings(tokenizer, PARAMS, sampling_mask=True))
    asyncio.run(episode.generate())
    assert asyncio.run(episode.generate([8])) == []
    assert episode.done and episode.finish_reason == "abort"
    (sample,) = episode.samples(reward=0.0, temperature=1.0)
    assert sample.response_ids.tolist() == tokenizer("ok")["input_ids"]


def test_a_routing_patch_that_does_not_start_where_the_rows_end_is_refused(tokenizer):
    engine = ScriptedEngine(tokenizer, ["a", "b"], stop=None)

    async def shifted(input_ids, params, start, top_logprobs=0):
        return await engine(input_ids, params, max(start - 1, 0))

    episode = Episode([5, 6, 7], {}, shifted, EpisodeSettings(tokenizer, PARAMS))
    asyncio.run(episode.generate())
    with pytest.raises(EpisodeError, match="starts at position 2, but the stream's rows end at 3"):
        asyncio.run(episode.generate([8]))


def test_a_turn_at_another_temperature_or_several_completions_is_refused(tokenizer):
    episode = Episode([5, 6, 7], {}, ScriptedEngine(tokenizer, ["a"]), EpisodeSettings(tokenizer, PARAMS))
    with pytest.raises(EpisodeError, match="temperature"):
        asyncio.run(episode.generate(temperature=0.5))
    with pytest.raises(EpisodeError, match="n must be 1"):
        asyncio.run(episode.generate(n=2))
    with pytest.raises(EpisodeError, match="top_k"):
        asyncio.run(episode.generate(top_k=0))


def test_a_failed_request_leaves_the_episode_as_it_was(tokenizer):
    engine = ScriptedEngine(tokenizer, ["a", "b"], stop=None)
    failures = [RuntimeError("replica down")]

    async def flaky(input_ids, params, start, top_logprobs=0):
        if failures:
            raise failures.pop()
        return await engine(input_ids, params, start, top_logprobs)

    episode = Episode([5, 6, 7], {}, flaky, EpisodeSettings(tokenizer, PARAMS))
    with pytest.raises(RuntimeError):
        asyncio.run(episode.generate([8, 9]))
    assert episode.stream() == [5, 6, 7] and episode.stats.context_tokens == 0
    asyncio.run(episode.generate([8, 9]))
    asyncio.run(episode.generate([10]))
    (sample,) = episode.samples(reward=0.0, temperature=1.0)
    assert sample.prompt_ids.tolist() == [5, 6, 7, 8, 9]  # context before the first action is prompt
    assert sample.loss_mask.tolist() == [1, 0, 1]
    assert episode.stats.metrics() == {
        "episode/turns": 2,
        "episode/tool_calls": 0,
        "episode/malformed_tool_calls": 0,
        "episode/tool_failures": 0,
        "episode/forks": 0,
        "episode/context_tokens": 3,
        "episode/model_tokens": 2,
        "routing/recomputed_positions": 0,
        "routing/rows_received": 5 + 2,  # turn 1's prompt and output, then turn 2's context and output
        "routing/rows_full_sequence": 5 + 7,  # each turn's whole sequence
    }


def test_chats_sent_at_once_run_in_turn_and_a_branch_forks(tokenizer):
    engine = ScriptedEngine(tokenizer, ["one", "two"])
    episode = episode_of(engine, tokenizer, sampling_mask=False)
    user = [{"role": "user", "content": "Hi"}]

    async def both():
        return await asyncio.gather(episode.chat_turn(user), episode.chat_turn(user))

    first, second = asyncio.run(both())
    assert (first.message["content"], second.message["content"]) == ("one", "two")
    assert (first.finish_reason, first.completion_tokens, second.completion_tokens) == ("stop", 4, 4)
    # The second history leaves out the first reply: it branches from the same prompt, a sample of its own.
    assert episode.stats.forks == 1
    a, b = episode.samples(reward=0.0, temperature=1.0)
    assert a.prompt_ids.tolist() == b.prompt_ids.tolist()
    for sample in (a, b):
        assert_only_seen(sample, engine.calls)


def test_an_episodes_turns_are_its_steps_and_its_environment_scores_them(tokenizer):
    engine = ScriptedEngine(tokenizer, ["first", "second", "third"])
    episode = episode_of(engine, tokenizer)
    context = tokenizer("ctx", add_special_tokens=False)["input_ids"]
    with pytest.raises(EpisodeError, match="no turn to score"):
        episode.score_turn(1.0)

    async def run():
        await episode.generate()
        episode.score_turn(0.5)
        await episode.generate(context)
        await episode.generate()  # no context between two turns: each is a step still
        episode.score_turn(2.0)
        episode.score_turn(-1.0)  # scored again: the new score

    asyncio.run(run())
    (sample,) = episode.samples(reward=1.0, temperature=1.0)
    first, second, third = (len(c.completion.output_ids) for c in engine.calls)
    ends = [first, first + len(context) + second, first + len(context) + second + third]
    assert sample.step_ends.tolist() == ends == [*ends[:2], sample.response_len]
    assert sample.step_rewards.tolist() == [0.5, 0.0, -1.0]  # the turn never scored counts 0
    assert sample.step_of_actions().tolist() == [0] * first + [1] * second + [2] * third
    unscored = episode_of(ScriptedEngine(tokenizer, ["only"]), tokenizer)
    asyncio.run(unscored.generate())
    (sample,) = unscored.samples(reward=1.0, temperature=1.0)
    assert sample.step_ends.tolist() == [sample.response_len] and sample.step_rewards is None
