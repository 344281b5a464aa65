"""Rewards: the task's reward function (:mod:`~moerl.rewards.rules`) or a remote verifier
(:mod:`~moerl.rewards.remote`), and beside it a reward model on engines of its own (:mod:`~moerl.rewards.model`, a
classifier, or a judge: :mod:`~moerl.rewards.judge`) whose score makes the reward with the task's by a combination
(:mod:`~moerl.rewards.combine`).

Every reward is scored through :class:`Rewarder`, asynchronously: coroutine functions are awaited,
plain functions run in worker threads (a slow checker never stalls the rollout loop), remote
verifiers are called over HTTP, and group rewards see the whole group at once. With a reward model, its scores
are asked for at the same time, and each response's reward is ``combine(rule reward, model score)``. A reward function
may score a response's steps too (:class:`~moerl.rewards.rules.Score`); they pass through the combination untouched.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moerl.rewards.remote import Verifier
from moerl.rewards.rules import REWARDS
from moerl.rewards.score import Score
from moerl.tasks import TASKS, TaskConfig

if TYPE_CHECKING:
    from moerl.rewards.combine import Combination
    from moerl.rewards.model import RewardModel, Stats


class Rewarder:
    def __init__(self, cfg: TaskConfig, model: RewardModel | None = None, combine: Combination | None = None):
        """``model`` and ``combine``: a reward model, and how its score and the task's reward make the reward."""
        self.cfg, self.model, self.combine = cfg, model, combine
        self.verifier = Verifier(cfg.reward_url) if cfg.reward_url else None
        self.fn: Callable | None = None if self.verifier else REWARDS.load(cfg.reward or TASKS[cfg.name])
        self.where = (
            f"task.reward_url={cfg.reward_url}" if cfg.reward_url else f"task.reward={cfg.reward or TASKS[cfg.name]}"
        )

    async def _call(self, fn: Callable, *args) -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        return await asyncio.to_thread(fn, *args)

    async def score(self, responses: list[str], answer: Any, prompt: str, stats: Stats | None = None) -> list[Score]:
        """One score per response of a group; ``stats``: the reward model's counts (``reward_engines/*``)."""
        if self.model is None:
            return await self._rules(responses, answer, prompt)
        assert self.combine is not None, "a reward model comes with its combine function"
        rules, scores = await asyncio.gather(
            self._rules(responses, answer, prompt), self.model.score(prompt, responses, answer, stats)
        )
        if stats is not None:
            stats["reward_engines/score_sum"] += sum(scores)
            stats["reward_engines/rule_sum"] += sum(rule.outcome for rule in rules)
        combined = zip(rules, scores, strict=True)
        return [Score(float(self.combine(rule.outcome, score)), rule.steps) for rule, score in combined]

    async def _rules(self, responses: list[str], answer: Any, prompt: str) -> list[Score]:
        """The task's reward of each response."""
        if self.verifier is not None:
            verifier = self.verifier
            return list(await asyncio.gather(*(verifier.reward(r, answer, prompt) for r in responses)))
        fn = self.fn
        assert fn is not None, "a reward function is loaded wherever no verifier URL is given"
        if self.cfg.group_reward:
            rewards = [Score.of(x, self.where) for x in await self._call(fn, responses, answer, prompt)]
            if len(rewards) != len(responses):
                raise RuntimeError(
                    f"group reward {self.cfg.reward} returned {len(rewards)} rewards for {len(responses)} responses"
                )
            return rewards
        return [
            Score.of(x, self.where)
            for x in await asyncio.gather(*(self._call(fn, r, answer, prompt) for r in responses))
        ]

    async def close(self) -> None:
        if self.verifier is not None:
            await self.verifier.close()
        if self.model is not None:
            await self.model.close()
