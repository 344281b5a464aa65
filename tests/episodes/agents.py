"""Agents and tools the rollout-manager episode tests name in config (``rollout.agent=tests.episodes.agents:...``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from moerl.episodes.episode import Episode
from moerl.episodes.tools import Tool, calculator
from moerl.tasks.calc import CALC


async def openai_calc_agent(episode: Episode, record: dict[str, Any]) -> float | None:
    """Agent code as written for the ``openai`` SDK: chat with the calculator tool through the episode's base URL,
    answering each tool call, until a reply calls none; the task's reward scores the last reply."""
    from openai import AsyncOpenAI

    assert episode.base_url is not None
    client = AsyncOpenAI(base_url=episode.base_url, api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": record["prompt"]}]
    try:
        for _ in range(3):
            reply = await client.chat.completions.create(model="tiny", messages=messages, tools=[CALC.schema()])
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
