"""The task's reward functions (``task.reward``): the built-in ones, registered here, or ``package.module:function``.

A reward function is ``f(response, answer, prompt) -> float``, plain or ``async``; with ``task.group_reward`` it scores
a whole group at once, ``f(responses, answer, prompt) -> list[float]``. In place of a float it may return a
:class:`~moerl.rewards.score.Score`: the outcome and a score per step of the response (process rewards).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moerl.plugins import Registry, callable_problem
from moerl.rewards.score import Score

REWARDS: Registry[Callable[..., Any]] = Registry("task.reward", callable_problem)


@REWARDS.register("exact")
def exact(response: str, answer: Any, prompt: str = "") -> float:
    """1 when the response, stripped, is the answer."""
    return float(response.strip() == str(answer).strip())


def gsm8k_gold(answer: str) -> str:
    """GSM8K answers end with ``#### <number>``; other answers are taken whole."""
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


@REWARDS.register("math")
def math(response: str, answer: Any, prompt: str = "") -> float:
    """1 when math-verify finds the response's final answer equal to the gold one (LaTeX, boxed, plain)."""
    from math_verify import parse, verify

    # math-verify's own timeouts use SIGALRM, which only works in the main thread; rewards run in workers.
    gold = parse(f"${gsm8k_gold(str(answer))}$", parsing_timeout=None)
    predicted = parse(response, parsing_timeout=None)
    return float(bool(gold) and bool(predicted) and verify(gold, predicted, timeout_seconds=None))


@REWARDS.register("tiny")
def tiny(response: str, answer: Any, prompt: str = "") -> float:
    from moerl.tasks.tiny import reward

    return reward(response, answer, prompt)


@REWARDS.register("calc")
def calc(response: str, answer: Any, prompt: str = "") -> float:
    from moerl.tasks.calc import reward

    return reward(response, answer, prompt)


@REWARDS.register("sums")
def sums(response: str, answer: Any, prompt: str = "") -> float:
    from moerl.tasks.sums import reward

    return reward(response, answer, prompt)


@REWARDS.register("sums_steps")
def sums_steps(response: str, answer: Any, prompt: str = "") -> Score:
    """The sums task's outcome and each step's exact score (a rule's process reward)."""
    from moerl.tasks.sums import step_reward

    return step_reward(response, answer, prompt)
