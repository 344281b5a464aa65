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
      prefix_cache_tokens: 100000               # the KV memory beside the weights, in tokens (optional)
      # log-normal, capped at max_new_tokens; correlation: of a prompt's responses' log-lengths (optional, 0)
      response_tokens: {median: 40, p99: 200, correlation: 0.5}
    trainer:                                    # only the job's simulation needs it
      tokens_per_s_per_gpu: 500
      optimizer_step_s: 0.5
    episodes:                                   # agentic episodes (rollout.agent=simulated): optional
      turns: {median: 4, p99: 12}               # engine requests per episode
      tool_seconds: {median: 2, p99: 30}        # a tool's wall time between turns (simulated seconds)
      observation_tokens: {median: 300, p99: 4000}  # its output, fed before the next turn

Every distribution is log-normal (median and 99th percentile); counts are rounded, turns to at least one. Response
lengths may also be correlated among the responses to one prompt (:class:`ResponseLengths`), and their figures can come
from a run's own lengths (:func:`fit_response_lengths`, ``moerl calibrate-lengths``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moerl.dtypes import MODEL_DTYPES
from moerl.errors import ConfigError, MoerlError

Z99 = 2.3263478740408408  # the standard normal's 99th percentile
LENGTHS_FILE = "lengths.jsonl"  # in a run directory: each finished group's response lengths (LengthRecord), a line each
MIN_GROUPS = 8  # of two responses or more: what a calibration needs at least


class CalibrationError(MoerlError):
    """Runs' lengths that cannot calibrate a profile: none recorded, too few groups, too many responses truncated."""


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

    @property
    def sigma(self) -> float:
        """The standard deviation of the log-lengths."""
        return math.log(self.p99 / self.median) / Z99

    def draw(self, rng: np.random.Generator) -> float:
        return float(rng.lognormal(math.log(self.median), self.sigma))


class ResponseLengths(LengthProfile):
    """An engine's response lengths: the log-normal of :class:`LengthProfile`, each response's length a function of its
    prompt and its sampling seed. ``correlation`` is that of the log-lengths of two responses to the same prompt (their
    intra-class correlation: how much of a length is the prompt's difficulty rather than the sample's luck); the
    marginal stays the configured log-normal whatever it is."""

    correlation: float = 0.0  # 0: the lengths of a prompt's responses are independent

    @model_validator(mode="after")
    def _correlation(self) -> ResponseLengths:
        if not 0 <= self.correlation < 1:
            raise ValueError(f"correlation must be in [0, 1) (0: independent lengths), got {self.correlation}")
        return self

    def tokens(self, prompt_ids: Sequence[int] | np.ndarray, seed: int) -> float:
        """The length of the response to ``prompt_ids`` sampled with ``seed``: log L = log(median) + sigma * (sqrt(rho)
        z_prompt + sqrt(1 - rho) z_sample), each z a standard normal hashed from the prompt's ids or from the seed, so
        that every replica and process draws the same."""
        z_prompt = _hashed_normal(b"prompt", np.asarray(prompt_ids, dtype=np.int64).tobytes())
        z_sample = _hashed_normal(b"sample", (seed % 2**64).to_bytes(8, "little"))
        return float(self._length(z_prompt, np.array([z_sample]))[0])

    def draw_group(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """The lengths of ``n`` responses to one prompt, the prompt's and each sample's normal drawn from ``rng`` (the
        offline model's draw; the engine's are :meth:`tokens`)."""
        return self.draw_epochs(rng, n, 1)[0]

    def draw_epochs(self, rng: np.random.Generator, n: int, epochs: int) -> np.ndarray:
        """The lengths of ``n`` responses to one prompt in each of ``epochs`` epochs (rows): the prompt's normal drawn
        once, each sample's anew."""
        z_prompt = float(rng.standard_normal())
        return np.stack([self._length(z_prompt, rng.standard_normal(n)) for _ in range(epochs)])

    def _length(self, z_prompt: float, z_sample: np.ndarray) -> np.ndarray:
        rho = self.correlation
        return self.median * np.exp(self.sigma * (math.sqrt(rho) * z_prompt + math.sqrt(1 - rho) * z_sample))


def _hashed_normal(kind: bytes, data: bytes) -> float:
    """A standard normal that is a function of ``data`` (``kind`` keeps different uses apart): two uniforms from its
    SHA-256, then Box-Muller."""
    digest = hashlib.sha256(kind + b":" + data).digest()
    u1 = (int.from_bytes(digest[:8], "little") + 1) / 2**64  # in (0, 1]: its log is finite
    u2 = int.from_bytes(digest[8:16], "little") / 2**64
    return math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)


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
    # Tokens of finished requests the replica's prefix cache holds (None: the embedded engine's default). SGLang keeps
    # their KV until memory is wanted, so a continuation or a next turn asked at once finds its prefix unless the KV
    # memory beside the weights is full: this is that memory, in tokens.
    prefix_cache_tokens: int | None = Field(default=None, ge=0)
    response_tokens: ResponseLengths

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


# ---- calibration from a run's lengths -----------------------------------------------------------------------------
@dataclass
class LengthRecord:
    """A finished group's response lengths, as the job records each in its run directory's :data:`LENGTHS_FILE`."""

    group: int  # the prompt's index in its run
    lengths: list[int]  # each response's tokens
    truncated: list[bool]  # each that stopped at a cap (finish reason "length"): its own length is longer
    max_new_tokens: int  # the cap of one request (rollout.max_new_tokens)
    # An agentic group: each length is an episode's whole response (turns, tools' output), not one request's
    episodes: bool = False

    def line(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def read_lengths(run_dir: str | Path) -> list[LengthRecord]:
    """A run's recorded groups, the last record of each index: a resumed run generates again the groups its
    checkpoint had not trained. A line a crash cut short (with the one a resumed run appended to it) is skipped."""
    path = Path(run_dir) / LENGTHS_FILE
    if not path.is_file():
        raise CalibrationError(f"{path} not found: is {run_dir} the run.dir of a moerl run (which records it)?")
    groups: dict[int, LengthRecord] = {}
    for line in path.read_text().splitlines():
        try:
            group = LengthRecord(**json.loads(line))
        except (ValueError, TypeError):
            continue
        groups[group.group] = group
    return list(groups.values())


@dataclass(frozen=True)
class LengthFit:
    """:func:`fit_response_lengths`'s answer: the fitted lengths and what they come from."""

    lengths: ResponseLengths
    groups: int
    samples: int
    truncated: float  # the fraction of the samples cut at a cap (censored in the fit)
    agentic_groups: int  # left out: an episode's response is not one request's

    def report(self) -> str:
        r = self.lengths
        left = f" ({self.agentic_groups} agentic groups left out)" if self.agentic_groups else ""
        return (
            f"groups {self.groups}, samples {self.samples}{left}\n"
            f"median {r.median:g} tokens, p99 {r.p99:g} tokens, correlation {r.correlation:g}\n"
            f"truncated (censored in the fit) {self.truncated:.1%}"
        )


def fit_response_lengths(groups: Sequence[LengthRecord]) -> LengthFit:
    """The log-normal median and p99 and the siblings' correlation of these groups' response lengths.

    A length L stands for the continuous lengths the simulator rounds up to it, (L - 1, L]: its log is taken at
    L - 1/2. A truncated response's length is only known to be above its own (right-censored): the log-lengths' mean
    and standard deviation are the censored normal's maximum-likelihood estimates (by expectation-maximisation),
    treating the samples as independent, which the correlation leaves unbiased. The correlation is the one-way ANOVA
    estimator of the log-lengths' intra-class correlation over the groups of two samples or more (for unequal sizes),
    each truncated log-length replaced by its expectation above the cap under the fitted normal, clipped to [0, 0.99].
    That replacement understates the correlation a little (on data drawn from the model, about 0.01 at 10% truncated
    and 0.03 to 0.05 at 30%). Agentic groups are left out."""
    single = [g for g in groups if not g.episodes]
    siblings = [g for g in single if len(g.lengths) >= 2]
    if len(siblings) < MIN_GROUPS:
        raise CalibrationError(
            f"{len(siblings)} groups of two responses or more (agentic ones left out) cannot calibrate the lengths: "
            f"at least {MIN_GROUPS} are needed; run longer, or give more run directories"
        )
    lengths = np.concatenate([np.asarray(g.lengths, dtype=np.float64) for g in single])
    truncated = np.concatenate([np.asarray(g.truncated, dtype=bool) for g in single])
    if truncated.mean() > 0.5:
        raise CalibrationError(
            f"{truncated.mean():.0%} of the responses stopped at their cap (finish reason length): past half, their "
            "median is unknown; run again with a higher rollout.max_new_tokens"
        )
    logs = np.where(truncated, np.log(np.maximum(lengths, 1)), np.log(np.maximum(lengths, 1) - 0.5))
    mu, sigma = _censored_normal(logs[~truncated], logs[truncated])
    filled = logs.copy()
    filled[truncated] = _mean_above(logs[truncated], mu, sigma)
    bounds = np.cumsum([len(g.lengths) for g in single])[:-1]
    rho = _intraclass_correlation([v for v in np.split(filled, bounds) if len(v) >= 2])
    fitted = ResponseLengths(
        median=float(f"{math.exp(mu):.4g}"),
        p99=float(f"{math.exp(mu + Z99 * sigma):.4g}"),
        correlation=round(min(max(rho, 0.0), 0.99), 3),
    )
    return LengthFit(fitted, len(single), len(lengths), float(truncated.mean()), len(groups) - len(single))


def _mean_above(points: np.ndarray, mu: float, sigma: float) -> np.ndarray:
    """E[X | X > point] for X ~ N(mu, sigma^2), at each point."""
    if sigma == 0:
        return np.maximum(points, mu)
    return mu + sigma * _inverse_mills((points - mu) / sigma)


def _inverse_mills(a: np.ndarray) -> np.ndarray:
    """phi(a) / (1 - Phi(a)), elementwise; its asymptote a + 1/a where the tail underflows."""
    tail = 0.5 * np.array([math.erfc(x / math.sqrt(2)) for x in np.ravel(a)]).reshape(np.shape(a))
    density = np.exp(-0.5 * np.square(a)) / math.sqrt(2 * math.pi)
    return np.where(tail > 1e-300, density / np.maximum(tail, 1e-300), a + 1 / np.maximum(a, 1))


def _censored_normal(exact: np.ndarray, above: np.ndarray, tolerance: float = 1e-9) -> tuple[float, float]:
    """The maximum-likelihood mean and standard deviation of a normal sample of which ``exact`` are observed and
    ``above`` only known to exceed their values (right-censored), by expectation-maximisation: each censored value's
    expectation and its square's, above its point under the current fit, stand for it until the fit stops moving.
    The log-likelihood is concave in (mu / sigma, 1 / sigma) (Olsen 1978): it has one maximum, which EM climbs to."""
    if not len(above):
        return float(exact.mean()), float(exact.std())
    points, counts = np.unique(above, return_counts=True)
    n = len(exact) + len(above)
    total, squares = exact.sum(), np.square(exact).sum()
    mu, sigma = float(np.median(np.concatenate([exact, above]))), max(float(exact.std()), 0.1)
    for _ in range(10_000):
        a = (points - mu) / sigma
        lam = _inverse_mills(a)
        mean = mu + sigma * lam  # of each censored value, and its variance below
        second = sigma**2 * (1 + a * lam - lam**2) + mean**2
        new_mu = float((total + (counts * mean).sum()) / n)
        new_sigma = math.sqrt(max(float((squares + (counts * second).sum()) / n) - new_mu**2, 0.0))
        moved = abs(new_mu - mu) + abs(new_sigma - sigma)
        mu, sigma = new_mu, new_sigma
        if moved < tolerance or sigma == 0:
            break
    return mu, sigma


def _intraclass_correlation(groups: list[np.ndarray]) -> float:
    """The one-way ANOVA estimator of the intra-class correlation, for groups of unequal sizes (two or more each):
    (MSB - MSW) / (MSB + (n0 - 1) MSW), n0 the groups' effective size."""
    sizes = np.array([len(g) for g in groups], dtype=np.float64)
    n, k = sizes.sum(), len(groups)
    means = np.array([g.mean() for g in groups])
    grand = float(np.concatenate(groups).mean())
    between = float((sizes * (means - grand) ** 2).sum()) / (k - 1)
    within = sum(float(np.square(g - m).sum()) for g, m in zip(groups, means, strict=True)) / (n - k)
    n0 = (n - float(np.square(sizes).sum()) / n) / (k - 1)
    denominator = between + (n0 - 1) * within
    return (between - within) / denominator if denominator > 0 else 0.0


def calibrated_profile(base: str | Path, fit: LengthFit, runs: Sequence[str | Path], out: str | Path) -> Path:
    """Write the profile ``base`` with its ``engine.response_tokens`` from ``fit`` and a source naming the runs, to
    ``out`` (its ``model`` made relative to ``out``'s directory); checked by reading it back."""
    base, out = Path(base), Path(out)
    Profile.load(base)  # a bad base is one error before anything is written
    raw = yaml.safe_load(base.read_text())
    raw["engine"]["response_tokens"] = fit.lengths.model_dump()
    if raw.get("model") is not None:
        raw["model"] = os.path.relpath((base.parent / raw["model"]).resolve(), out.parent.resolve())
    raw["sources"] = [
        *raw["sources"],
        f"engine.response_tokens (in place of any source above for them): fitted by moerl calibrate-lengths to "
        f"{fit.groups} groups ({fit.samples} responses, {fit.truncated:.1%} truncated) of {', '.join(map(str, runs))}",
    ]
    try:
        out.write_text(yaml.safe_dump(raw, sort_keys=False, width=120))
    except OSError as e:
        raise CalibrationError(f"cannot write {out} ({e})") from None
    Profile.load(out)
    return out
