"""Multi-turn agentic episodes: an agent's exact token stream across turns and tool calls, and the samples it yields.

:class:`~moerl.episodes.episode.Episode` keeps the stream (forking where a chat rendering breaks it), the routing and
kept sets across turns, and the per-token masks; :mod:`~moerl.episodes.tools` runs tools; :mod:`~moerl.episodes.agents`
holds built-in agents; :mod:`~moerl.episodes.parsing` parses assistant turns.
"""

from moerl.episodes.agents import Agent, load_agent, load_tools, tool_agent
from moerl.episodes.episode import Episode, EpisodeDone, EpisodeError, EpisodeSettings, EpisodeStats, Generate, Turn
from moerl.episodes.parsing import ParsedTurn, parse_hermes
from moerl.episodes.tools import CALCULATOR, Tool, ToolOutput, calculator, run_tool

__all__ = [
    "CALCULATOR",
    "Agent",
    "Episode",
    "EpisodeDone",
    "EpisodeError",
    "EpisodeSettings",
    "EpisodeStats",
    "Generate",
    "ParsedTurn",
    "Tool",
    "ToolOutput",
    "Turn",
    "calculator",
    "load_agent",
    "load_tools",
    "parse_hermes",
    "run_tool",
    "tool_agent",
]
