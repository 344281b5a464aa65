"""Assistant turns parsed into OpenAI message parts: the Qwen2.5/Qwen3 (hermes-style) format.

A turn's text may open with a reasoning block (``<think>...</think>``; Qwen3 templates that open it in the generation
prompt leave only the closing tag) and holds tool calls as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`` blocks. A block that is not a JSON object with a string ``name`` and object ``arguments`` stays in the
content, as text the model wrote, and is counted as malformed: the caller never acts on half a call. Arguments are
serialised as Qwen's chat templates write them (``json.dumps``, non-ASCII kept), so a well-formed call renders back to
the tokens the model produced.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
UNCLOSED_TOOL_CALL = "<tool_call>"


@dataclass
class ParsedTurn:
    content: str  # the text besides reasoning and well-formed tool calls, stripped
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments": JSON string}
    reasoning: str | None = None  # the think block's text, None where there was none
    malformed: int = 0  # tool-call blocks left in the content: not JSON, no name, arguments not an object, unclosed


def parse_hermes(text: str) -> ParsedTurn:
    """``text`` (a decoded assistant turn, special tokens skipped) split into content, tool calls and reasoning."""
    reasoning = None
    if THINK_CLOSE in text:
        reasoning, text = text.split(THINK_CLOSE, 1)
        reasoning = reasoning.split(THINK_OPEN, 1)[-1].strip()
    elif THINK_OPEN in text:  # cut off while reasoning: all of it is reasoning
        before, reasoning = text.split(THINK_OPEN, 1)
        text, reasoning = before, reasoning.strip()
    calls: list[dict[str, Any]] = []
    malformed = 0
    kept: list[str] = []  # the content's pieces: text between calls, and malformed blocks as written
    last = 0
    for match in TOOL_CALL.finditer(text):
        kept.append(text[last : match.start()])
        call = _call(match.group(1))
        if call is None:
            malformed += 1
            kept.append(match.group(0))
        else:
            calls.append(call)
        last = match.end()
    rest = text[last:]
    malformed += rest.count(UNCLOSED_TOOL_CALL)  # cut off mid-call (the turn hit its token limit)
    kept.append(rest)
    return ParsedTurn("".join(kept).strip(), calls, reasoning, malformed)


def _call(body: str) -> dict[str, Any] | None:
    """A tool call's ``{"name", "arguments"}`` from a block's JSON, None where it is not one."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))  # SGLang's detectors accept either name
    if not isinstance(arguments, dict):
        return None
    return {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}
