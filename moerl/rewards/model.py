"""Reward models served by engines of their own (the ``reward`` section): scores of each response of a group, asked
of the reward replicas as the group finishes, so scoring overlaps generation.

Two kinds: a discriminative model (:class:`Classifier`) and a generative judge (:class:`~moerl.rewards.judge.Judge`).
The replicas never take weight updates. Every request is routed by the replicas'
:class:`~moerl.engines.client.EngineClient`: one that fails in transport or with a 5xx marks its replica suspect and is
asked again of another, or of the same once it answers ``/health`` again (restarted by the job); a score is never made
up: with no replica answering for ``reward.engines.down_timeout_s`` the run stops with one error.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from moerl.engines.client import EngineClient, EngineError, ReplicaDown
from moerl.engines.generation_workers import GenerationWorkers
from moerl.engines.health import Probes

log = logging.getLogger("moerl.reward")
Stats = defaultdict[str, float]  # <scorer>_engines/* counts and seconds, summed over calls
R = TypeVar("R")


@dataclass
class Replicas:
    """The reward model's replicas (``reward.engines``) and how their failures are outlasted."""

    urls: list[str]
    timeout_s: float = 600.0  # each request's deadline
    down_timeout_s: float = 600.0  # with no replica answering this long, the run stops
    health_interval_s: float = 2.0  # how often one out of rotation is probed
    failures_to_dead: int = 3  # failed probes in a row that make one dead


class ServedScorer:
    """A scorer's replicas: the reward model's or the teacher's (``key``, the config section, which names their metrics
    ``<key>_engines/*`` and timeout key)."""

    def __init__(self, replicas: Replicas, key: str, workers: GenerationWorkers | None = None):
        """``workers``: generation workers (the policy client's) that carry the requests whose answers may be large."""
        self.replicas, self.key = replicas, key
        self.client = EngineClient(
            replicas.urls,
            timeout_s=replicas.timeout_s,
            retries=0,
            failures_to_dead=replicas.failures_to_dead,
            workers=workers or 0,
        )
        # shared by every score that waits: a replica that answers is back (it holds no policy to be stale in)
        self.probes = Probes(self.client, replicas.health_interval_s)

    async def _ask(self, call: Callable[[str], Awaitable[R]], counts: Stats, affinity: str | None = None) -> R:
        """``call(url)`` on a replica (``affinity`` as :meth:`EngineClient.on_replica` takes it), until one serves
        it."""
        prefix = f"{self.key.rsplit('.', 1)[-1]}_engines"  # reward.process: process_engines

        def failed(error: ReplicaDown) -> None:
            counts[f"{prefix}/requests"] += 1
            counts[f"{prefix}/retries"] += 1
            log.warning("%s engine %s failed a request (asked again): %s", self.key, error.url, error)

        counts[f"{prefix}/requests"] += 1
        r = self.replicas
        try:
            return await self.client.until_served(
                call,
                failed,
                r.down_timeout_s,
                f"{self.key}.engines.down_timeout_s",
                r.health_interval_s,
                self.probes,
                affinity,
            )
        except EngineError as e:  # a refusal (4xx): a replica's failures are asked again
            raise ScorerError(f"the {self.key} engine refused the request: {e}") from None

    async def close(self) -> None:
        await self.client.close()


class RewardModel(ServedScorer, ABC):
    """The reward replicas serving the model at ``model_dir`` (its tokenizer and chat template read here)."""

    def __init__(self, model_dir: str | Path, replicas: Replicas):
        from transformers import AutoTokenizer

        super().__init__(replicas, "reward")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    async def score(self, prompt: str, responses: list[str], answer: Any, stats: Stats | None = None) -> list[float]:
        """One score per response, in order; ``stats`` counts the requests, the retries, the seconds and the responses
        scored (``reward_engines/*``)."""
        if not responses:
            return []
        start = time.perf_counter()
        counts: Stats = defaultdict(float)
        scores = await self._scores(prompt, responses, answer, counts)
        if stats is not None:
            for key, value in counts.items():
                stats[key] += value
            stats["reward_engines/seconds"] += time.perf_counter() - start
            stats["reward_engines/scored"] += len(responses)
        return scores

    @abstractmethod
    async def _scores(self, prompt: str, responses: list[str], answer: Any, counts: Stats) -> list[float]:
        """What :meth:`score` returns, each request made by :meth:`_ask`."""


class Classifier(RewardModel):
    """A discriminative model (a sequence-classification head, ``*ForSequenceClassification``): it scores the prompt
    and the response as one conversation through SGLang's ``/classify``, a group in one request."""

    def conversation_ids(self, prompt: str, response: str) -> list[int]:
        """What the model scores: the prompt and the response as a user's turn and the assistant's, through the
        model's chat template (a model without one: the two texts joined)."""
        if self.tokenizer.chat_template:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
        return list(self.tokenizer(prompt + response)["input_ids"])

    async def _scores(self, prompt: str, responses: list[str], answer: Any, counts: Stats) -> list[float]:
        ids = [self.conversation_ids(prompt, r) for r in responses]

        async def classify(url: str) -> list[float]:
            return [float(a[0]) for a in await self.client.classify_on(url, ids)]

        return await self._ask(classify, counts)


class ScorerError(RuntimeError):
    """A scorer's engines refused a request, or a judge's answer has no verdict: not a replica's failure."""
