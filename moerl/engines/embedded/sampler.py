"""Token sampling that records the kept set (the top-k / top-p / min-p support) of every draw.

The trainer re-applies the same truncation ("Keep Sampling Mask") to score an action under the
distribution that actually produced it, so the kept set is returned exactly as sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Draw:
    """One sampled token of one request."""

    token: int
    logprob: float  # under the temperature-scaled full distribution (before truncation)
    kept_ids: torch.Tensor  # int64 [k], ascending
    kept_logprobs: torch.Tensor  # float32 [k], renormalised over the kept set, aligned with kept_ids

    @property
    def selected_logprob(self) -> float:
        """Log-prob of the sampled token renormalised over the kept set."""
        return float(self.kept_logprobs[torch.searchsorted(self.kept_ids, self.token)])


def kept_mask(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Boolean mask [V] of the ids that survive top-k, then top-p, then min-p (SGLang's order).

    top-p keeps the smallest prefix of the descending distribution whose mass reaches ``top_p``
    (the token that crosses the threshold is kept); min-p keeps ids with p >= min_p * max p.
    """
    vocab = probs.shape[-1]
    sorted_probs, order = probs.sort(descending=True)
    keep_sorted = torch.ones(vocab, dtype=torch.bool, device=probs.device)
    if 0 < top_k < vocab:
        keep_sorted[top_k:] = False
    if top_p < 1.0:
        truncated = torch.where(keep_sorted, sorted_probs, torch.zeros_like(sorted_probs))
        mass_before = truncated.cumsum(0) - truncated
        keep_sorted &= mass_before < top_p * truncated.sum()
    if min_p > 0.0:
        keep_sorted &= sorted_probs >= min_p * sorted_probs[0]
    keep_sorted[0] = True
    mask = torch.zeros(vocab, dtype=torch.bool, device=probs.device)
    mask[order[keep_sorted]] = True
    return mask


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, generator: torch.Generator | None) -> Draw:
    """Draw one token from ``logits`` [V]. Temperature 0 is greedy (the kept set is the argmax)."""
    logits = logits.float()
    if temperature <= 0.0:
        logprobs = torch.log_softmax(logits, dim=-1)
        token = int(logits.argmax())
        ids = torch.tensor([token], device=logits.device)
        return Draw(token, float(logprobs[token]), ids.cpu(), torch.zeros(1))
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    probs = logprobs.exp()
    mask = kept_mask(probs, top_k, top_p, min_p)
    ids = mask.nonzero().squeeze(1)
    kept = probs[ids]
    choice = torch.multinomial(kept / kept.sum(), 1, generator=generator)
    token = int(ids[choice])
    kept_logprobs = torch.log_softmax(logprobs[ids], dim=-1)
    return Draw(token, float(logprobs[token]), ids.cpu(), kept_logprobs.cpu())
