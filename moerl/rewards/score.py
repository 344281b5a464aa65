"""What a reward function returns where it scores a response's steps as well as its outcome (process rewards,
:mod:`moerl.rewards.process`), and how a text is cut into the steps moerl cuts its tokens into."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Score:
    """A response's reward: its outcome and, where its reward function scores steps, one score per step, in order (as
    :func:`text_steps` cuts the response's text; None: no step scores)."""

    outcome: float
    steps: Sequence[float] | None = None

    @classmethod
    def of(cls, value: Any, where: str) -> Score:
        """What a reward function returned as a :class:`Score` (a number: the outcome alone); ``where`` names the
        function in the error."""
        if isinstance(value, Score):
            return Score(float(value.outcome), None if value.steps is None else [float(x) for x in value.steps])
        try:
            return Score(float(value))
        except (TypeError, ValueError):
            raise TypeError(f"{where} returned {type(value).__name__}, not a number or a Score") from None


def text_steps(text: str, separator: str) -> list[str]:
    """The steps of a response's ``text`` as moerl cuts its tokens, without their separators: the pieces between
    separators that hold more than whitespace (a text with none: itself, one step)."""
    return [p for p in text.split(separator) if p.strip()] or [text]
