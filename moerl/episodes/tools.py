"""Tools an agent's model may call: plain Python callables with OpenAI function schemas, and their runner.

A tool is called with the keyword arguments its call names. A tool that raises, is unknown, gets arguments that are not
a JSON object, or outlives its timeout answers the model with the error as its output text (as agent frameworks do)
and counts as a failure: the episode goes on, and the model may correct itself.

Tools run without blocking the event loop: coroutine functions are awaited, plain functions run in a thread
(``asyncio.to_thread``). A thread cannot be killed: a sync tool past its timeout is answered for but keeps running to
its end, holding a worker thread. Sync tools should be quick; slow or I/O-bound ones should be coroutines (cancelled at
the timeout).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]  # called with the call's arguments as keywords; a coroutine function is awaited
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    timeout_s: float = DEFAULT_TIMEOUT_S

    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema (what a chat template lists)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class ToolOutput:
    message: dict[str, Any]  # the OpenAI tool message: {"role": "tool", "tool_call_id", "name", "content"}
    failed: bool


async def run_tool(tools: Mapping[str, Tool], call: dict[str, Any]) -> ToolOutput:
    """Run the OpenAI tool call ``call`` (``{"id", "function": {"name", "arguments"}}``) with the tool of its name."""
    function = call.get("function", {})
    name = function.get("name", "")

    def answer(content: str, failed: bool) -> ToolOutput:
        return ToolOutput(
            {"role": "tool", "tool_call_id": call.get("id", ""), "name": name, "content": content}, failed
        )

    tool = tools.get(name)
    if tool is None:
        return answer(f"Error: no tool named {name!r} (tools: {', '.join(sorted(tools)) or 'none'})", True)
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError as e:
        return answer(f"Error: the arguments are not JSON: {e}", True)
    if not isinstance(arguments, dict):
        return answer("Error: the arguments are not a JSON object", True)
    try:
        if inspect.iscoroutinefunction(tool.fn):
            result = await asyncio.wait_for(tool.fn(**arguments), tool.timeout_s)
        else:
            result = await asyncio.wait_for(asyncio.to_thread(tool.fn, **arguments), tool.timeout_s)
    except TimeoutError:
        return answer(f"Error: {name} timed out after {tool.timeout_s:g} s", True)
    except Exception as e:  # noqa: BLE001 - whatever a tool raises is the model's answer, not the episode's end
        return answer(f"Error: {type(e).__name__}: {e}", True)
    return answer(result if isinstance(result, str) else json.dumps(result, ensure_ascii=False), False)


# ---- calculator ---------------------------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_RESULT_BITS = 4096  # an integer power past this is refused: 9**9**9 would take the thread for minutes
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """The value of an arithmetic expression: numbers, + - * / // % **, parentheses. Parsed with ``ast`` and evaluated
    node by node (no ``eval``): names, calls and attributes are refused."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and abs(right) * left.bit_length() > MAX_RESULT_BITS:
            raise ValueError(f"the power has more than {MAX_RESULT_BITS} bits")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex):  # a negative number to a fractional power
            raise ValueError(f"{ast.unparse(node)!r} is not a real number")
        return value
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


CALCULATOR = Tool(
    name="calculator",
    fn=calculator,
    description="Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (2 + 3) * 4"}},
        "required": ["expression"],
    },
)
