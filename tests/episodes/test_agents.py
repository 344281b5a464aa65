"""Agents and tools named in config: built-in names or ``package.module:name``, refused with the key named."""

from __future__ import annotations

import pytest

from moerl.episodes import CALCULATOR, load_agent, load_tools, tool_agent
from moerl.errors import ConfigError


def test_built_in_and_imported_agents_and_tools_load():
    assert load_agent("tool_agent") is tool_agent
    assert load_agent("moerl.episodes.agents:tool_agent") is tool_agent
    assert load_tools(["calculator"]) == [CALCULATOR]
    assert load_tools(["moerl.episodes.tools:CALCULATOR"]) == [CALCULATOR]


@pytest.mark.parametrize(
    ("load", "name", "message"),
    [
        (
            load_agent,
            "no_such_agent",
            "rollout.agent='no_such_agent': expected one of tool_agent or 'package.module:name'",
        ),
        (load_agent, "moerl.episodes.tools:calculator", "is not an async function"),
        (load_tools, ["moerl.episodes.tools:calculator"], "not a moerl.episodes.tools.Tool"),
        (load_tools, ["calculator", "moerl.episodes.tools:CALCULATOR"], "two tools share a name"),
        (load_tools, ["nope.module:TOOL"], "cannot be loaded"),
    ],
)
def test_what_is_not_an_agent_or_a_tool_is_refused(load, name, message):
    with pytest.raises(ConfigError, match=message):
        load(name)
