"""What a reward function returns where it scores a response's steps as well as its outcome (process rewards,
:mod:`moerl.rewards.process`), and how a text is cut into the steps moerl cuts its tokens into."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Score:
    """A response's reward: its outcome and, where its reward function scores steps, one score per step, in order (as
    :func:`text_steps` cuts the response's text; None: no step scores)."""

    outcome: float
    steps: Sequence[float] | None = None

    @classmethod
    def of(cls, value: Any, where: str) -> Score:
        """What a reward function returned as a :class:`Score` (a number: the outcome alone); ``where`` names the
        function in the errors: an outcome that is no number, step scores that are not one finite number each."""
        outcome, steps = (value.outcome, value.steps) if isinstance(value, Score) else (value, None)
        try:
            outcome = float(outcome)
        except (TypeError, ValueError):
            raise TypeError(f"{where} returned {type(value).__name__}, not a number or a Score") from None
        if steps is None:
            return Score(outcome)
        try:
            scores = np.asarray(steps, dtype=np.float64)
        except (TypeError, ValueError):
            scores = None
        if scores is None or scores.ndim != 1:
            raise TypeError(f"{where} returned steps={steps!r}: one number per step, in order")
        if not np.isfinite(scores).all():
            raise ValueError(f"{where} returned a step score that is not finite: {scores.tolist()}")
        return Score(outcome, scores.tolist())


def text_steps(text: str, separator: str) -> list[str]:
    """The steps of a response's ``text`` as moerl cuts its tokens, without their separators: the pieces between
    separators that hold more than whitespace (a text with none: itself, one step)."""
    return [p for p in text.split(separator) if p.strip()] or [text]
