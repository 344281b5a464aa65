"""How the task's reward and a reward model's score make the reward (``reward.combine``): a built-in combination,
registered here, or ``package.module:function`` ``f(rule_reward, model_score) -> float``."""

from __future__ import annotations

from collections.abc import Callable

from moerl.plugins import Registry, callable_problem

Combination = Callable[[float, float], float]
COMBINATIONS: Registry[Combination] = Registry("reward.combine", callable_problem)


@COMBINATIONS.register("model")
def model_only(rule: float, score: float) -> float:
    return score


@COMBINATIONS.register("rule_times_model")
def rule_times_model(rule: float, score: float) -> float:
    """The task's reward gates the model's score (a wrong answer gets nothing, however well written)."""
    return rule * score


@COMBINATIONS.register("rule_plus_model")
def rule_plus_model(rule: float, score: float) -> float:
    return rule + score
