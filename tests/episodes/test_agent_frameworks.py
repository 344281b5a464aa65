"""Agent code written with real client libraries (the OpenAI Agents SDK, LangChain) at an episode's endpoint: their
tool loops against a scripted model, a run that spends its token budget in the loop, structured output refused; and
both driving a short agent run of the rollout manager over the warmed-up calc model."""

from __future__ import annotations

import asyncio

import openai
import pytest

from moerl.orchestrator.messages import Dropped, GroupDone
from tests.episodes import agents
from tests.episodes.conftest import ScriptedEngine, assert_only_seen, endpoint_of
from tests.episodes.test_agent_runs import agent_run_events

RECORD = {"prompt": "6*7", "answer": "42"}
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "6*7"}}\n</tool_call>'
AGENTS = {"agents_sdk": agents.agents_sdk_calc_agent, "langchain": agents.langchain_calc_agent}


def _budget_after_first_turn(engine: ScriptedEngine, room: int):
    """``engine``, and a hook that sets the episode's token budget where its first turn ended, plus ``room``."""
    box = {}

    async def generate(input_ids, params, start, top_logprobs=0):
        completion, versions = await engine(input_ids, params, start, top_logprobs)
        if len(engine.calls) == 1:
            box["episode"].max_total_tokens = len(input_ids) + len(completion.output_ids) + room
        return completion, versions

    return generate, box


@pytest.mark.parametrize("framework", sorted(AGENTS))
def test_a_frameworks_tool_loop_runs_at_the_endpoint_as_written(framework, tokenizer):
    """The framework sends the tool, runs the model's call itself and sends the result back; the answer that follows
    is the episode's final text, and every sample holds only what the engine saw and wrote."""
    engine = ScriptedEngine(tokenizer, [CALL, "42"])

    async def go():
        async with endpoint_of(engine, tokenizer) as episode:
            await AGENTS[framework](episode, RECORD)
            return episode

    episode = asyncio.run(go())
    assert len(engine.calls) == 2 and episode.stats.tool_calls == 1 and episode.final_text == "42"
    assert "<tool_response>\n42\n</tool_response>" in tokenizer.decode(engine.calls[1].input_ids)
    for sample in episode.samples(reward=1.0, temperature=1.0):
        assert_only_seen(sample, engine.calls)


@pytest.mark.parametrize("framework", sorted(AGENTS))
def test_a_frameworks_loop_that_spends_the_budget_ends_cleanly_and_keeps_its_sample(framework, tokenizer):
    """The tool's answer does not fit the budget: the call after it generates nothing and is answered with an empty
    stop, which the framework takes as the loop's end (the Agents SDK raises on an empty length answer)."""
    engine = ScriptedEngine(tokenizer, [CALL, "42"])
    generate, box = _budget_after_first_turn(engine, room=3)

    async def go():
        async with endpoint_of(ScriptedEngine(tokenizer, []), tokenizer) as episode:
            episode._generate = generate
            box["episode"] = episode
            await AGENTS[framework](episode, RECORD)  # returns: no exception
            return episode

    episode = asyncio.run(go())
    assert len(engine.calls) == 1 and episode.done and episode.finish_reason == "length"
    (sample,) = episode.samples(reward=0.0, temperature=1.0)
    assert sample.response_ids.tolist() == engine.calls[0].completion.output_ids.tolist()


def test_structured_output_is_refused_naming_the_field_never_answered_as_free_text(tokenizer):
    """The Agents SDK's output_type and LangChain's with_structured_output (either method) need constrained decoding:
    each request is refused with a 400 that names the field, and the framework raises it."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Answer(BaseModel):
        value: int

    set_tracing_disabled(True)
    engine = ScriptedEngine(tokenizer, ["42"] * 3)

    async def go():
        refused = {}
        async with endpoint_of(engine, tokenizer) as episode:
            client = openai.AsyncOpenAI(base_url=episode.base_url, api_key="unused", max_retries=0)
            model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
            with pytest.raises(openai.BadRequestError) as e:
                await Runner.run(Agent(name="a", model=model, output_type=Answer), "6*7")
            refused["agents_sdk"] = e.value.param
            await client.close()
            llm = ChatOpenAI(model="policy", base_url=episode.base_url, api_key="unused", max_retries=0)
            for method in ("json_schema", "function_calling", "json_mode"):
                with pytest.raises(openai.BadRequestError) as e:
                    await llm.with_structured_output(Answer, method=method).ainvoke("6*7")
                refused[method] = e.value.param
        return refused

    refused = asyncio.run(go())
    # function calling forces the one tool, alone: tool_choice and parallel_tool_calls=false, the first of them named
    assert refused.pop("function_calling") in ("tool_choice", "parallel_tool_calls")
    assert refused == {
        "agents_sdk": "response_format",
        "json_schema": "response_format",
        "json_mode": "response_format",
    }
    assert not engine.calls


# A budget a little past the prompt (the first prompt is 312-313 tokens with the Agents SDK's rendering of the tool,
# about 295 with CALC's, which LangChain sends): each framework's first turns are cut within a few tokens.
BUDGETS = {"agents_sdk": 314, "langchain": 300}


@pytest.mark.parametrize("framework", sorted(AGENTS))
def test_a_frameworks_agent_run_trains_every_episode_within_its_budget(framework, calc_model, tmp_path):
    """The rollout manager runs the framework's agent over the warmed-up calc model with a tight token budget: every
    episode yields its samples (none is lost to its agent), and those that spent the budget are counted, their last
    sample truncated."""

    overrides = [
        f"rollout.agent=tests.episodes.agents:{AGENTS[framework].__name__}",
        "rollout.samples_per_prompt=4",
        f"rollout.max_episode_tokens={BUDGETS[framework]}",
    ]
    groups = agent_run_events(calc_model, tmp_path, overrides, groups=2, kinds=(GroupDone, Dropped))
    for done in groups:
        assert isinstance(done, GroupDone), f"prompt {done.index} dropped ({done.reason}): every episode failed"
        assert done.episodes is not None and done.episodes["episode/episodes"] == 4
        assert not any(k.startswith("episode/failed_") for k in done.episodes), done.episodes
        assert sorted({s.episode for s in done.samples}) == [0, 1, 2, 3]
        # cut at the budget, or a turn at max_new_tokens
        cut = {s.episode for s in done.samples if s.finish_reason == "length"}
        assert len(cut) >= done.episodes["episode/truncated"]
    assert sum(done.episodes["episode/truncated"] for done in groups) >= 1
