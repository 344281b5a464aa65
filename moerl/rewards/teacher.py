"""On-policy distillation's teacher (the ``teacher`` section): it scores every token the student sampled, given every
token before it, so the trainer can move the student toward it on the student's own distribution
(``trainer.loss.distill``).

Each sample of a group that passed the filter is one request to the teacher's replicas (SGLang's ``/generate`` with no
new token and input log-probs from the prompt's end: :func:`~moerl.engines.client.scoring_request`), the group's
requests on one replica (an affinity per group: they share the prompt's prefix cache). A sample's stream is what the
student saw, turn by turn: an agent episode's context (tool output, templates) sits where it sat, so each turn is scored
with the history it had; the context's own rows are left 0.0, as the sample contract holds there, and only the actions
are distilled. Replica failures are asked again as a reward model's are (:class:`~moerl.rewards.model.ServedScorer`).

The teacher's log-probs are its own at temperature 1. Where the trainer replays kept sets (``trainer.replay
.sampling_mask``), the teacher's log-prob of an action is renormalised over the action's kept set as the student's is:
``log p_t(x) - log sum_{y in K} p_t(y)``, the sum from the teacher's top ids at that token (asked for as many as
``rollout.top_k``, the kept set's bound) and the action's own log-prob. A kept id outside the teacher's top ids is
counted at the least of them (an upper bound of its probability): the renormalised log-prob is then a lower bound,
exact wherever the top ids cover the kept set (``distill/kept_set_exact``: the share of such actions), and within
``log(1 + unlisted mass bound / listed mass)`` of the exact value elsewhere (``distill/kept_set_gap``: that bound's
mean over the actions; SGLang cannot be asked for each position's own ids).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

import numpy as np

from moerl.engines.client import scoring_request
from moerl.engines.generation_workers import GenerationWorkers, WorkerLost
from moerl.engines.protocol import Completion
from moerl.rewards.model import Replicas, ScorerError, ServedScorer, Stats
from moerl.sample import Sample

log = logging.getLogger("moerl.reward")
WORKER_LOSSES = 3  # generation workers lost under one request before its group fails


class Teacher(ServedScorer):
    """The teacher's replicas. ``top_k``: the top ids kept per token for the trainer's top-k term (0: none);
    ``kept_sets``: the teacher's log-probs are renormalised over the actions' kept sets too, from its ``kept_top``
    most likely ids per token; ``workers``: generation workers that read and decode the answers that may be large (a
    long response's top ids, as JSON), so that the rollout manager's loop does not."""

    def __init__(
        self, replicas: Replicas, top_k: int, kept_sets: bool, kept_top: int, workers: GenerationWorkers | None = None
    ):
        super().__init__(replicas, "teacher", workers)
        self.top_k, self.kept_sets = top_k, kept_sets
        self.asked = max(top_k, kept_top if kept_sets else 0)  # top ids asked for per token

    async def score(self, samples: list[Sample], group: str, stats: Stats) -> None:
        """Each of a group's ``samples`` takes the teacher's fields (:class:`~moerl.sample.Sample`); ``group``: their
        affinity key; ``stats``: the requests, retries, seconds and actions scored (``teacher_engines/*``)."""
        start = time.perf_counter()
        counts: Stats = defaultdict(float)
        await asyncio.gather(*(self._score(s, group, counts) for s in samples))
        for key, value in counts.items():
            stats[key] += value
        stats["teacher_engines/seconds"] += time.perf_counter() - start
        stats["teacher_engines/actions"] += sum(s.action_count for s in samples)

    async def _score(self, sample: Sample, group: str, counts: Stats) -> None:
        ids = np.concatenate([sample.prompt_ids, sample.response_ids]).tolist()
        request = scoring_request(ids, sample.prompt_len, self.asked)

        async def call(url: str) -> Completion:
            (completion,) = await self.client.read_on(url, request, 0)
            return completion

        for lost in range(WORKER_LOSSES + 1):
            try:
                completion = await self._ask(call, counts, affinity=group)
                break
            except WorkerLost as e:  # not the replica's failure: asked again, a bounded number of times
                if lost == WORKER_LOSSES:
                    raise ScorerError(
                        f"the generation workers carrying a teacher request died {lost + 1} times: {e}"
                    ) from None
                counts["teacher_engines/workers_lost"] += 1
                log.warning("a generation worker carrying a teacher request died (asked again): %s", e)
        logprobs = completion.input_logprobs
        if logprobs is None or logprobs.shape != (sample.response_len,):
            raise ScorerError(
                f"the teacher answered {None if logprobs is None else len(logprobs)} log-probs for a response of "
                f"{sample.response_len} tokens"
            )
        actions = sample.actions
        sample.teacher_logprobs = np.where(actions, logprobs, 0.0).astype(np.float32)
        top_ids, top_logprobs = completion.input_top_ids, completion.input_top_logprobs
        if self.asked:
            if top_ids is None or top_logprobs is None or top_ids.shape[1] < 1:
                raise ScorerError(f"the teacher answered no top log-probs, though {self.asked} per token were asked")
        if self.top_k:
            assert top_ids is not None and top_logprobs is not None, "checked above"
            if top_ids.shape[1] < self.top_k:
                raise ScorerError(
                    f"the teacher answered {top_ids.shape[1]} top ids per token, fewer than trainer.loss.distill.top_k="
                    f"{self.top_k} (a vocabulary that small: lower it)"
                )
            sample.teacher_top_ids = np.where(actions[:, None], top_ids[:, : self.top_k], 0).astype(np.int32)
            sample.teacher_top_logprobs = np.where(actions[:, None], top_logprobs[:, : self.top_k], 0.0).astype(
                np.float32
            )
        if self.kept_sets and sample.mask_offsets is not None and sample.mask_ids is not None:
            assert top_ids is not None and top_logprobs is not None, "checked above"
            selected, gap = renormalised(
                sample.teacher_logprobs,
                sample.response_ids,
                sample.mask_offsets,
                sample.mask_ids,
                top_ids,
                top_logprobs,
            )
            sample.teacher_selected_logprobs = np.where(actions, selected, 0.0).astype(np.float32)
            counts["teacher_engines/kept_set_exact"] += int((gap[actions] == 0).sum())
            counts["teacher_engines/kept_set_gap"] += float(gap[actions].sum())
        sample.validate()


def renormalised(
    logprobs: np.ndarray,
    targets: np.ndarray,
    offsets: np.ndarray,
    kept: np.ndarray,
    top_ids: np.ndarray,
    top_logprobs: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(the teacher's log-prob of each token renormalised over its kept set, float32 [R]; float64 [R]: how far below
    the exact value it may be, 0 where its top ids cover the set). ``logprobs`` [R]: the teacher's of each ``targets``
    token; ``offsets``/``kept``: the kept sets (CSR, empty at context, whose rows come out 0.0);
    ``top_ids``/``top_logprobs`` [R, k]: its most likely ids. A kept id neither the target nor among the top ids is
    counted at the least top log-prob (module docstring)."""
    counts = np.diff(offsets)
    rows = np.repeat(np.arange(len(counts)), counts)
    match = kept[:, None] == top_ids[rows]  # [kept ids, k]
    listed = match.any(axis=1)
    is_target = kept == targets[rows]
    value = np.where(
        listed,
        top_logprobs[rows, match.argmax(axis=1)],
        np.where(is_target, logprobs[rows], top_logprobs[rows].min(axis=1)),
    ).astype(np.float64)
    covered = listed | is_target
    out, gap = np.zeros(len(counts), dtype=np.float64), np.zeros(len(counts), dtype=np.float64)
    has = counts > 0
    if has.any():  # reduceat over the non-empty runs only (an empty run would read the next run's first value)
        starts = offsets[:-1][has]
        shift = np.maximum.reduceat(value, starts)
        mass = np.exp(value - np.repeat(shift, counts[has]))
        total = np.add.reduceat(mass, starts)  # the unlisted at their bound: an upper bound of the kept set's mass
        known = np.add.reduceat(np.where(covered, mass, 0.0), starts)  # the listed alone: a lower bound
        out[has] = logprobs[has] - (shift + np.log(total))
        gap[has] = np.log(total) - np.log(known)
    return out.astype(np.float32), gap
