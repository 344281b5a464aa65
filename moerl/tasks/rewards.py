"""Reward functions: built-in ones, any ``module:function`` named in config, or a remote verifier; and a reward model
beside them (:mod:`moerl.tasks.reward_models`).

Every reward is scored through :class:`Rewarder`, asynchronously: coroutine functions are awaited,
plain functions run in worker threads (a slow checker never stalls the rollout loop), remote
verifiers are called over HTTP, and group rewards see the whole group at once. With a reward model, its scores
are asked for at the same time, and each response's reward is ``combine(rule reward, model score)``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moerl.config import import_object
from moerl.errors import ConfigError
from moerl.tasks import TASKS, TaskConfig

if TYPE_CHECKING:
    import aiohttp

    from moerl.tasks.reward_models import RewardModel, Stats


def exact(response: str, answer: Any, prompt: str = "") -> float:
    """1 when the response, stripped, is the answer."""
    return float(response.strip() == str(answer).strip())


def gsm8k_gold(answer: str) -> str:
    """GSM8K answers end with ``#### <number>``; other answers are taken whole."""
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


def math(response: str, answer: Any, prompt: str = "") -> float:
    """1 when math-verify finds the response's final answer equal to the gold one (LaTeX, boxed, plain)."""
    from math_verify import parse, verify

    # math-verify's own timeouts use SIGALRM, which only works in the main thread; rewards run in workers.
    gold = parse(f"${gsm8k_gold(str(answer))}$", parsing_timeout=None)
    predicted = parse(response, parsing_timeout=None)
    return float(bool(gold) and bool(predicted) and verify(gold, predicted, timeout_seconds=None))


def tiny(response: str, answer: Any, prompt: str = "") -> float:
    from moerl.tasks.tiny import reward

    return reward(response, answer, prompt)


def calc(response: str, answer: Any, prompt: str = "") -> float:
    from moerl.tasks.calc import reward

    return reward(response, answer, prompt)


BUILT_IN: dict[str, Callable] = {"exact": exact, "math": math, "tiny": tiny, "calc": calc}


def resolve(name: str) -> Callable:
    """A built-in reward by name, or ``package.module:function``."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    if ":" not in name:
        raise ConfigError(f"task.reward={name!r}: expected one of {', '.join(BUILT_IN)} or 'package.module:function'")
    fn = import_object(name, "task.reward")
    if not callable(fn):
        raise ConfigError(f"task.reward={name!r} is not callable")
    return fn


class Rewarder:
    def __init__(
        self,
        cfg: TaskConfig,
        model: RewardModel | None = None,
        combine: Callable[[float, float], float] | None = None,
    ):
        """``model`` and ``combine``: a reward model, and how its score and the task's reward make the reward."""
        self.cfg, self.model, self.combine = cfg, model, combine
        self.url = cfg.reward_url
        self.fn: Callable | None = None if self.url else resolve(cfg.reward or TASKS[cfg.name])  # None: remote
        self._session: aiohttp.ClientSession | None = None  # made at the first remote call, in its event loop

    async def _call(self, fn: Callable, *args) -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        return await asyncio.to_thread(fn, *args)

    async def _remote(self, url: str, response: str, answer: Any, prompt: str) -> float:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
        async with self._session.post(url, json={"prompt": prompt, "response": response, "answer": answer}) as resp:
            if resp.status >= 400:
                raise RuntimeError(f"reward verifier {url} answered {resp.status}: {(await resp.text())[:500]}")
            body = await resp.json()
        if not isinstance(body, dict) or "reward" not in body:
            raise RuntimeError(f'reward verifier {url} answered {body!r}; expected {{"reward": float}}')
        return float(body["reward"])

    async def score(self, responses: list[str], answer: Any, prompt: str, stats: Stats | None = None) -> list[float]:
        """One reward per response of a group; ``stats``: the reward model's counts (``reward_engines/*``)."""
        if self.model is None:
            return await self._rules(responses, answer, prompt)
        assert self.combine is not None, "a reward model comes with its combine function"
        rules, scores = await asyncio.gather(
            self._rules(responses, answer, prompt), self.model.score(prompt, responses, answer, stats)
        )
        if stats is not None:
            stats["reward_engines/score_sum"] += sum(scores)
            stats["reward_engines/rule_sum"] += sum(rules)
        return [float(self.combine(rule, score)) for rule, score in zip(rules, scores, strict=True)]

    async def _rules(self, responses: list[str], answer: Any, prompt: str) -> list[float]:
        """The task's reward of each response."""
        if self.url:
            url = self.url
            return list(await asyncio.gather(*(self._remote(url, r, answer, prompt) for r in responses)))
        fn = self.fn
        assert fn is not None, "a reward function is resolved wherever no verifier URL is given"
        if self.cfg.group_reward:
            rewards = [float(x) for x in await self._call(fn, responses, answer, prompt)]
            if len(rewards) != len(responses):
                raise RuntimeError(
                    f"group reward {self.cfg.reward} returned {len(rewards)} rewards for {len(responses)} responses"
                )
            return rewards
        return [float(x) for x in await asyncio.gather(*(self._call(fn, r, answer, prompt) for r in responses))]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self.model is not None:
            await self.model.close()
