"""Agents and tools the rollout-manager episode tests name in config (``rollout.agent=tests.episodes.agents:...``)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

from moerl.episodes.episode import Episode
from moerl.episodes.tools import Tool, calculator
from moerl.tasks.calc import CALC


async def openai_calc_agent(episode: Episode, record: dict[str, Any]) -> float | None:
    """Agent code as written for the ``openai`` SDK: chat with the calculator tool through the episode's base URL,
    answering each tool call, until a reply calls none, reading each reply's log-probs; the task's reward scores the
    last reply."""
    from openai import AsyncOpenAI

    assert episode.base_url is not None
    client = AsyncOpenAI(base_url=episode.base_url, api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": record["prompt"]}]
    try:
        for _ in range(3):
            reply = await client.chat.completions.create(
                model="tiny", messages=messages, tools=[CALC.schema()], logprobs=True, top_logprobs=2
            )
            # each token's behaviour log-prob, with the engine's two most likely tokens (it samples at temperature 1)
            tokens = reply.choices[0].logprobs.content
            assert reply.usage is not None and len(tokens) == reply.usage.completion_tokens
            assert all(t.logprob <= t.top_logprobs[0].logprob + 1e-6 for t in tokens)
            assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in tokens)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                result = calculator(**json.loads(call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    finally:
        await client.close()
    return None


def _broken(**_: Any) -> str:
    raise RuntimeError("the tool broke")


async def _hanging(**_: Any) -> str:
    await asyncio.sleep(3600)
    return ""


BROKEN = Tool(name="broken", fn=_broken, description="raises", parameters={"type": "object", "properties": {}})
HANGING = Tool(
    name="hanging",
    fn=_hanging,
    description="never answers",
    parameters={"type": "object", "properties": {}},
    timeout_s=0.5,
)


async def _turn_then_tool(episode: Episode, tool: str) -> float:
    await episode.generate()
    (answer,) = await episode.run_tools([{"id": "call_0", "type": "function", "function": {"name": tool}}])
    assert answer["content"].startswith("Error:"), answer
    await episode.generate(episode.tokenizer(answer["content"], add_special_tokens=False)["input_ids"])
    return 1.0


async def failing_agent(episode: Episode, record: dict[str, Any]) -> float | None:
    """By episode: 0 raises, 1 never returns, 2 calls a tool that raises, 3 one that hangs past its timeout; the others
    take one turn. Prompt 1's episodes all raise."""
    if episode.group_id == 1 or episode.index == 0:
        raise RuntimeError("the agent broke")
    if episode.index == 1:
        await asyncio.Event().wait()
    if episode.index == 2:
        return await _turn_then_tool(episode, "broken")
    if episode.index == 3:
        return await _turn_then_tool(episode, "hanging")
    await episode.generate()
    return 0.0


# Shared with the test around an update in the middle of an episode: the episodes whose first turn is done, and the
# event that lets their second turns start (made in the test's event loop).
FIRST_TURNS_DONE: list[int] = []
SECOND_TURN_MAY_START: asyncio.Event | None = None


async def two_turn_agent(episode: Episode, record: dict[str, Any]) -> float | None:
    """A turn, a wait for the test (which updates the weights meanwhile), a few context tokens, another turn."""
    assert SECOND_TURN_MAY_START is not None
    await episode.generate()
    FIRST_TURNS_DONE.append(episode.index)
    await SECOND_TURN_MAY_START.wait()
    await episode.generate(episode.tokenizer("ok", add_special_tokens=False)["input_ids"])
    return float(episode.index)


async def engines_gone_agent(episode: Episode, record: dict[str, Any]) -> float | None:
    """As an agent whose turn found no engine healthy for engines.down_timeout_s."""
    from moerl.errors import EnginesDown

    raise EnginesDown("no engine replica has been healthy")


def _calc(expression: str) -> str:
    """a*b"""
    return calculator(expression=expression)


async def agents_sdk_calc_agent(episode: Episode, record: dict[str, Any]) -> float | None:
    """Agent code as written for the OpenAI Agents SDK: an ``Agent`` with a ``@function_tool`` calculator on an
    ``OpenAIChatCompletionsModel`` at the episode's base URL, run by ``Runner.run``; the task's reward scores the last
    reply."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK would export its traces to OpenAI
    client = AsyncOpenAI(base_url=episode.base_url, api_key="unused", max_retries=0)
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    # The tiny model reads characters and was warmed up on CALC's own schema: the tool shows it that one.
    calc = replace(function_tool(_calc, name_override="calc", strict_mode=False), params_json_schema=CALC.parameters)
    agent = Agent(name="calc", model=model, tools=[calc])
    try:
        await Runner.run(agent, record["prompt"], max_turns=3)
    finally:
        await client.close()
    return None


async def langchain_calc_agent(episode: Episode, record: dict[str, Any]) -> float | None:
    """Agent code as written for LangChain: ``ChatOpenAI`` at the episode's base URL with the calculator bound as a
    tool, answering each call with a ``ToolMessage`` until a reply calls none."""
    from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    calc = tool("calc", description="a*b")(_calc)
    # The tiny model reads characters and was warmed up on CALC's own schema: bind_tools takes it as it is.
    llm = ChatOpenAI(model="policy", base_url=episode.base_url, api_key="unused", max_retries=0).bind_tools(
        [CALC.schema()]
    )
    messages: list[BaseMessage] = [HumanMessage(record["prompt"])]
    for _ in range(3):
        reply = await llm.ainvoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            messages.append(ToolMessage(calc.invoke(call["args"]), tool_call_id=call["id"]))
    return None


async def grouped_engines_gone_agent(episode: Episode, record: dict[str, Any]) -> float | None:
    """As an agent whose own task group wraps what its turn raised: engines found down, beside another failure."""
    from moerl.errors import EnginesDown

    raise ExceptionGroup(
        "the agent's tasks",
        [RuntimeError("a sibling task failed"), ExceptionGroup("a turn", [EnginesDown("no replica has been healthy")])],
    )


async def endpoint_engines_gone_agent(episode: Episode, record: dict[str, Any]) -> float | None:
    """Calls its endpoint with the ``openai`` SDK from a task group (the test makes the turn find no engine): what the
    agent raises is the SDK's 500 error, wrapped in the group's ExceptionGroup."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=episode.base_url, api_key="unused", max_retries=0)
    try:
        async with asyncio.TaskGroup() as group:
            messages = [{"role": "user", "content": record["prompt"]}]
            group.create_task(client.chat.completions.create(model="policy", messages=messages))
    finally:
        await client.close()
    return None


async def spends_budget_then_raises_agent(episode: Episode, record: dict[str, Any]) -> float | None:
    """Generates until the episode's token budget is spent, then raises (from a task group)."""
    while not episode.done:
        await episode.generate(episode.tokenizer(" more", add_special_tokens=False)["input_ids"])
    raise ExceptionGroup("the agent's tasks", [RuntimeError("the agent broke after its budget")])
