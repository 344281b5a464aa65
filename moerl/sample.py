"""The sample contract: what crosses from rollout to trainer, one record per completion or agent episode.

Arrays are compact and positional. With ``P`` prompt tokens and ``R`` response tokens the trainer feeds
the ``L = P + R - 1`` tokens ``(prompt + response)[:-1]``; position ``i`` predicts token ``i + 1``, so
response token ``j`` is scored at position ``P - 1 + j``. Routing has one row per fed position (what the
engine's routers saw), kept sets one row per response token.

An agent episode is one token stream: the prompt, then the model's turns interleaved with context (environment, tool
and template tokens), all of it the response. ``loss_mask`` tells the model's tokens (actions), the only ones scored,
from the context, which is fed like the prompt; per-token arrays keep a row for every response token, filled at
context (log-probs 0.0, version -1, an empty kept set). An episode forked into several samples shares one ``episode``
index (and one reward) within its group: GRPO counts the episode once.

With a teacher (on-policy distillation), each response token also carries the teacher's log-prob of it given every
token before it (the history the student saw at that turn), at temperature 1: over the whole vocabulary, renormalised
over the token's kept set where there is one, and, where a top-k term is asked for, the teacher's top-k ids and their
log-probs. Context rows hold 0.0 (ids 0), as the behaviour log-probs do.

With process rewards, a response is cut into steps (an episode's turns, or a single-turn response's text at a
separator: :mod:`moerl.rewards.process`): ``step_ends`` holds where each step ends (exclusive response positions,
rising, the last at ``R``; every step holds at least one action), ``step_rewards`` each step's score. A step is its
tokens from the last step's end, so context before a turn belongs to that turn's step; only actions are scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from moerl.errors import MoerlError


class SampleError(MoerlError):
    """A sample whose arrays do not fit together; the message names the field."""


class EngineCompletion(Protocol):
    """What :meth:`Sample.from_completion` reads of an engine's :class:`~moerl.engines.protocol.Completion` (a layer
    above this one: not imported here)."""

    output_ids: np.ndarray
    finish_reason: dict
    weight_versions: list[dict[str, Any]]
    logprobs: np.ndarray | None
    routing: np.ndarray | None
    routing_start: int
    mask_offsets: np.ndarray | None
    mask_ids: np.ndarray | None
    sampling_logprobs: np.ndarray | None


@dataclass
class Sample:
    prompt_ids: np.ndarray  # int32 [P]
    response_ids: np.ndarray  # int32 [R]
    behaviour_logprobs: np.ndarray  # float32 [R], full vocabulary, temperature-scaled (what the engine reported)
    versions: np.ndarray  # int64 [R], policy version that produced each response token (-1 at context)
    temperature: float = 1.0
    selected_logprobs: np.ndarray | None = None  # float32 [R], renormalised over the kept set
    routing: np.ndarray | None = None  # uint8/int16 [P + R - 1, moe_layers, topk]
    mask_offsets: np.ndarray | None = None  # int64 [R + 1], CSR over response tokens (no ids at context)
    mask_ids: np.ndarray | None = None  # int32 [mask_offsets[-1]]
    reward: float = 0.0
    group_id: int = 0
    finish_reason: str = "stop"
    engine: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # uint8 [R]: 1 at the model's tokens (actions), 0 at context placed after the prompt; None: every token an action
    loss_mask: np.ndarray | None = None
    # The episode within its group, shared by the samples an episode forked into (they share its reward too). None: an
    # episode of its own, as every single-turn completion is; so the rollout side numbers only the episodes it forks.
    episode: int | None = None
    # int64 [answers]: the position where each engine answer's routing rows began, in the order they came (an
    # episode's turns: each asks only for the rows it lacks, so they rise from 0). None: one answer, from 0.
    # `moerl check-replay` reads them: an answer that starts within rows an earlier one gave overwrote them.
    routing_starts: np.ndarray | None = None
    teacher_logprobs: np.ndarray | None = None  # float32 [R]: the teacher's, full vocabulary (None: no teacher)
    # float32 [R]: the teacher's, renormalised over each action's kept set (as selected_logprobs is the engine's)
    teacher_selected_logprobs: np.ndarray | None = None
    teacher_top_ids: np.ndarray | None = None  # int32 [R, k]: the teacher's k most likely ids at each response token
    teacher_top_logprobs: np.ndarray | None = None  # float32 [R, k]: their log-probs (full vocabulary)
    step_ends: np.ndarray | None = None  # int64 [S]: where each step ends (None: the response is one step)
    step_rewards: np.ndarray | None = None  # float32 [S]: each step's score (None: no step scores)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    @property
    def fed_len(self) -> int:
        """Tokens the trainer feeds: prompt + response minus the last token."""
        return self.prompt_len + self.response_len - 1

    def fed_ids(self) -> np.ndarray:
        return np.concatenate([self.prompt_ids, self.response_ids])[:-1]

    @property
    def actions(self) -> np.ndarray:
        """bool [R]: the response tokens the model sampled, the only ones scored."""
        if self.loss_mask is None:
            return np.ones(self.response_len, dtype=bool)
        return self.loss_mask.astype(bool)

    @property
    def action_count(self) -> int:
        return self.response_len if self.loss_mask is None else int(np.count_nonzero(self.loss_mask))

    @property
    def oldest_version(self) -> int:
        """The policy version of the sample's oldest action (context carries none)."""
        return int(self.at_actions(self.versions).min())

    def at_actions(self, values: np.ndarray) -> np.ndarray:
        """A per-response-token array at the actions only (``values`` itself when every token is one)."""
        return values if self.loss_mask is None else values[self.loss_mask.astype(bool)]

    def validate(self) -> Sample:
        p, r = self.prompt_len, self.response_len
        if p < 1 or r < 1:
            raise SampleError(f"a sample needs >= 1 prompt and >= 1 response token, got P={p}, R={r}")
        for name in (
            "behaviour_logprobs",
            "versions",
            "selected_logprobs",
            "loss_mask",
            "teacher_logprobs",
            "teacher_selected_logprobs",
        ):
            value = getattr(self, name)
            if value is not None and value.shape != (r,):
                raise SampleError(f"{name} has shape {value.shape}, expected ({r},) (one per response token)")
        self._validate_teacher_top()
        self._validate_steps()
        if self.episode is not None and self.episode < 0:
            raise SampleError(f"episode must be >= 0 (or None: an episode of its own), got {self.episode}")
        actions = self._validated_actions()
        if self.routing is not None and (self.routing.ndim != 3 or self.routing.shape[0] != p + r - 1):
            raise SampleError(f"routing has shape {self.routing.shape}, expected ({p + r - 1}, moe_layers, topk)")
        starts = self.routing_starts
        if starts is not None and (
            starts.ndim != 1 or not len(starts) or not 0 <= starts.min() <= starts.max() < p + r - 1
        ):
            raise SampleError(f"routing_starts must be 1-D positions in [0, {p + r - 1}), got {starts.tolist()}")
        if (self.mask_offsets is None) != (self.mask_ids is None):
            raise SampleError("mask_offsets and mask_ids come together")
        if self.mask_offsets is not None and self.mask_ids is not None:  # both or neither: checked above
            self._validate_kept_sets(self.mask_offsets, self.mask_ids, actions)
        return self

    def _validate_teacher_top(self) -> None:
        ids, logprobs = self.teacher_top_ids, self.teacher_top_logprobs
        if (ids is None) != (logprobs is None):
            raise SampleError("teacher_top_ids and teacher_top_logprobs come together")
        if ids is not None and logprobs is not None:
            if ids.ndim != 2 or ids.shape[0] != self.response_len or ids.shape != logprobs.shape or ids.shape[1] < 1:
                raise SampleError(
                    f"teacher_top_ids {ids.shape} and teacher_top_logprobs {logprobs.shape} must both be "
                    f"({self.response_len}, k), k >= 1"
                )
        if self.teacher_logprobs is None and (ids is not None or self.teacher_selected_logprobs is not None):
            raise SampleError("a teacher's top-k or kept-set log-probs come with its teacher_logprobs")

    @property
    def steps(self) -> np.ndarray:
        """int64 [S]: :attr:`step_ends`, or the whole response as one step."""
        return np.array([self.response_len], dtype=np.int64) if self.step_ends is None else self.step_ends

    def step_of_actions(self) -> np.ndarray:
        """int64 [actions]: the step each action belongs to."""
        return self.at_actions(np.searchsorted(self.steps, np.arange(self.response_len), side="right"))

    def _validate_steps(self) -> None:
        ends, rewards = self.step_ends, self.step_rewards
        if ends is not None:
            if (
                ends.ndim != 1
                or not len(ends)
                or ends[-1] != self.response_len
                or np.any(np.diff(ends) <= 0)
                or ends[0] < 1
            ):
                raise SampleError(
                    f"step_ends must rise strictly from >= 1 to the response's length {self.response_len}, got "
                    f"{ends.tolist()[:8]}"
                )
            starts = np.concatenate([[0], ends[:-1]])
            acted = np.add.reduceat(self.actions.astype(np.int64), starts)
            if np.any(acted == 0):
                raise SampleError(f"step {int(np.argmin(acted))} holds no action (a step is scored at its actions)")
        if rewards is not None and rewards.shape != (len(self.steps),):
            raise SampleError(f"step_rewards has shape {rewards.shape}, expected ({len(self.steps)},) (one per step)")

    def _validated_actions(self) -> np.ndarray:
        """:attr:`actions`, once the loss mask and the versions agree with it."""
        actions = self.actions
        if self.loss_mask is not None:
            if np.any((self.loss_mask != 0) & (self.loss_mask != 1)):
                raise SampleError("loss_mask holds values other than 0 (context) and 1 (action)")
            if not actions.any():
                raise SampleError("loss_mask marks no token an action: a sample needs >= 1 model token")
        negative = actions & (self.versions < 0)
        if negative.any():
            raise SampleError(f"versions holds a negative version at action token {int(np.argmax(negative))}")
        if np.any(self.versions[~actions] != -1):
            raise SampleError("versions must hold -1 at every context token (loss_mask 0): no policy produced it")
        return actions

    def _validate_kept_sets(self, offsets: np.ndarray, ids: np.ndarray, actions: np.ndarray) -> None:
        r = self.response_len
        if offsets.shape != (r + 1,) or offsets[0] != 0 or offsets[-1] != len(ids):
            raise SampleError(f"mask_offsets must be [R+1] = [{r + 1}] from 0 to len(mask_ids)")
        counts = np.diff(offsets)
        if np.any(counts[actions] < 1) or np.any(counts[~actions] != 0):
            raise SampleError("mask_offsets must give >= 1 kept id to every action and none to context tokens")
        rows = np.repeat(np.arange(r), counts)
        # Per action, over its own non-empty run of ids (context's runs are empty, so the actions' starts rise
        # strictly): ufunc.at took a tenth of the rollout manager's CPU at 32K-token lengths.
        inside = np.logical_or.reduceat(ids == self.response_ids[rows], offsets[:-1][actions])
        if not inside.all():
            token = int(np.flatnonzero(actions)[np.argmin(inside)])
            raise SampleError(f"mask_ids: response token {token} is not in its own kept set")

    @classmethod
    def from_completion(
        cls,
        completion: EngineCompletion,
        prompt_ids: Sequence[int],
        *,
        temperature: float,
        reward: float = 0.0,
        group_id: int = 0,
        engine: str = "",
        versions: dict[str, int] | None = None,
    ) -> Sample:
        """A sample from an engine :class:`~moerl.engines.protocol.Completion` of ``prompt_ids``.

        ``versions`` maps the engine's weight-version strings to policy versions (default: int(s)).
        """
        if completion.logprobs is None:
            raise SampleError("the completion has no output log-probs: request return_logprob=True")
        if completion.routing is not None and completion.routing_start != 0:
            raise SampleError(
                f"the completion's routing starts at position {completion.routing_start}; "
                "the trainer needs prompt routing too (routed_experts_start_len=0)"
            )
        per_token = np.empty(len(completion.output_ids), dtype=np.int64)
        for span in completion.weight_versions:
            v = span["version"]
            per_token[span["start"] : span["end"]] = versions[v] if versions is not None else int(v)
        return cls(
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            response_ids=completion.output_ids.astype(np.int32),
            behaviour_logprobs=completion.logprobs.astype(np.float32),
            versions=per_token,
            temperature=temperature,
            selected_logprobs=completion.sampling_logprobs,
            routing=completion.routing,
            mask_offsets=completion.mask_offsets,
            mask_ids=completion.mask_ids,
            reward=float(reward),
            group_id=group_id,
            finish_reason=completion.finish_reason.get("type", ""),
            engine=engine,
        ).validate()
