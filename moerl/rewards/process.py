"""Process rewards: a response cut into steps, each with a score (the ``reward.process`` section).

Steps. An agent episode's steps are its turns (:class:`~moerl.episodes.episode.Episode` records where each ends); a
single-turn response is cut at a separator (``reward.process.separator``, e.g. a blank line) by :class:`StepCutter`.
The cut is made on the response's tokens, each decoded alone and their texts laid end to end: a step ends after the
token where a separator occurrence ends (inside a token too: ``".\\n\\n"`` as one token ends its step), or before it
where that token holds text after the separator (``"\\n\\nSo"`` starts the next step), and a piece with nothing but
separators and whitespace (a doubled separator, the end token after the last separator) joins the step before it (the
first, the one after). :func:`~moerl.rewards.score.text_steps` cuts a text into as many steps, so a reward function
that scores steps (:class:`~moerl.rewards.score.Score`) counts what moerl counts. A response cut by its token budget
ends in a step of its own, scored as it stands. A character split across tokens (the bytes of one UTF-8 character) is
not seen by the cut: a separator must be made of characters that tokens hold whole (ASCII, or a token of its own).

Scores come from the task's reward function (a :class:`~moerl.rewards.score.Score` with one per step), the
environment of an episode (:meth:`~moerl.episodes.episode.Episode.score_turn`), or a served process reward model
(:class:`ProcessRewardModel`), whose score a step takes in addition to any of the others'. ``trainer.loss.credit`` says
how the trainer turns them into token advantages (:mod:`moerl.trainer.objectives`).

The process reward model follows the Qwen2.5-Math-PRM convention: the prompt and the steps, each followed by the step
token (``reward.process.step_token``), through the model's chat template where it has one, in one forward; a step's
score is the probability of its "correct" label at its step token. SGLang 0.5.23 serves no such per-token head, so
moerl's embedded engine serves it (``/step_scores``; docs/engines.md).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moerl.rewards.model import Replicas, ScorerError, ServedScorer, Stats
from moerl.sample import Sample


def _content(piece: str, separator: str) -> str:
    """A piece's text less its separators, stripped: empty where the piece is nothing but separators and whitespace."""
    return piece.replace(separator, "").strip()


class StepCutter:
    """Cuts a single-turn response's tokens into steps at ``separator``, decoding with the policy's ``tokenizer``."""

    def __init__(self, tokenizer: Any, separator: str):
        if not separator:
            raise ValueError("reward.process.separator is empty: a step needs something to end it")
        self.tokenizer, self.separator = tokenizer, separator

    def pieces(self, ids: np.ndarray) -> list[str]:
        """Each token's text, decoded alone (special tokens as nothing)."""
        return self.tokenizer.batch_decode(
            [[int(t)] for t in ids], skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def ends(self, ids: np.ndarray) -> np.ndarray:
        """int64 [S]: where each step of the response ``ids`` ends (exclusive), the last at ``len(ids)``."""
        pieces = self.pieces(ids)
        char_end = np.cumsum([len(p) for p in pieces])
        text, sep = "".join(pieces), self.separator
        cuts: list[int] = []
        at = text.find(sep)
        while at >= 0:
            end = at + len(sep)
            token = int(np.searchsorted(char_end, end))  # the token holding the occurrence's last character
            # a token that holds text after the separator starts the next step; else the step ends after it
            cut = token if text[end : char_end[token]].strip() else token + 1
            if cut > (cuts[-1] if cuts else 0):
                cuts.append(cut)
            at = text.find(sep, end)
        kept: list[int] = []
        start = 0
        for end in [e for e in cuts if e < len(ids)] + [len(ids)]:
            if _content(text[(char_end[start - 1] if start else 0) : char_end[end - 1]], sep):
                kept.append(end)
            elif kept:  # a piece with no content joins the step before it (the first one, the one after)
                kept[-1] = end
            start = end
        return np.asarray(kept or [len(ids)], dtype=np.int64)

    def texts(self, sample: Sample) -> list[str]:
        """Each step's text without its separators (the actions' tokens only: an episode's context is left out)."""
        pieces = self.pieces(sample.response_ids)
        actions = sample.actions
        out, start = [], 0
        for end in sample.steps.tolist():
            text = "".join(p for p, a in zip(pieces[start:end], actions[start:end], strict=True) if a)
            out.append(self.separator.join(p for p in text.split(self.separator) if p.strip()) or text)
            start = end
        return out


class ProcessRewardModel(ServedScorer):
    """The process reward model's replicas (``reward.process``): each step's score, a group's samples in one request."""

    def __init__(self, model_dir: str | Path, replicas: Replicas, step_token: str, cutter: StepCutter):
        from transformers import AutoTokenizer

        super().__init__(replicas, "reward.process")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        ids = self.tokenizer(step_token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ScorerError(
                f"reward.process.step_token={step_token!r} is {len(ids)} tokens in the process reward model's "
                f"tokenizer ({model_dir}); it must be one: name the token its training put after each step"
            )
        self.step_token, self.step_token_id, self.cutter = step_token, ids[0], cutter

    def input_ids(self, prompt: str, steps: list[str]) -> list[int]:
        """What the model reads: the prompt as the user's turn and the steps, each followed by the step token, as the
        assistant's, through its chat template (without one: the texts joined). The step token is placed by its id
        (text around it is tokenised apart, so it never merges with a neighbour), once after each step: where the
        prompt or a step holds its text, that text is left out."""
        token = self.step_token
        prompt, steps = prompt.replace(token, ""), [step.replace(token, "") for step in steps]
        answer = "".join(step + token for step in steps)
        if self.tokenizer.chat_template:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
            text = str(self.tokenizer.apply_chat_template(messages, tokenize=False))  # one conversation: one text
        else:
            text = prompt + answer
        ids: list[int] = []
        for k, piece in enumerate(text.split(token)):
            ids += ([self.step_token_id] if k else []) + self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        return ids

    async def score(self, samples: list[Sample], prompt: str, stats: Stats) -> list[np.ndarray]:
        """float32 [S] per sample: each step's score; ``stats``: the requests, retries, seconds and steps scored
        (``process_engines/*``)."""
        start = time.perf_counter()
        counts: Stats = defaultdict(float)

        def inputs() -> tuple[list[list[str]], list[list[int]]]:
            texts = [self.cutter.texts(s) for s in samples]
            return texts, [self.input_ids(prompt, t) for t in texts]

        texts, ids = await asyncio.to_thread(inputs)  # decoding and tokenising long responses: off the event loop

        async def ask(url: str) -> list[list[float]]:
            return await self.client.step_scores_on(url, ids, self.step_token_id)

        answers = await self._ask(ask, counts)
        for sample_texts, answer in zip(texts, answers, strict=True):
            if len(answer) != len(sample_texts):
                raise ScorerError(
                    f"the process reward model answered {len(answer)} step scores for {len(sample_texts)} steps (does "
                    f"the prompt hold reward.process.step_token={self.step_token!r}?)"
                )
        for key, value in counts.items():
            stats[key] += value
        stats["process_engines/seconds"] += time.perf_counter() - start
        stats["process_engines/steps"] += sum(len(t) for t in texts)
        return [np.asarray(a, dtype=np.float32) for a in answers]


class ProcessRewards:
    """A group's steps and their scores: each single-turn sample cut by ``cutter`` (always, where the trainer's credit
    reads steps, ``credit``, or ``model`` scores them; else where its reward function scored steps), the reward
    function's step scores attached, and ``model``'s added (None: no process reward model)."""

    def __init__(self, cutter: StepCutter, model: ProcessRewardModel | None, credit: bool):
        self.cutter, self.model, self.credit = cutter, model, credit

    def cuts(self, steps: Sequence[float] | None) -> bool:
        """Whether anything reads a response's steps: the trainer's credit, a model, or its reward function's
        ``steps``."""
        return self.credit or self.model is not None or steps is not None

    def attach(self, samples: list[Sample], steps: Sequence[float] | None, where: str) -> None:
        """One response's ``samples`` take their steps, and ``steps`` (its reward function's step scores, None: none)
        where given; ``where`` names the reward function in errors. Where the credit reads step scores and no model
        gives them, an episode's turns its environment never scored count 0, and a single-turn response without
        scores is refused."""
        if steps is not None and any(s.episode is not None for s in samples):
            raise ScorerError(
                f"{where} scored the steps of an agent episode: an episode's steps are its turns, scored by its "
                "environment (Episode.score_turn); a reward function scores single-turn responses' steps"
            )
        if not self.cuts(steps):
            return
        for sample in samples:
            if sample.episode is None:
                sample.step_ends = self.cutter.ends(sample.response_ids)
                if steps is not None:
                    if len(steps) != len(sample.step_ends):
                        raise ScorerError(
                            f"{where} returned {len(steps)} step scores for a response of {len(sample.step_ends)} "
                            f"steps (reward.process.separator={self.cutter.separator!r}; "
                            "moerl.rewards.score.text_steps cuts a text as moerl does)"
                        )
                    sample.step_rewards = np.asarray(steps, dtype=np.float32)
            if self.credit and self.model is None and sample.step_rewards is None:
                if sample.episode is None:
                    raise ScorerError(
                        f"{where} gave a response no step scores, and trainer.loss.credit reads them: return a Score "
                        "with steps for every response, or serve a process reward model (reward.process.model)"
                    )
                sample.step_rewards = np.zeros(len(sample.steps), dtype=np.float32)  # no turn scored
            sample.validate()

    async def score(self, samples: list[Sample], prompt: str, stats: Stats) -> None:
        """The process reward model's step scores added to the samples' (kept groups only: it runs after the
        filter)."""
        if self.model is None:
            return
        for sample, scores in zip(samples, await self.model.score(samples, prompt, stats), strict=True):
            given = sample.step_rewards
            sample.step_rewards = scores if given is None else (given + scores).astype(np.float32)

    async def close(self) -> None:
        if self.model is not None:
            await self.model.close()
