"""An episode's OpenAI-compatible endpoint against a scripted engine: every Chat Completions field as docs/episodes.md's
table says, and each honoured one honoured exactly (roles, the turn's cap, stop strings, log-probs, the budget)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import numpy as np
import pytest

from moerl.episodes import CALCULATOR
from moerl.episodes.endpoint import HONOURED, IGNORED, ONLY, REFUSED
from tests.episodes.conftest import RUN_CAP, USER, ScriptedEngine, assert_only_seen, endpoint_of, post

DOCS = Path(__file__).parents[2] / "docs" / "episodes.md"


def table() -> dict[str, str]:
    """docs/episodes.md's request-field table: field -> treatment."""
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", DOCS.read_text(), re.MULTILINE)
    return dict(rows)


# A value of each field that an endpoint ignoring the field would disobey (or, for ignored fields, any value).
PROBES = {
    "messages": [{"role": "developer", "content": "Be brief."}, *USER],
    "tools": [CALCULATOR.schema()],
    "stop": ["zzz"],
    "max_tokens": 5,
    "max_completion_tokens": 5,
    "logprobs": True,
    "top_logprobs": 2,  # with logprobs (COMPANIONS)
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "n": 2,
    "stream": True,
    "response_format": {"type": "json_object"},
    "modalities": ["text", "audio"],
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "logit_bias": {"5": 10},
    "temperature": 0.3,
    "top_p": 0.5,
    "seed": 3,
    "model": "anything",
    "stream_options": {"include_usage": True},
    "user": "u",
    "metadata": {"a": "b"},
    "store": True,
    "service_tier": "flex",
    "safety_identifier": "s",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "explicit"},
    "reasoning_effort": "low",
    "verbosity": "low",
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "moderation": {"model": "m"},
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
}


# What a probe of a field sends with it: top_logprobs needs logprobs, as OpenAI's API has it.
COMPANIONS = {"top_logprobs": {"logprobs": True}}


def test_the_docs_table_covers_every_chat_completions_field_as_the_endpoint_treats_it():
    """Every field of openai's CompletionCreateParams is in the table, and the table is the endpoint's."""
    from openai.types.chat import completion_create_params as params

    fields = params.CompletionCreateParamsBase.__required_keys__ | params.CompletionCreateParamsBase.__optional_keys__
    documented = table()
    assert set(documented) == fields | {"stream"} == set(PROBES)
    treatments = {name: "honoured" for name in HONOURED} | {name: "ignored" for name in IGNORED}
    treatments |= {name: f"only `{json.dumps(value)}`" for name, (value, _) in ONLY.items()}
    treatments |= {name: "refused" for name in REFUSED}
    assert documented == treatments


def test_each_field_is_honoured_ignored_taken_at_one_value_or_refused_as_the_table_says(tokenizer):
    """A probe of every field in the table: a refused value is a 400 naming the field; an honoured or ignored one is
    answered; a field taken at one value is answered at it; a field no table row names is refused."""
    engine = ScriptedEngine(tokenizer, ["Hello there."] * 100)

    async def go():
        outcomes = {}
        async with endpoint_of(engine, tokenizer) as episode:
            base = {"model": "policy", "messages": USER}
            for name, value in PROBES.items():
                outcomes[name] = await post(episode, {**base, **COMPANIONS.get(name, {}), name: value})
            for name, (value, _) in ONLY.items():
                outcomes[f"{name}={value}"] = await post(episode, {**base, name: value})
            outcomes["top_k"] = await post(episode, {**base, "top_k": 5})
            outcomes["top_logprobs alone"] = await post(episode, {**base, "top_logprobs": 2})
        return outcomes

    outcomes = asyncio.run(go())
    for name, treatment in table().items():
        status, answer = outcomes[name]
        if treatment == "refused" or treatment.startswith("only"):
            assert status == 400 and answer["error"]["param"] == name, (name, answer)
            assert answer["error"]["message"].startswith(f"{name}: "), answer
        else:
            assert status == 200 and answer["choices"][0]["message"]["role"] == "assistant", (name, answer)
        if treatment.startswith("only"):
            status, answer = outcomes[f"{name}={ONLY[name][0]}"]
            assert status == 200, (name, answer)
    status, answer = outcomes["top_k"]
    assert status == 400 and "not a Chat Completions field" in answer["error"]["message"]
    status, answer = outcomes["top_logprobs alone"]
    assert status == 400 and answer["error"]["param"] == "top_logprobs"


def test_the_developer_role_renders_as_the_system_role(tokenizer):
    engine = ScriptedEngine(tokenizer, ["Hi."] * 2)

    async def go():
        async with endpoint_of(engine, tokenizer) as episode:
            for role in ("developer", "system"):
                status, _ = await post(episode, {"messages": [{"role": role, "content": "Be brief."}, *USER]})
                assert status == 200

    asyncio.run(go())
    developer, system = (c.input_ids for c in engine.calls)
    assert developer == system
    assert "Be brief." in tokenizer.decode(developer)


def test_max_tokens_lowers_the_turns_cap_and_never_raises_it(tokenizer):
    engine = ScriptedEngine(tokenizer, ["word " * 60] * 3)

    async def go():
        async with endpoint_of(engine, tokenizer) as episode:
            return [
                (await post(episode, {"messages": USER, field: limit}))[1]
                for field, limit in (
                    ("max_tokens", RUN_CAP + 80),
                    ("max_completion_tokens", 7),
                    ("max_tokens", RUN_CAP),
                )
            ]

    answers = asyncio.run(go())
    assert [c.params.max_new_tokens for c in engine.calls] == [RUN_CAP, 7, RUN_CAP]
    assert [a["usage"]["completion_tokens"] for a in answers] == [RUN_CAP, 7, RUN_CAP]
    assert all(a["choices"][0]["finish_reason"] == "length" for a in answers)


def test_logprobs_are_each_tokens_behaviour_log_prob_in_openais_shape(tokenizer):
    """Through the ``openai`` SDK's own types: one entry per output token, the engine's log-prob, its text; with
    top_logprobs, the engine's most likely tokens for each."""
    from openai import AsyncOpenAI

    engine = ScriptedEngine(tokenizer, ["The answer is 42.", "Again.", "Top."])

    async def go():
        async with endpoint_of(engine, tokenizer) as episode:
            client = AsyncOpenAI(base_url=episode.base_url, api_key="unused", max_retries=0)
            with_logprobs = await client.chat.completions.create(
                model="policy", messages=USER, logprobs=True, top_logprobs=0
            )
            without = await client.chat.completions.create(model="policy", messages=USER)
            with_top = await client.chat.completions.create(
                model="policy", messages=USER, logprobs=True, top_logprobs=3
            )
            await client.close()
            return with_logprobs, without, with_top

    with_logprobs, without, with_top = asyncio.run(go())
    assert without.choices[0].logprobs is None
    content = with_logprobs.choices[0].logprobs.content
    completion = engine.calls[0].completion
    assert [t.logprob for t in content] == completion.logprobs.tolist()
    assert [t.token for t in content] == [tokenizer.decode([i]) for i in completion.output_ids.tolist()]
    assert "".join(t.token for t in content).startswith("The answer is 42.")
    assert all(t.bytes == list(t.token.encode()) and t.top_logprobs == [] for t in content)
    asked = engine.calls[2].completion
    for t, ids, lps in zip(with_top.choices[0].logprobs.content, asked.top_ids, asked.top_logprobs, strict=True):
        assert [a.token for a in t.top_logprobs] == [tokenizer.decode([i]) for i in ids.tolist()]
        assert [a.logprob for a in t.top_logprobs] == lps.tolist() and len(lps) == 3


def test_a_stop_string_ends_the_turn_and_nothing_after_it_is_trained(tokenizer):
    """The answer's content ends before the first stop string met; the sample's actions end with the token that
    completes it (its log-probs, kept sets and routing rows cut with it), so what the model wrote after it is not
    trained; the next turn forks from the history the agent sent."""
    engine = ScriptedEngine(tokenizer, ["Let me think. 6 * 7 = 42. DONE and more words after", "Sure."])

    async def go():
        async with endpoint_of(engine, tokenizer) as episode:
            _, first = await post(episode, {"messages": USER, "stop": ["DONE", "= 42"]})
            message = first["choices"][0]["message"]
            _, second = await post(episode, {"messages": [*USER, message, {"role": "user", "content": "Thanks"}]})
            return episode, first, second

    episode, first, second = asyncio.run(go())
    assert (
        first["choices"][0]["message"]["content"] == "Let me think. 6 * 7"
    )  # before the stop string, stripped as every content is
    assert first["choices"][0]["finish_reason"] == "stop"
    full = engine.calls[0].completion.output_ids.tolist()
    kept = first["usage"]["completion_tokens"]
    assert "= 42" in tokenizer.decode(full[:kept]) and "= 42" not in tokenizer.decode(full[: kept - 1])
    assert second["choices"][0]["message"]["content"] == "Sure."
    a, b = episode.samples(reward=1.0, temperature=1.0)  # the history left the cut text out: a fork
    assert a.response_ids.tolist() == full[:kept] and a.finish_reason == "stop"
    assert a.fed_len == len(a.routing) and np.array_equal(a.selected_logprobs, np.full(kept, -0.25, np.float32))
    assert_only_seen(b, engine.calls)


def test_a_call_past_the_budget_answers_an_empty_stop_and_the_episode_keeps_its_samples(tokenizer):
    """The turn that reaches rollout.max_episode_tokens answers length with its tokens; the next call generates
    nothing and answers an empty message with finish_reason stop, which agent loops end on."""
    engine = ScriptedEngine(tokenizer, ["word " * 60] * 2)

    async def go():
        prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True)["input_ids"]
        async with endpoint_of(engine, tokenizer, max_total_tokens=len(prompt) + 30) as episode:
            _, first = await post(episode, {"messages": USER, "logprobs": True})
            message = first["choices"][0]["message"]
            _, second = await post(episode, {"messages": [*USER, message, {"role": "user", "content": "More"}]})
            return episode, first, second

    episode, first, second = asyncio.run(go())
    assert first["choices"][0]["finish_reason"] == "length" and first["usage"]["completion_tokens"] == 30
    assert second["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": ""},
        "finish_reason": "stop",
        "logprobs": None,
    }
    assert episode.done and len(engine.calls) == 1
    (sample,) = episode.samples(reward=0.0, temperature=1.0)
    assert sample.finish_reason == "length" and sample.response_len == 30


@pytest.mark.parametrize("body", [{"messages": [{"role": "narrator", "content": "x"}]}, {"messages": []}])
def test_a_message_the_endpoint_cannot_render_is_refused_naming_it(tokenizer, body):
    async def go():
        async with endpoint_of(ScriptedEngine(tokenizer, []), tokenizer) as episode:
            return await post(episode, body)

    status, answer = asyncio.run(go())
    assert status == 400 and answer["error"]["param"].startswith("messages")
