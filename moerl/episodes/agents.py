"""Built-in agents, and the agents and tools a run's config names.

An agent is ``async agent(episode, record) -> reward | None``: it drives an :class:`Episode` and returns a reward, or
None to have the task's reward function score :attr:`Episode.final_text`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from moerl.episodes.episode import Episode
from moerl.episodes.tools import CALCULATOR, Tool
from moerl.errors import ConfigError
from moerl.plugins import Registry
from moerl.simulation import EpisodeProfile

Agent = Callable[[Episode, Mapping[str, Any]], Awaitable[float | None]]
MAX_TURNS = 8  # model turns of a tool_agent episode; a record's "max_turns" overrides it


def _not_an_agent(agent: Any) -> str | None:
    return None if inspect.iscoroutinefunction(agent) else "is not an async function (async def agent(episode, record))"


def _not_a_tool(tool: Any) -> str | None:
    return None if isinstance(tool, Tool) else f"is {type(tool).__name__}, not a moerl.episodes.tools.Tool"


AGENTS: Registry[Agent] = Registry("rollout.agent", _not_an_agent)
TOOLS: Registry[Tool] = Registry("rollout.tools", _not_a_tool)
TOOLS.register(CALCULATOR.name)(CALCULATOR)


@AGENTS.register("tool_agent")
async def tool_agent(episode: Episode, record: Mapping[str, Any]) -> float | None:
    """Chat with the episode's tools: each turn's tool calls are run and answered, until a turn calls none, the
    episode ends (its token budget) or ``max_turns`` turns have run. The record's ``prompt`` is the user message
    (after its ``system`` one, if any); the last turn's content is the final answer, left to the task's reward."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    messages.append({"role": "user", "content": record["prompt"]})
    tools = episode.tool_schemas()
    for _ in range(record.get("max_turns", MAX_TURNS)):
        reply = await episode.chat(messages, tools=tools)
        calls = reply.get("tool_calls")
        if not calls or episode.done:
            break
        messages.append(reply)
        messages.extend(await episode.run_tools(calls))
    return None


SIMULATED = "simulated"  # rollout.agent of a simulation: the episodes its profile describes


def simulated_agent(profile: EpisodeProfile, time_scale: float, seed: int) -> Agent:
    """The agent of a simulation (``rollout.agent=simulated``): token-level turns, as many as ``profile`` draws for the
    episode, each after a tool's wait (simulated seconds, at ``time_scale``) and its output (random token ids: a tool's
    costs in the manager and the engine). Reproducible per episode; the task's reward scores the last turn."""

    async def agent(episode: Episode, record: Mapping[str, Any]) -> None:
        rng = np.random.default_rng([seed, episode.group_id, episode.index])
        observation: list[int] = []
        for _ in range(max(1, round(profile.turns.draw(rng))) - 1):
            await episode.generate(observation)
            if episode.done:
                return None
            await asyncio.sleep(profile.tool_seconds.draw(rng) / time_scale)
            observation = rng.integers(0, len(episode.tokenizer), round(profile.observation_tokens.draw(rng))).tolist()
        await episode.generate(observation)
        return None

    return agent


def load_agent(name: str) -> Agent:
    """A built-in agent by name, or ``package.module:function`` (a coroutine function); :class:`ConfigError` if not."""
    return AGENTS.load(name)


def load_tools(names: list[str]) -> list[Tool]:
    """Built-in tools by name, or ``package.module:TOOL`` (a :class:`Tool`), with distinct names."""
    tools = [TOOLS.load(name) for name in names]
    seen = [tool.name for tool in tools]
    if len(set(seen)) != len(seen):
        raise ConfigError(f"rollout.tools: two tools share a name ({', '.join(seen)})")
    return tools
