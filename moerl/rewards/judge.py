"""A generative reward model, a judge (``reward.kind=generative``): an instruct model asked, through its chat
template, a question built from the prompt, the response and the reference answer; its greedy answer becomes a score
by a verdict (``reward.verdict``: a built-in one, registered here, or ``package.module:function`` ``f(text) -> float``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from moerl.engines.protocol import GenerateReqInput, SamplingParams
from moerl.plugins import Registry, callable_problem
from moerl.rewards.model import Replicas, RewardModel, ScorerError, Stats

Verdict = Callable[[str], float]
VERDICTS: Registry[Verdict] = Registry("reward.verdict", callable_problem)

DEFAULT_JUDGE_PROMPT = (
    "Grade the response to the question against the reference answer.\n"
    "Question: {prompt}\nReference answer: {answer}\nResponse: {response}\n"
    "Answer with a single number from 0 (wrong) to 1 (fully correct)."
)


@VERDICTS.register("last_number")
def last_number(text: str) -> float:
    """The last number in the judge's answer (``0.5``, ``1``, ``-2e-1``)."""
    numbers = re.findall(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?", text)
    if not numbers:
        raise ValueError(f"no number in the judge's answer {text[:200]!r}")
    return float(numbers[-1])


@VERDICTS.register("yes_no")
def yes_no(text: str) -> float:
    """1 for an answer that starts with yes, 0 for one that starts with no."""
    word = text.strip().split(maxsplit=1)[0].strip(".,:!").lower() if text.strip() else ""
    if word not in ("yes", "no"):
        raise ValueError(f"the judge's answer {text[:200]!r} starts with neither yes nor no")
    return float(word == "yes")


@dataclass
class Judging:
    """A judge's question (``reward.judge_prompt``: it may name ``{prompt}``, ``{response}`` and ``{answer}``), how its
    answer becomes a score (``reward.verdict``) and how long that answer may be (``reward.judge_max_new_tokens``)."""

    prompt: str = DEFAULT_JUDGE_PROMPT
    verdict: str = "last_number"
    max_new_tokens: int = 32


class Judge(RewardModel):
    """A judge on its replicas: each response's question asked over ``/generate``, greedily, and its answer read by
    the verdict."""

    def __init__(self, model_dir: str | Path, replicas: Replicas, judging: Judging):
        self.judging = judging
        self.verdict = VERDICTS.load(judging.verdict)
        super().__init__(model_dir, replicas)

    def judge_ids(self, prompt: str, response: str, answer: Any) -> list[int]:
        """A judge's question about ``response``, as the user's turn of its chat template, the assistant's to come."""
        question = self.judging.prompt.format(prompt=prompt, response=response, answer=answer)
        if self.tokenizer.chat_template:
            messages = [{"role": "user", "content": question}]
            return list(
                self.tokenizer.apply_chat_template(
                    messages, tokenize=True, add_generation_prompt=True, return_dict=False
                )
            )
        return list(self.tokenizer(question)["input_ids"])

    async def _scores(self, prompt: str, responses: list[str], answer: Any, counts: Stats) -> list[float]:
        return list(await asyncio.gather(*(self._ask(self._judge(prompt, r, answer), counts) for r in responses)))

    def _judge(self, prompt: str, response: str, answer: Any) -> Callable[[str], Awaitable[float]]:
        """What asks a replica for the score of ``response``."""
        request = GenerateReqInput(
            input_ids=self.judge_ids(prompt, response, answer),
            sampling_params=SamplingParams(temperature=0.0, max_new_tokens=self.judging.max_new_tokens),
            return_logprob=False,
        )

        async def judge(url: str) -> float:
            (completion,) = await self.client.generate_on(url, request, 0)
            text = cast(str, self.tokenizer.decode(completion.output_ids, skip_special_tokens=True))  # ids: one text
            try:
                return float(self.verdict(text))
            except (ValueError, TypeError) as e:
                raise ScorerError(f"reward.verdict could not read the judge's answer: {e}") from None

        return judge
