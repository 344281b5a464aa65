"""GRPO-family objectives on flat per-token tensors.

Every function takes the action tokens of a micro-batch (its response tokens less any context of an agent
episode) flattened to ``[T]``, with ``seq`` [T] naming the sample each token belongs to (0..S-1 within the
micro-batch). The loss of a micro-batch is ``sum_t weight_t * term_t`` where ``weight_t`` comes from the
aggregation over the *global* batch, so splitting the batch into micro-batches or data-parallel shards does not
change the loss.

Three log-probs meet here: ``behaviour`` (the engine that sampled, possibly several versions old),
``old`` (the proximal policy: the trainer's weights before this update, scored by the trainer) and
``new`` (being optimised). The policy ratio is new/old; the correction for stale or mismatched
rollouts is old/behaviour.

Every ratio is formed from a log-ratio clamped to [-20, 20] (GSPO's sequence log-ratio to at most 10,
the k3 estimate to at most 10), as verl does: a token sampled many versions ago, or one the engine
and trainer disagree on wildly, then weighs at most e^20 instead of making the loss inf or NaN.

The sequence-level corrections (``seq_is``, ``geo_is``, ``seq_mask``, ``geo_mask``, ``k3_mask``) weigh every token of
a sample alike; a rejected sample weighs 0 but stays in the aggregation's divisor (as slime's rejection keeps its
denominators), and ``veto_below`` rejects any sample holding one token the proximal policy all but excludes.

On-policy distillation adds a fourth, the teacher's log-prob of each action (:class:`DistillConfig`): its k1 reverse
KL to the proximal policy joins the advantage (:func:`distill_advantages`), so clipping, the corrections and the
aggregation treat it as the reward's; and a top-k term compares the two policies over the teacher's most likely ids
(:func:`topk_reverse_kl`).

Process rewards (:class:`CreditConfig`) score each step of a response: a credit rule maps a sample's group-normalised
step rewards to each step's value, added (weighted) to the outcome advantage at that step's actions
(:func:`process_advantages`), so the advantage varies along the response; the rest of the loss reads it per token as
it reads the outcome's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import torch

from moerl.choices import ConfigError, check_choices
from moerl.plugins import Registry, callable_problem
from moerl.sample import Sample

KLEstimator = Literal["k1", "k3"]
# The built-in corrections that weigh each token alone (``veto_below``, a sequence's rejection, is refused with these).
TOKEN_CORRECTIONS = ("none", "tis", "icepop", "token_mask")
LOG_RATIO_BOUND = 20.0  # |log r| before exp: e^20 is finite in fp32 even times any advantage
SEQ_LOG_RATIO_MAX = 10.0  # GSPO's sequence ratio is at most e^10
K3_MAX = 10.0

# (new, old, advantages, seq, num_seqs, cfg) -> per-token loss terms [T] and a per-token "clipped" indicator [T];
# ``old`` comes detached.
PolicyLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, "LossConfig"], tuple[torch.Tensor, torch.Tensor]
]
# (log old/behaviour [T], detached, seq, num_seqs, cfg) -> per-token weight [T].
Correction = Callable[[torch.Tensor, torch.Tensor, int, "LossConfig"], torch.Tensor]
# One sample's group-normalised step rewards, float64 [S] -> each step's value [S] (added to the outcome advantage at
# the step's actions).
CreditRule = Callable[[np.ndarray], np.ndarray]


class Aggregation(Protocol):
    """How the loss of the global batch is averaged: each sample's weight of its tokens, known alone (a batch consumed
    in instalments weighs each instalment with these), and the divisor of the whole batch. ``lengths``: each sample's
    actions (its response tokens less any context: only actions are scored)."""

    def sample_weights(self, lengths: np.ndarray) -> np.ndarray: ...

    def normalizer(self, lengths: np.ndarray, max_response_len: int | None) -> float: ...


def _aggregation_problem(entry: Any) -> str | None:
    has = all(callable(getattr(entry, name, None)) for name in ("sample_weights", "normalizer"))
    return None if has else f"is {type(entry).__name__}, not an Aggregation (sample_weights and normalizer)"


POLICY_LOSSES: Registry[PolicyLoss] = Registry("trainer.loss.policy_loss", callable_problem)
CORRECTIONS: Registry[Correction] = Registry("trainer.loss.correction", callable_problem)
AGGREGATIONS: Registry[Aggregation] = Registry("trainer.loss.aggregation", _aggregation_problem)
CREDITS: Registry[CreditRule] = Registry("trainer.loss.credit.rule", callable_problem)


@dataclass
class DistillConfig:
    """On-policy distillation from a teacher whose log-probs the samples carry (``trainer.loss.distill.*``)."""

    # k1 reverse KL as a per-token advantage: A_t = reward_weight * A + coef * (log p_teacher - log p_old)
    coef: float = 0.0
    reward_weight: float = 1.0  # weight of the task's GRPO advantage (0: pure distillation)
    # KL(student || teacher) over the teacher's top_k ids at each action, renormalised there, times top_k_coef
    top_k: int = 0
    top_k_coef: float = 0.0

    @property
    def enabled(self) -> bool:
        """The samples must carry the teacher's log-probs (and, with top_k, its top-k)."""
        return self.coef > 0 or self.top_k > 0

    def __post_init__(self):
        for name in ("coef", "reward_weight", "top_k", "top_k_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(f"loss.distill.{name} must be >= 0, got {getattr(self, name)}")
        if (self.top_k > 0) != (self.top_k_coef > 0):
            raise ConfigError(
                f"loss.distill.top_k and top_k_coef come together (both > 0 or both 0), got {self.top_k}, "
                f"{self.top_k_coef}"
            )
        if self.reward_weight == 0 and not self.enabled:
            raise ConfigError(
                "loss.distill.reward_weight=0 leaves nothing to learn from without a teacher: set distill.coef or "
                "distill.top_k (with top_k_coef) > 0"
            )


@dataclass
class CreditConfig:
    """How step rewards (process rewards) join the outcome advantage (``trainer.loss.credit.*``)."""

    # a name in CREDITS ("outcome": the outcome advantage alone; "sum", "min": process credit), or
    # package.module:function
    rule: str = "outcome"
    weight: float = 1.0  # the process term's weight beside the outcome advantage

    @property
    def process(self) -> bool:
        """The samples must carry step rewards, and each action takes its own advantage."""
        return self.rule != "outcome"

    def __post_init__(self):
        CREDITS.check(self.rule)
        if not self.weight >= 0:
            raise ConfigError(f"trainer.loss.credit.weight must be >= 0, got {self.weight}")


@dataclass
class LossConfig:
    policy_loss: str = "ppo"  # a name in POLICY_LOSSES, or package.module:function
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.28
    dual_clip: float | None = 3.0  # for negative advantages, the loss is capped at -A * dual_clip (PPO only)
    aggregation: str = "token_mean"  # seq_mean_token_sum_norm: Dr. GRPO; or package.module:object
    # Dr. GRPO's constant normaliser (the main job sets rollout.max_new_tokens; library default: the batch's longest)
    max_response_len: int | None = None
    std_normalize: bool = True  # GRPO advantages divided by the group's std (off: Dr. GRPO)
    correction: str = "tis"  # behaviour -> proximal; or package.module:function
    is_cap: float = 2.0  # truncation of token (tis) and sequence (seq_is, geo_is, seq_mask) weights
    # icepop weighs a token by k = old/behaviour inside [band_low, band_high] and zeroes it outside;
    # token_mask keeps the in-band tokens unweighted (rejection only, no correction);
    # seq_mask rejects a sample whose product of k lies outside, the kept ones weighted by it (truncated at is_cap).
    band_low: float = 0.5
    band_high: float = 2.0
    # geo_mask keeps (unweighted) a sample whose geometric mean of k lies in [geo_band_low, geo_band_high]
    geo_band_low: float = 0.999
    geo_band_high: float = 1.001
    k3_bound: float = 0.01  # k3_mask rejects a sample whose mean k3 (k - log k - 1) exceeds it
    # sequence-level corrections: a sample holding any token with k < veto_below weighs 0 (null: no veto)
    veto_below: float | None = None
    kl_coef: float = 0.0  # reference KL penalty (0: no reference model)
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    distill: DistillConfig = field(default_factory=DistillConfig)
    credit: CreditConfig = field(default_factory=CreditConfig)

    def __post_init__(self):
        check_choices(self, "loss")
        for registry, name in (
            (POLICY_LOSSES, self.policy_loss),
            (CORRECTIONS, self.correction),
            (AGGREGATIONS, self.aggregation),
        ):
            registry.check(name)
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ConfigError(
                f"loss.clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, {self.clip_high}"
            )
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"loss.dual_clip must be > 1 (or null), got {self.dual_clip}")
        for low, high in (("band_low", "band_high"), ("geo_band_low", "geo_band_high")):
            if not 0 <= getattr(self, low) < getattr(self, high):
                raise ConfigError(
                    f"loss.{low} must be >= 0 and below {high}, got {getattr(self, low)}, {getattr(self, high)}"
                )
        if not self.k3_bound > 0:
            raise ConfigError(f"loss.k3_bound must be > 0, got {self.k3_bound}")
        if self.veto_below is not None and not 0 < self.veto_below < 1:
            raise ConfigError(f"loss.veto_below must be in (0, 1) (or null), got {self.veto_below}")
        if self.veto_below is not None and self.correction in TOKEN_CORRECTIONS:
            raise ConfigError(
                f"loss.veto_below applies to the sequence-level corrections (seq_is, geo_is, seq_mask, geo_mask, "
                f"k3_mask), not correction={self.correction!r}"
            )


def grpo_advantages(
    rewards: np.ndarray,
    group_ids: np.ndarray,
    std_normalize: bool,
    eps: float = 1e-6,
    episodes: Sequence[int | None] | None = None,
) -> np.ndarray:
    """Each episode's reward minus its group's mean over episodes, divided by the group's (population) std over
    episodes when asked; every sample of an episode takes the episode's advantage. ``episodes``: each sample's
    episode within its group, the samples an episode forked into sharing it and its reward (counted once); None, for
    all or for a sample: an episode of its own, as a single-turn completion is."""
    rewards = np.asarray(rewards, dtype=np.float64)
    group_ids = np.asarray(group_ids)
    out = np.empty_like(rewards)
    for g in np.unique(group_ids):
        members = np.flatnonzero(group_ids == g)
        # Each member's episode, as the index of the episode's first member: forked samples meet there.
        first: dict[int, int] = {}
        owner = np.arange(len(members))
        for k, i in enumerate(members.tolist()):
            episode = None if episodes is None else episodes[i]
            if episode is not None:
                owner[k] = first.setdefault(episode, k)
        heads = np.unique(owner)  # the episodes, in the order their first samples come
        episode_rewards = rewards[members[heads]]
        if not np.array_equal(rewards[members], rewards[members[owner]], equal_nan=True):
            raise ValueError(f"group {g}: the samples of one episode carry different rewards (an episode has one)")
        centred = episode_rewards - episode_rewards.mean()
        advantages = centred / (episode_rewards.std() + eps) if std_normalize else centred
        out[members] = advantages[np.searchsorted(heads, owner)]
    return out.astype(np.float32)


@CREDITS.register("outcome")
def outcome_credit(step_values: np.ndarray) -> np.ndarray:
    """No process term: each action takes its sample's outcome advantage."""
    return np.zeros_like(step_values)


@CREDITS.register("sum")
def sum_credit(step_values: np.ndarray) -> np.ndarray:
    """DeepSeekMath's process supervision (arXiv 2402.03300, 4.1.3): a step's value is the sum of its own and every
    later step's normalised reward (a return with no discount)."""
    return np.cumsum(step_values[::-1])[::-1]


@CREDITS.register("min")
def min_credit(step_values: np.ndarray) -> np.ndarray:
    """PURE's min-form credit (arXiv 2504.15275): a step's value is the worst normalised reward of its own and every
    later step. A sum rewards many steps that each score well, which a policy learns to hack; the minimum does not."""
    return np.minimum.accumulate(step_values[::-1])[::-1]


def process_advantages(samples: Sequence[Sample], outcome: np.ndarray, cfg: LossConfig) -> list[np.ndarray]:
    """Per sample, float32 [actions]: its ``outcome`` advantage plus ``credit.weight`` times its action's step value.
    Step rewards are normalised over every step of every sample of the group (its population std, plus 1e-6, divides
    them with ``std_normalize``), then the credit rule gives each step's value; the "outcome" rule reads no step
    rewards."""
    credit = cfg.credit
    rule = CREDITS.load(credit.rule)
    if credit.process:
        lacking = [i for i, s in enumerate(samples) if s.step_rewards is None]
        if lacking:
            raise ValueError(
                f"{len(lacking)} sample(s) carry no step rewards (at {lacking[:8]}, of groups "
                f"{sorted({samples[i].group_id for i in lacking})[:8]}): "
                f"trainer.loss.credit.rule={credit.rule} needs step rewards (a process reward model "
                "reward.process.model, a reward function returning step scores, or an environment scoring turns)"
            )
        steps = _normalised_step_rewards(samples, cfg.std_normalize)
    else:
        steps = [np.zeros(len(s.steps)) for s in samples]
    out = []
    for s, advantage, normalised in zip(samples, np.asarray(outcome, dtype=np.float64), steps, strict=True):
        values = np.asarray(rule(normalised), dtype=np.float64)
        if values.shape != normalised.shape:
            raise ValueError(
                f"trainer.loss.credit.rule={credit.rule} gave shape {values.shape} for {len(normalised)} steps "
                "(one value per step)"
            )
        out.append((advantage + credit.weight * values[s.step_of_actions()]).astype(np.float32))
    return out


def _normalised_step_rewards(samples: Sequence[Sample], std_normalize: bool, eps: float = 1e-6) -> list[np.ndarray]:
    """Each sample's step rewards (float64), centred on the mean over all its group's steps and, with
    ``std_normalize``, divided by their population std (plus ``eps``): DeepSeekMath's normalisation."""
    rewards = [np.asarray(s.step_rewards, dtype=np.float64) for s in samples]
    groups = np.array([s.group_id for s in samples])
    out: list[np.ndarray] = [np.empty(0)] * len(samples)
    for g in np.unique(groups):
        members = np.flatnonzero(groups == g).tolist()
        pooled = np.concatenate([rewards[i] for i in members])
        scale = pooled.std() + eps if std_normalize else 1.0
        for i in members:
            out[i] = (rewards[i] - pooled.mean()) / scale
    return out


def aggregation_weights(lengths: np.ndarray, aggregation: str, max_response_len: int | None = None) -> np.ndarray:
    """Per-sample weight of each of its scored tokens, over the whole global batch of samples. ``lengths``: each
    sample's actions (its response tokens less any context: only actions are scored)."""
    return sample_weights(lengths, aggregation) / aggregation_normalizer(lengths, aggregation, max_response_len)


def sample_weights(lengths: np.ndarray, aggregation: str) -> np.ndarray:
    """The part of :func:`aggregation_weights` each sample knows alone; a batch consumed in instalments
    (periodic mode) weighs each instalment with these and divides the gradient by the normaliser at the end."""
    return AGGREGATIONS.load(aggregation).sample_weights(np.asarray(lengths, dtype=np.float64))


def aggregation_normalizer(lengths: np.ndarray, aggregation: str, max_response_len: int | None = None) -> float:
    """The global batch's divisor."""
    return AGGREGATIONS.load(aggregation).normalizer(np.asarray(lengths, dtype=np.float64), max_response_len)


class _TokenMean:
    """Every action token of the global batch weighs the same."""

    def sample_weights(self, lengths: np.ndarray) -> np.ndarray:
        return np.ones_like(lengths)

    def normalizer(self, lengths: np.ndarray, max_response_len: int | None) -> float:
        return float(lengths.sum())


class _SeqMeanTokenMean:
    """Each sample's mean over its tokens, averaged over the samples."""

    def sample_weights(self, lengths: np.ndarray) -> np.ndarray:
        return 1.0 / lengths

    def normalizer(self, lengths: np.ndarray, max_response_len: int | None) -> float:
        return float(len(lengths))


class _SeqMeanTokenSumNorm(_TokenMean):
    """Dr. GRPO: token sums over the samples times a constant length (no length bias)."""

    def normalizer(self, lengths: np.ndarray, max_response_len: int | None) -> float:
        return float(len(lengths) * (max_response_len or lengths.max()))


AGGREGATIONS.register("token_mean")(_TokenMean())
AGGREGATIONS.register("seq_mean_token_mean")(_SeqMeanTokenMean())
AGGREGATIONS.register("seq_mean_token_sum_norm")(_SeqMeanTokenSumNorm())


def _per_seq_sum(x: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add(0, seq, x)


def _per_seq_mean(x: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    return _per_seq_sum(x, seq, num_seqs) / _per_seq_sum(torch.ones_like(x), seq, num_seqs)


def _k3(log_r: torch.Tensor) -> torch.Tensor:
    """k3 = r - log r - 1 >= 0 per token, log r clamped to +-LOG_RATIO_BOUND (expm1: exact for small log r)."""
    log_r = log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.expm1(log_r) - log_r


def safe_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """A ratio from its log, the log clamped to +-LOG_RATIO_BOUND so it stays finite."""
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()


def correction(
    old: torch.Tensor, behaviour: torch.Tensor, seq: torch.Tensor, num_seqs: int, cfg: LossConfig
) -> torch.Tensor:
    """Per-token weight for the behaviour -> proximal mismatch (a constant: no gradient)."""
    return CORRECTIONS.load(cfg.correction)((old - behaviour).detach(), seq, num_seqs, cfg)


@CORRECTIONS.register("none")
def no_correction(log_w: torch.Tensor, seq: torch.Tensor, num_seqs: int, cfg: LossConfig) -> torch.Tensor:
    return torch.ones_like(log_w)


@CORRECTIONS.register("tis")
def truncated_is(log_w: torch.Tensor, seq: torch.Tensor, num_seqs: int, cfg: LossConfig) -> torch.Tensor:
    return safe_exp(log_w).clamp(max=cfg.is_cap)


def _in_band(w: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Where ``w`` lies in [low, high], edges included."""
    return (w >= low) & (w <= high)


@CORRECTIONS.register("icepop")
def icepop(log_w: torch.Tensor, seq: torch.Tensor, num_seqs: int, cfg: LossConfig) -> torch.Tensor:
    """IcePop (Ring-1T, arXiv 2510.18855): in-band tokens keep their correction k, the rest none at all."""
    w = safe_exp(log_w)
    return torch.where(_in_band(w, cfg.band_low, cfg.band_high), w, 0.0)


@CORRECTIONS.register("token_mask")
def token_mask(log_w: torch.Tensor, seq: torch.Tensor, num_seqs: int, cfg: LossConfig) -> torch.Tensor:
    """IcePop's band, kept tokens unweighted: rejection only."""
    w = safe_exp(log_w)
    return _in_band(w, cfg.band_low, cfg.band_high).to(w.dtype)


def on_tokens(
    per_seq: torch.Tensor, log_w: torch.Tensor, seq: torch.Tensor, num_seqs: int, cfg: LossConfig
) -> torch.Tensor:
    """Each sample's weight [S] on each of its tokens [T], a sample with a token k < ``cfg.veto_below`` weighing 0
    (slime's veto): what every sequence-level correction returns."""
    if cfg.veto_below is not None:
        vetoed = _per_seq_sum((log_w < math.log(cfg.veto_below)).to(log_w.dtype), seq, num_seqs) > 0
        per_seq = torch.where(vetoed, 0.0, per_seq)
    return per_seq[seq]


def _seq_ratio(log_w: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Each sample's product of token ratios k [S]."""
    return safe_exp(_per_seq_sum(log_w, seq, num_seqs))


def _geo_ratio(log_w: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Each sample's geometric mean of token ratios k [S]."""
    return safe_exp(_per_seq_mean(log_w, seq, num_seqs))


@CORRECTIONS.register("seq_is")
def sequence_is(log_w: torch.Tensor, seq: torch.Tensor, num_seqs: int, cfg: LossConfig) -> torch.Tensor:
    """The sequence's product of token ratios, truncated, on each of its tokens."""
    return on_tokens(_seq_ratio(log_w, seq, num_seqs).clamp(max=cfg.is_cap), log_w, seq, num_seqs, cfg)


@CORRECTIONS.register("geo_is")
def geometric_is(log_w: torch.Tensor, seq: torch.Tensor, num_seqs: int, cfg: LossConfig) -> torch.Tensor:
    """The geometric mean of the sequence's token ratios, truncated, on each of its tokens."""
    return on_tokens(_geo_ratio(log_w, seq, num_seqs).clamp(max=cfg.is_cap), log_w, seq, num_seqs, cfg)


@CORRECTIONS.register("seq_mask")
def sequence_mask(log_w: torch.Tensor, seq: torch.Tensor, num_seqs: int, cfg: LossConfig) -> torch.Tensor:
    """Seq-MIS (verl's preset; slime's sequence-level TIS with sequence-level rejection): a sequence whose product of
    ratios lies in [band_low, band_high] weighs that product truncated at is_cap, any other sequence 0."""
    w = _seq_ratio(log_w, seq, num_seqs)
    return on_tokens(
        torch.where(_in_band(w, cfg.band_low, cfg.band_high), w.clamp(max=cfg.is_cap), 0.0), log_w, seq, num_seqs, cfg
    )


@CORRECTIONS.register("geo_mask")
def geometric_mask(log_w: torch.Tensor, seq: torch.Tensor, num_seqs: int, cfg: LossConfig) -> torch.Tensor:
    """Geo-RS (verl's preset; slime's geometric rejection): a sequence whose geometric mean of ratios lies in
    [geo_band_low, geo_band_high] weighs 1, any other 0 (rejection only)."""
    w = _geo_ratio(log_w, seq, num_seqs)
    return on_tokens(_in_band(w, cfg.geo_band_low, cfg.geo_band_high).to(w.dtype), log_w, seq, num_seqs, cfg)


@CORRECTIONS.register("k3_mask")
def k3_mask(log_w: torch.Tensor, seq: torch.Tensor, num_seqs: int, cfg: LossConfig) -> torch.Tensor:
    """K3-RS (verl's preset): a sequence whose mean k3 = k - log k - 1 (the k3 estimate of KL(behaviour || proximal))
    is at most k3_bound weighs 1, any other 0 (rejection only)."""
    within = _per_seq_mean(_k3(log_w), seq, num_seqs) <= cfg.k3_bound
    return on_tokens(within.to(log_w.dtype), log_w, seq, num_seqs, cfg)


def policy_terms(
    new: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, seq: torch.Tensor, num_seqs: int, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token policy-gradient loss terms [T] and a per-token "clipped" indicator [T]."""
    return POLICY_LOSSES.load(cfg.policy_loss)(new, old.detach(), advantages, seq, num_seqs, cfg)


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


@POLICY_LOSSES.register("ppo")
def ppo(
    new: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, seq: torch.Tensor, num_seqs: int, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate; with ``dual_clip``, a negative advantage's loss capped at -A * dual_clip."""
    terms, was_clipped = _clipped_surrogate(safe_exp(new - old), advantages, cfg)
    if cfg.dual_clip is not None:
        cap = -advantages * cfg.dual_clip
        dual = (advantages < 0) & (terms > cap)
        terms = torch.where(dual, cap, terms)
        was_clipped = torch.maximum(was_clipped, dual.float())
    return terms, was_clipped


@POLICY_LOSSES.register("gspo")
def gspo(
    new: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, seq: torch.Tensor, num_seqs: int, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: the length-normalised sequence ratio, applied to every token of the sequence; its gradient flows
    through each token as exp(new_t - sg(new_t))."""
    seq_log_ratio = _per_seq_mean((new - old).detach(), seq, num_seqs)[seq]
    ratio = (seq_log_ratio + new - new.detach()).clamp(max=SEQ_LOG_RATIO_MAX).exp()
    return _clipped_surrogate(ratio, advantages, cfg)


@POLICY_LOSSES.register("cispo")
def cispo(
    new: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, seq: torch.Tensor, num_seqs: int, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO: the clipped ratio is a constant weight on the REINFORCE term; no token loses its gradient."""
    high = 1.0 + cfg.clip_high
    ratio = safe_exp((new - old).detach())
    return -advantages * ratio.clamp(max=high) * new, (ratio > high).float()


def kl_terms(new: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(new || ref) estimate from samples of the policy: k1 = log(new/ref), k3 = r - log r - 1 with
    r = ref/new (log r clamped to +-LOG_RATIO_BOUND, the estimate to at most K3_MAX)."""
    log_r = ref.detach() - new
    if estimator == "k1":
        return -log_r
    return _k3(log_r).clamp(max=K3_MAX)


def distill_advantages(
    advantages: torch.Tensor, old: torch.Tensor, teacher: torch.Tensor | None, cfg: DistillConfig
) -> torch.Tensor:
    """Per-token advantages [T]: ``reward_weight * A + coef * (teacher - old)``, the k1 estimate of the reverse KL
    to the teacher (slime's OPD, A - coef * (log p_student - log p_teacher)), the log-ratio clamped to
    +-LOG_RATIO_BOUND (a teacher all but excluding a token). A constant: no gradient. ``teacher`` None: the reward's
    alone. ``advantages`` is per token: the outcome's, or with process credit each action's own."""
    out = cfg.reward_weight * advantages
    if teacher is not None and cfg.coef:
        out = out + cfg.coef * (teacher - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return out.detach()


def topk_reverse_kl(student_top_logprobs: torch.Tensor, teacher_top_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(q_s || q_t) [T] per token, where q_s and q_t are the student's and the teacher's distributions
    renormalised over the same k ids ([T, k] log-probs each, any normaliser: it cancels). The gradient flows through
    the student's; each log-ratio is clamped to +-LOG_RATIO_BOUND, finite where the teacher gives an id almost
    nothing."""
    log_qs = torch.log_softmax(student_top_logprobs, dim=-1)
    log_qt = torch.log_softmax(teacher_top_logprobs.detach(), dim=-1)
    return (log_qs.exp() * (log_qs - log_qt).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)).sum(-1)
