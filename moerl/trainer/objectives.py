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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from moerl.config import ConfigError, check_choices

PolicyLoss = Literal["ppo", "gspo", "cispo"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
Correction = Literal["none", "tis", "seq_is", "geo_is", "icepop", "token_mask"]
KLEstimator = Literal["k1", "k3"]
LOG_RATIO_BOUND = 20.0  # |log r| before exp: e^20 is finite in fp32 even times any advantage
SEQ_LOG_RATIO_MAX = 10.0  # GSPO's sequence ratio is at most e^10
K3_MAX = 10.0


@dataclass
class LossConfig:
    policy_loss: PolicyLoss = "ppo"
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.28
    dual_clip: float | None = 3.0  # for negative advantages, the loss is capped at -A * dual_clip (PPO only)
    aggregation: Aggregation = "token_mean"  # seq_mean_token_sum_norm: Dr. GRPO
    # Dr. GRPO's constant normaliser (the main job sets rollout.max_new_tokens; library default: the batch's longest)
    max_response_len: int | None = None
    std_normalize: bool = True  # GRPO advantages divided by the group's std (off: Dr. GRPO)
    correction: Correction = "tis"  # behaviour -> proximal
    is_cap: float = 2.0  # truncation of token (tis) and sequence (seq_is, geo_is) weights
    # icepop weighs a token by k = old/behaviour inside [band_low, band_high] and zeroes it outside;
    # token_mask keeps the in-band tokens unweighted (rejection only, no correction).
    band_low: float = 0.5
    band_high: float = 2.0
    kl_coef: float = 0.0  # reference KL penalty (0: no reference model)
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self):
        check_choices(self, "loss")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ConfigError(
                f"loss.clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, {self.clip_high}"
            )
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"loss.dual_clip must be > 1 (or null), got {self.dual_clip}")
        if not 0 <= self.band_low < self.band_high:
            raise ConfigError(f"loss.band_low must be >= 0 and below band_high, got {self.band_low}, {self.band_high}")


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


def aggregation_weights(lengths: np.ndarray, aggregation: str, max_response_len: int | None = None) -> np.ndarray:
    """Per-sample weight of each of its scored tokens, over the whole global batch of samples. ``lengths``: each
    sample's actions (its response tokens less any context: only actions are scored)."""
    return sample_weights(lengths, aggregation) / aggregation_normalizer(lengths, aggregation, max_response_len)


def sample_weights(lengths: np.ndarray, aggregation: str) -> np.ndarray:
    """The part of :func:`aggregation_weights` each sample knows alone; a batch consumed in pieces
    (periodic mode) weighs each piece with these and divides the gradient by the normaliser at the end."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return 1.0 / lengths if aggregation == "seq_mean_token_mean" else np.ones_like(lengths)


def aggregation_normalizer(lengths: np.ndarray, aggregation: str, max_response_len: int | None = None) -> float:
    """The global batch's divisor: its action tokens (token_mean), its samples (seq_mean_token_mean), or its
    samples times a constant length (Dr. GRPO: no length bias)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if aggregation == "token_mean":
        return float(lengths.sum())
    if aggregation == "seq_mean_token_mean":
        return float(len(lengths))
    return float(len(lengths) * (max_response_len or lengths.max()))


def _per_seq_sum(x: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add(0, seq, x)


def safe_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """A ratio from its log, the log clamped to +-LOG_RATIO_BOUND so it stays finite."""
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()


def correction(
    old: torch.Tensor, behaviour: torch.Tensor, seq: torch.Tensor, num_seqs: int, cfg: LossConfig
) -> torch.Tensor:
    """Per-token weight for the behaviour -> proximal mismatch (a constant: no gradient)."""
    log_w = (old - behaviour).detach()
    if cfg.correction == "none":
        return torch.ones_like(log_w)
    if cfg.correction in ("tis", "icepop", "token_mask"):
        w = safe_exp(log_w)
        if cfg.correction == "tis":
            return w.clamp(max=cfg.is_cap)
        # IcePop (Ring-1T, arXiv 2510.18855): in-band tokens keep their correction k, the rest none at all.
        in_band = (w >= cfg.band_low) & (w <= cfg.band_high)
        return torch.where(in_band, w, 0.0) if cfg.correction == "icepop" else in_band.to(w.dtype)
    per_seq = _per_seq_sum(log_w, seq, num_seqs)
    if cfg.correction == "geo_is":
        per_seq = per_seq / _per_seq_sum(torch.ones_like(log_w), seq, num_seqs)
    return safe_exp(per_seq).clamp(max=cfg.is_cap)[seq]


def policy_terms(
    new: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, seq: torch.Tensor, num_seqs: int, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token policy-gradient loss terms [T] and a per-token "clipped" indicator [T]."""
    old = old.detach()
    log_ratio = new - old
    low, high = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    if cfg.policy_loss == "cispo":
        # CISPO: the clipped ratio is a constant weight on the REINFORCE term; no token loses its gradient.
        ratio = safe_exp(log_ratio.detach())
        weight = ratio.clamp(max=high)
        return -advantages * weight * new, (ratio > high).float()
    if cfg.policy_loss == "gspo":
        # GSPO: the length-normalised sequence ratio, applied to every token of the sequence; its
        # gradient flows through each token as exp(new_t - sg(new_t)).
        lengths = _per_seq_sum(torch.ones_like(new), seq, num_seqs)
        seq_log_ratio = (_per_seq_sum(log_ratio.detach(), seq, num_seqs) / lengths)[seq]
        ratio = (seq_log_ratio + new - new.detach()).clamp(max=SEQ_LOG_RATIO_MAX).exp()
    else:
        ratio = safe_exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(low, high)
    terms = torch.maximum(unclipped, clipped)
    was_clipped = (clipped > unclipped).float()
    if cfg.policy_loss == "ppo" and cfg.dual_clip is not None:
        cap = -advantages * cfg.dual_clip
        dual = (advantages < 0) & (terms > cap)
        terms = torch.where(dual, cap, terms)
        was_clipped = torch.maximum(was_clipped, dual.float())
    return terms, was_clipped


def kl_terms(new: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(new || ref) estimate from samples of the policy: k1 = log(new/ref), k3 = r - log r - 1 with
    r = ref/new (log r clamped to +-LOG_RATIO_BOUND, the estimate to at most K3_MAX)."""
    log_r = ref.detach() - new
    if estimator == "k1":
        return -log_r
    log_r = log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return (log_r.exp() - log_r - 1.0).clamp(max=K3_MAX)
