"""Reward models served by engines of their own (the ``reward`` section): scores of each response of a group, asked
of the reward replicas as the group finishes, so scoring overlaps generation.

Two kinds. A discriminative model (a sequence-classification head, ``*ForSequenceClassification``) scores the prompt
and the response as one conversation through SGLang's ``/classify``. A generative one is a judge: an instruct model
asked, through its chat template, a question built from the prompt, the response and the reference answer; its
greedy answer becomes a score by a verdict function. The replicas never take weight updates. A request that fails
in transport or with a 5xx marks its replica suspect and is asked again of another, or of the same once it answers
``/health`` again (restarted by the job); a score is never made up: with no replica answering for
``reward.engines.down_timeout_s`` the run stops with one error.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from moerl.config import import_object
from moerl.engines.client import EngineClient, EngineError
from moerl.engines.health import Probes
from moerl.engines.protocol import GenerateReqInput, SamplingParams
from moerl.errors import ConfigError

log = logging.getLogger("moerl.reward")
Stats = defaultdict[str, float]  # reward_engines/* counts and seconds, summed over calls

DEFAULT_JUDGE_PROMPT = (
    "Grade the response to the question against the reference answer.\n"
    "Question: {prompt}\nReference answer: {answer}\nResponse: {response}\n"
    "Answer with a single number from 0 (wrong) to 1 (fully correct)."
)


def last_number(text: str) -> float:
    """The last number in the judge's answer (``0.5``, ``1``, ``-2e-1``)."""
    numbers = re.findall(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?", text)
    if not numbers:
        raise ValueError(f"no number in the judge's answer {text[:200]!r}")
    return float(numbers[-1])


def yes_no(text: str) -> float:
    """1 for an answer that starts with yes, 0 for one that starts with no."""
    word = text.strip().split(maxsplit=1)[0].strip(".,:!").lower() if text.strip() else ""
    if word not in ("yes", "no"):
        raise ValueError(f"the judge's answer {text[:200]!r} starts with neither yes nor no")
    return float(word == "yes")


VERDICTS: dict[str, Callable[[str], float]] = {"last_number": last_number, "yes_no": yes_no}


def model_only(rule: float, score: float) -> float:
    return score


def rule_times_model(rule: float, score: float) -> float:
    """The task's reward gates the model's score (a wrong answer gets nothing, however well written)."""
    return rule * score


def rule_plus_model(rule: float, score: float) -> float:
    return rule + score


COMBINES: dict[str, Callable[[float, float], float]] = {
    "model": model_only,
    "rule_times_model": rule_times_model,
    "rule_plus_model": rule_plus_model,
}


def load_named(name: str, built_in: dict[str, Callable], key: str) -> Callable:
    """A built-in function by name, or ``package.module:function``; one error naming ``key`` otherwise."""
    if name in built_in:
        return built_in[name]
    if ":" not in name:
        raise ConfigError(f"{key}={name!r}: expected one of {', '.join(built_in)} or 'package.module:function'")
    fn = import_object(name, key)
    if not callable(fn):
        raise ConfigError(f"{key}={name!r} is not callable")
    return fn


class RewardModel:
    """The reward replicas at ``urls`` serving the model at ``model_dir`` (its tokenizer and chat template read here).

    ``kind``: discriminative or generative; ``judge_prompt`` (``{prompt}``, ``{response}``, ``{answer}``),
    ``verdict`` and ``max_new_tokens``: a judge's question, how its answer becomes a score, and how long it may be."""

    def __init__(
        self,
        urls: list[str],
        model_dir: str | Path,
        kind: str,
        judge_prompt: str = DEFAULT_JUDGE_PROMPT,
        verdict: str = "last_number",
        max_new_tokens: int = 32,
        timeout_s: float = 600.0,
        down_timeout_s: float = 600.0,
        health_interval_s: float = 2.0,
        failures_to_dead: int = 3,
    ):
        from transformers import AutoTokenizer

        self.kind, self.judge_prompt, self.max_new_tokens = kind, judge_prompt, max_new_tokens
        self.verdict = load_named(verdict, VERDICTS, "reward.verdict")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.client = EngineClient(urls, timeout_s=timeout_s, retries=0, failures_to_dead=failures_to_dead)
        self.down_timeout_s, self.health_interval_s = down_timeout_s, health_interval_s
        # shared by every score that waits: a replica that answers is back (it holds no policy to be stale in)
        self.probes = Probes(self.client, health_interval_s)

    def conversation_ids(self, prompt: str, response: str) -> list[int]:
        """What a discriminative model scores: the prompt and the response as a user's turn and the assistant's,
        through the model's chat template (a model without one: the two texts joined)."""
        if self.tokenizer.chat_template:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
        return list(self.tokenizer(prompt + response)["input_ids"])

    def judge_ids(self, prompt: str, response: str, answer: Any) -> list[int]:
        """A judge's question about ``response``, as the user's turn of its chat template, the assistant's to come."""
        question = self.judge_prompt.format(prompt=prompt, response=response, answer=answer)
        if self.tokenizer.chat_template:
            messages = [{"role": "user", "content": question}]
            return list(
                self.tokenizer.apply_chat_template(
                    messages, tokenize=True, add_generation_prompt=True, return_dict=False
                )
            )
        return list(self.tokenizer(question)["input_ids"])

    async def score(self, prompt: str, responses: list[str], answer: Any, stats: Stats | None = None) -> list[float]:
        """One score per response, in order; ``stats`` counts the requests, the retries, the seconds and the responses
        scored (``reward_engines/*``)."""
        if not responses:
            return []
        start = time.perf_counter()
        counts: Stats = defaultdict(float)
        if self.kind == "discriminative":
            ids = [self.conversation_ids(prompt, r) for r in responses]
            scores = await self._ask(functools.partial(self._classify, ids=ids), counts)
        else:
            judged = (functools.partial(self._judge, prompt=prompt, response=r, answer=answer) for r in responses)
            scores = list(await asyncio.gather(*(self._ask(judge, counts) for judge in judged)))
        if stats is not None:
            for key, value in counts.items():
                stats[key] += value
            stats["reward_engines/seconds"] += time.perf_counter() - start
            stats["reward_engines/scored"] += len(responses)
        return scores

    async def _classify(self, url: str, ids: list[list[int]]) -> list[float]:
        answers = await self.client.classify_on(url, ids)
        return [float(a[0]) for a in answers]

    async def _judge(self, url: str, prompt: str, response: str, answer: Any) -> float:
        request = GenerateReqInput(
            input_ids=self.judge_ids(prompt, response, answer),
            sampling_params=SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens),
            return_logprob=False,
        )
        (completion,) = await self.client.generate_on(url, request, 0)
        text = self.tokenizer.decode(completion.output_ids, skip_special_tokens=True)
        try:
            return float(self.verdict(text))
        except (ValueError, TypeError) as e:
            raise RewardModelError(f"reward.verdict could not read the judge's answer: {e}") from None

    async def _ask(self, call: Callable[[str], Awaitable[Any]], counts: Stats) -> Any:
        """``call(url)`` on the least-loaded healthy replica; on a replica's failure (transport, 5xx, deadline) it is
        out of rotation and the call is made again elsewhere, or once a replica answers /health again."""
        health = self.client.health
        while True:
            await self.client.until_usable(
                self.down_timeout_s, "reward.engines.down_timeout_s", self.health_interval_s, self.probes
            )
            usable = health.usable()
            url = min(usable, key=self.client.in_flight.__getitem__)
            counts["reward_engines/requests"] += 1
            self.client.in_flight[url] += 1
            try:
                return await call(url)
            except EngineError as e:
                if e.status is not None and e.status < 500:
                    raise RewardModelError(f"the reward engine refused the request: {e}") from None
                health.request_failed(url, str(e))
                counts["reward_engines/retries"] += 1
                log.warning("reward engine %s failed a request (asked again): %s", url, e)
            finally:
                self.client.in_flight[url] -= 1

    async def close(self) -> None:
        await self.client.close()


class RewardModelError(RuntimeError):
    """The reward engines refused a request, or a judge's answer has no verdict: not a replica's failure."""
