"""Simulation profiles: what a simulated engine and a simulated trainer take their time from.

A profile describes one engine replica (all its GPUs) and the trainer's per-GPU rate at the layout its figures come
from, for one model. ``moerl serve --simulate PROFILE`` serves simulated replicas (:mod:`moerl.engines.simulated`);
the job with ``simulation.profile=PROFILE`` runs its own orchestrator against them and a simulated trainer
(:mod:`moerl.trainer.simulated`). The file is YAML, checked in full when read, so a typo is one error naming the field::

    name: tests-tiny
    model: ../tiny-hf        # a directory with the Hub config.json (optional: --model), relative to this file
    dtype: float32
    sources: ["where each figure comes from"]
    engine:
      gpus: 1
      max_running_requests: 64
      prefill_tokens_per_s: 20000
      decode_tokens_per_s: {1: 100, 64: 1600}   # one engine, all its requests together
      weight_update_gb_per_s: 1.0
      response_tokens: {median: 40, p99: 200}   # log-normal, capped at max_new_tokens
    trainer:                                    # only the job's simulation needs it
      tokens_per_s_per_gpu: 500
      optimizer_step_s: 0.5
    episodes:                                   # agentic episodes (rollout.agent=simulated): optional
      turns: {median: 4, p99: 12}               # engine requests per episode
      tool_seconds: {median: 2, p99: 30}        # a tool's wall time between turns (simulated seconds)
      observation_tokens: {median: 300, p99: 4000}  # its output, fed before the next turn

Every distribution is log-normal (median and 99th percentile); counts are rounded, turns to at least one.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moerl.dtypes import MODEL_DTYPES
from moerl.errors import ConfigError

Z99 = 2.3263478740408408  # the standard normal's 99th percentile


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LengthProfile(_Strict):
    """Response lengths in tokens: log-normal with this median and 99th percentile."""

    median: float = Field(gt=0)
    p99: float = Field(gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> LengthProfile:
        if self.p99 < self.median:
            raise ValueError(f"p99 ({self.p99}) is below the median ({self.median})")
        return self

    def draw(self, rng: np.random.Generator) -> float:
        return float(rng.lognormal(math.log(self.median), math.log(self.p99 / self.median) / Z99))


class EngineProfile(_Strict):
    """One engine replica (all its GPUs) serving the profile's model."""

    gpus: int = Field(default=1, gt=0)  # of one replica: a pool of N engine GPUs serves N // gpus replicas
    max_running_requests: int = Field(gt=0)
    # while it prefills, the engine decodes nothing (SGLang without mixed chunks)
    prefill_tokens_per_s: float = Field(gt=0)
    # Decode tokens/s of the whole engine by the number of requests running: linear between the points, flat above the
    # last; below the first, each request decodes at the first point's rate per request.
    decode_tokens_per_s: dict[int, float] = Field(min_length=1)
    # A disk update's bytes per second into the engine: the update holds it this long. The job's simulation syncs by
    # disk, so this stands for whatever transport the figure comes from; a broadcast's bytes take the real transport's
    # time.
    weight_update_gb_per_s: float = Field(gt=0)
    response_tokens: LengthProfile

    @model_validator(mode="after")
    def _positive(self) -> EngineProfile:
        bad = {k: v for k, v in self.decode_tokens_per_s.items() if k < 1 or not v > 0}
        if bad:
            raise ValueError(f"decode_tokens_per_s needs running requests >= 1 and tokens/s > 0, got {bad}")
        return self

    def decode_rate(self, running: int) -> float:
        """Tokens/s each of ``running`` requests gets."""
        points = sorted(self.decode_tokens_per_s.items())
        first, rate = points[0]
        if running <= first:
            return rate / first
        return float(np.interp(running, [k for k, _ in points], [v for _, v in points])) / running


class TrainerProfile(_Strict):
    """The trainer at the layout the figures come from, per GPU: the job's ``simulation.trainer_gpus`` scales it."""

    # Training tokens (prompt and response) per second per GPU, the proximal-policy pass and the forward-backward
    # together.
    tokens_per_s_per_gpu: float = Field(gt=0)
    optimizer_step_s: float = Field(ge=0)  # per step, whatever its tokens: gradient reduction, clipping, the optimizer

    def seconds(self, tokens: int, gpus: int) -> float:
        """Simulated seconds of training ``tokens`` on ``gpus`` GPUs (the optimizer step apart)."""
        return tokens / (self.tokens_per_s_per_gpu * gpus)


class EpisodeProfile(_Strict):
    """Agentic episodes as the simulated agent runs them: a turn is one request (its length the engine's
    ``response_tokens``), then a tool's wait and output, then the next turn."""

    turns: LengthProfile
    tool_seconds: LengthProfile
    observation_tokens: LengthProfile


class Profile(_Strict):
    name: str
    model: str | None = None  # a Hub model directory (config.json at least), relative to the profile's file
    dtype: str = "bfloat16"
    sources: list[str] = Field(min_length=1)  # where each figure comes from
    engine: EngineProfile
    trainer: TrainerProfile | None = None
    episodes: EpisodeProfile | None = None

    @model_validator(mode="after")
    def _dtype(self) -> Profile:
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(MODEL_DTYPES)}")
        return self

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"simulation profile {path}: cannot be read ({e})") from None
        try:
            profile = cls.model_validate(raw)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '(top)'}: {err['msg']}" for err in e.errors())
            raise ConfigError(f"simulation profile {path}: {problems}") from None
        if profile.model is not None:
            profile.model = str((path.parent / profile.model).resolve())
        return profile
