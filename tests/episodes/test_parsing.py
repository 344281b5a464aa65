"""The Qwen (hermes-style) turn parser: tool calls, malformed ones kept as content, reasoning blocks."""

from __future__ import annotations

import json

from moerl.episodes import parse_hermes


def test_a_call_with_text_before_it():
    parsed = parse_hermes('Let me add.\n<tool_call>\n{"name": "calc", "arguments": {"a": 1, "b": "é"}}\n</tool_call>')
    assert parsed.content == "Let me add."
    assert parsed.tool_calls == [{"name": "calc", "arguments": '{"a": 1, "b": "é"}'}]
    assert parsed.reasoning is None and parsed.malformed == 0


def test_several_calls_in_order():
    text = "\n".join(
        f'<tool_call>\n{{"name": "f{i}", "arguments": {json.dumps({"i": i})}}}\n</tool_call>' for i in range(3)
    )
    parsed = parse_hermes(text)
    assert [c["name"] for c in parsed.tool_calls] == ["f0", "f1", "f2"]
    assert [json.loads(c["arguments"]) for c in parsed.tool_calls] == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert parsed.content == ""


def test_malformed_calls_stay_content_and_are_counted():
    bad_json = '<tool_call>\n{"name": "f", "arguments": {\n</tool_call>'
    no_name = '<tool_call>\n{"arguments": {}}\n</tool_call>'
    bad_arguments = '<tool_call>\n{"name": "f", "arguments": "x=1"}\n</tool_call>'
    good = '<tool_call>\n{"name": "g", "parameters": {"x": 1}}\n</tool_call>'
    unclosed = '<tool_call>\n{"name": "h", "argu'
    parsed = parse_hermes(f"{bad_json}\n{no_name}\n{bad_arguments}\n{good}\n{unclosed}")
    assert parsed.tool_calls == [{"name": "g", "arguments": '{"x": 1}'}]
    assert parsed.malformed == 4
    assert parsed.content == f"{bad_json}\n{no_name}\n{bad_arguments}\n\n{unclosed}"


def test_a_think_block_is_reasoning():
    parsed = parse_hermes("<think>\nfirst 2, then 3\n</think>\n\nIt is 5.")
    assert (parsed.reasoning, parsed.content, parsed.tool_calls) == ("first 2, then 3", "It is 5.", [])
    # Templates that open the block in the generation prompt leave only its end in the output.
    assert parse_hermes("thinking\n</think>\nDone.").reasoning == "thinking"
    # Cut off while thinking: all of it is reasoning, nothing is content.
    cut = parse_hermes("<think>\nstill going")
    assert (cut.reasoning, cut.content) == ("still going", "")


def test_plain_text():
    parsed = parse_hermes("  Just an answer.\n")
    assert (parsed.content, parsed.tool_calls, parsed.reasoning, parsed.malformed) == ("Just an answer.", [], None, 0)
