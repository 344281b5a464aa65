"""The sample contract: what crosses from rollout to trainer, one record per completion.

Arrays are compact and positional. With ``P`` prompt tokens and ``R`` response tokens the trainer feeds
the ``L = P + R - 1`` tokens ``(prompt + response)[:-1]``; position ``i`` predicts token ``i + 1``, so
response token ``j`` is scored at position ``P - 1 + j``. Routing has one row per fed position (what the
engine's routers saw), kept sets one row per response token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moerl.errors import MoerlError


class SampleError(MoerlError):
    """A sample whose arrays do not fit together; the message names the field."""


@dataclass
class Sample:
    prompt_ids: np.ndarray  # int32 [P]
    response_ids: np.ndarray  # int32 [R]
    behaviour_logprobs: np.ndarray  # float32 [R], full vocabulary, temperature-scaled (what the engine reported)
    versions: np.ndarray  # int64 [R], policy version that produced each response token
    temperature: float = 1.0
    selected_logprobs: np.ndarray | None = None  # float32 [R], renormalised over the kept set
    routing: np.ndarray | None = None  # uint8/int16 [P + R - 1, moe_layers, topk]
    mask_offsets: np.ndarray | None = None  # int64 [R + 1], CSR over response tokens
    mask_ids: np.ndarray | None = None  # int32 [mask_offsets[-1]]
    reward: float = 0.0
    group_id: int = 0
    finish_reason: str = "stop"
    engine: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

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

    def validate(self) -> Sample:
        p, r = self.prompt_len, self.response_len
        if p < 1 or r < 1:
            raise SampleError(f"a sample needs >= 1 prompt and >= 1 response token, got P={p}, R={r}")
        for name in ("behaviour_logprobs", "versions", "selected_logprobs"):
            value = getattr(self, name)
            if value is not None and value.shape != (r,):
                raise SampleError(f"{name} has shape {value.shape}, expected ({r},) (one per response token)")
        if self.routing is not None and (self.routing.ndim != 3 or self.routing.shape[0] != p + r - 1):
            raise SampleError(f"routing has shape {self.routing.shape}, expected ({p + r - 1}, moe_layers, topk)")
        if (self.mask_offsets is None) != (self.mask_ids is None):
            raise SampleError("mask_offsets and mask_ids come together")
        if self.mask_offsets is not None and self.mask_ids is not None:  # both or neither: checked above
            offsets = self.mask_offsets
            if (
                offsets.shape != (r + 1,)
                or offsets[0] != 0
                or offsets[-1] != len(self.mask_ids)
                or np.any(np.diff(offsets) < 1)
            ):
                raise SampleError(
                    f"mask_offsets must be [R+1] = [{r + 1}] non-decreasing from 0 to len(mask_ids) with >= 1 id per "
                    "token"
                )
            rows = np.repeat(np.arange(r), np.diff(offsets))
            # Per token, over its own non-empty run of ids (offsets rise at each): ufunc.at took a tenth of the rollout
            # manager's CPU at 32K-token lengths.
            inside = np.logical_or.reduceat(self.mask_ids == self.response_ids[rows], offsets[:-1])
            if not inside.all():
                raise SampleError(f"response token {int(np.argmin(inside))} is not in its own kept set")
        return self

    @classmethod
    def from_completion(
        cls,
        completion,
        prompt_ids,
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
