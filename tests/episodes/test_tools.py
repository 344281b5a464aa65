"""Tools: the runner answers a failing, hanging or unknown tool with the error as its output, counted; the built-in
calculator evaluates arithmetic and nothing else."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from moerl.engines.protocol import SamplingParams
from moerl.episodes import CALCULATOR, Episode, EpisodeSettings, Tool, calculator, run_tool
from tests.episodes.conftest import ScriptedEngine

NO_ARGS = {"type": "object", "properties": {}}


def _raise() -> str:
    raise RuntimeError("the service is down")


async def _hang() -> str:
    await asyncio.sleep(60)
    return "never"


def _hang_in_thread() -> str:
    time.sleep(0.5)  # a thread is not killed at the timeout: it runs on, answered for
    return "late"


TOOLS = [
    CALCULATOR,
    Tool("broken", _raise, "raises", NO_ARGS),
    Tool("stuck", _hang, "hangs", NO_ARGS, timeout_s=0.05),
    Tool("stuck_sync", _hang_in_thread, "hangs in a thread", NO_ARGS, timeout_s=0.05),
    Tool("structured", lambda: {"rows": [1, 2]}, "returns JSON", NO_ARGS),
]


def call(name: str, arguments: str = "{}", id: str = "call_0") -> dict:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_failing_and_hanging_tools_answer_with_their_error_and_count_as_failures(tokenizer):
    episode = Episode(
        [5, 6], {}, ScriptedEngine(tokenizer, []), EpisodeSettings(tokenizer, SamplingParams(), tools=TOOLS)
    )
    calls = [
        call("calculator", json.dumps({"expression": "6 * 7"}), "a"),
        call("broken", id="b"),
        call("stuck", id="c"),
        call("stuck_sync", id="d"),
        call("nope", id="e"),
        call("calculator", "{not json", "f"),
        call("calculator", json.dumps({"expression": "1 / 0"}), "g"),
        call("structured", id="h"),
    ]

    async def timed():
        start = time.perf_counter()
        messages = await episode.run_tools(calls)
        return messages, time.perf_counter() - start

    # asyncio.run returns once the hung thread ends; the answers came before.
    messages, took = asyncio.run(timed())
    assert took < 0.4  # run at once, none waited for past its timeout
    assert [m["tool_call_id"] for m in messages] == list("abcdefgh")
    assert all(m["role"] == "tool" for m in messages)
    content = [m["content"] for m in messages]
    assert content[0] == "42"
    assert content[1] == "Error: RuntimeError: the service is down"
    assert content[2] == "Error: stuck timed out after 0.05 s"
    assert content[3] == "Error: stuck_sync timed out after 0.05 s"
    assert content[4].startswith("Error: no tool named 'nope'")
    assert content[5].startswith("Error: the arguments are not JSON")
    assert content[6] == "Error: ZeroDivisionError: division by zero"
    assert content[7] == '{"rows": [1, 2]}'
    assert episode.stats.tool_failures == 6


def test_arguments_that_are_not_an_object_or_do_not_fit_the_function_fail():
    tools = {t.name: t for t in TOOLS}
    assert asyncio.run(run_tool(tools, call("calculator", "[1]"))).failed
    out = asyncio.run(run_tool(tools, call("calculator", '{"expr": "1"}')))
    assert out.failed and out.message["content"].startswith("Error: TypeError")


@pytest.mark.parametrize(
    ("expression", "value"),
    [("2 * (3 + 4)", "14"), ("7 / 2", "3.5"), ("2 ** 10", "1024"), ("-3 + +2", "-1"), ("10 // 3", "3"), ("4.0", "4")],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression", ['__import__("os").system("true")', "x + 1", "(1).real", "9 ** 9 ** 9", "(-8) ** 0.5", "True + 1"]
)
def test_calculator_refuses_what_is_not_arithmetic(expression):
    with pytest.raises(ValueError):
        calculator(expression)
