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
    selected_logprob: float  # the same token's log-prob renormalised over the kept set
    kept_ids: torch.Tensor | None = None  # int64 [k], ascending (only when the request asked for masks)
    kept_logprobs: torch.Tensor | None = None  # float32 [k], renormalised over the kept set, aligned with kept_ids
    # The most likely tokens and their log-probs (as ``logprob``), descending (only when the request asked for them)
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


_MASK64 = (1 << 64) - 1


def position_uniform(seed: int, position: int) -> float:
    """The uniform a request seeded ``seed`` draws its token at sequence ``position`` with: a function of the two alone
    (SplitMix64's finaliser; 24 bits, exact in float32), so a request continued from its own output (the rollout
    manager's chunks) draws what it would have drawn in one piece, as SGLang's seeded sampling hashes the seed with the
    position (multinomial_with_seed)."""
    x = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((x ^ (x >> 31)) >> 40) / float(1 << 24)


def sample_batch(
    logits: torch.Tensor,
    params: list,
    uniforms: list[float],
    want_kept: list[bool],
    want_top: list[int] | None = None,
) -> list[Draw]:
    """Draw one token per row of ``logits`` [B, V] under each row's own sampling ``params`` (resolved
    :class:`~moerl.engines.protocol.SamplingParams`: greedy is top_k 1) and uniform in [0, 1)
    (:func:`position_uniform`); with each row's kept set where ``want_kept``, and its ``want_top`` most likely tokens
    (SGLang's top_logprobs_num).

    Truncation follows SGLang's order: top-k, then top-p (the smallest prefix of the descending
    distribution whose mass reaches top_p; the token crossing the threshold is kept), then min-p
    (p >= min_p * max p). Every one of them keeps a prefix of the sorted distribution, so each row's
    kept set is its first ``count`` sorted ids and only that prefix ever leaves the device. A row
    draws by inverse CDF from its uniform, so its tokens do not depend on which other requests share the batch.
    """
    batch, vocab = logits.shape
    device = logits.device
    column = lambda values, dtype=torch.float32: torch.tensor(values, dtype=dtype, device=device)[:, None]
    logprobs = torch.log_softmax(logits.float() / column([p.temperature for p in params]), dim=-1)
    sorted_logprobs, order = logprobs.sort(dim=-1, descending=True)
    sorted_probs = sorted_logprobs.exp()
    rank = torch.arange(vocab, device=device)[None, :]
    keep = rank < column([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.long)
    truncated = sorted_probs * keep
    mass_before = truncated.cumsum(-1) - truncated
    # top_p = 1 keeps everything: no float-rounding loss of the tail.
    keep &= mass_before < column([p.top_p if p.top_p < 1.0 else float("inf") for p in params]) * truncated.sum(
        -1, keepdim=True
    )
    keep &= sorted_probs >= column([p.min_p for p in params]) * sorted_probs[:, :1]
    keep[:, 0] = True
    counts = keep.sum(-1)

    kept_mass = (sorted_probs * keep).cumsum(-1)
    uniform = column(uniforms)
    position = torch.searchsorted(kept_mass, uniform * kept_mass[:, -1:], right=True)
    position = torch.minimum(position, counts[:, None] - 1)
    kept_logprobs = sorted_logprobs - torch.logsumexp(
        sorted_logprobs.masked_fill(~keep, float("-inf")), dim=-1, keepdim=True
    )
    tokens = order.gather(1, position).squeeze(1).tolist()
    full = sorted_logprobs.gather(1, position).squeeze(1).tolist()
    selected = kept_logprobs.gather(1, position).squeeze(1).tolist()
    draws = [Draw(t, lp, sel) for t, lp, sel in zip(tokens, full, selected, strict=True)]  # one of each per row

    rows = [b for b in range(batch) if want_kept[b]]
    if rows:
        index = torch.tensor(rows, device=device)
        width = int(counts[index].max())
        ids = order[index, :width].cpu()
        lps = kept_logprobs[index, :width].cpu()
        for i, (b, n) in enumerate(zip(rows, counts[index].tolist(), strict=True)):
            ascending = ids[i, :n].argsort()
            draws[b].kept_ids, draws[b].kept_logprobs = ids[i, :n][ascending], lps[i, :n][ascending]
    for b, k in enumerate(want_top or []):
        if k:
            draws[b].top_ids, draws[b].top_logprobs = order[b, :k].tolist(), sorted_logprobs[b, :k].tolist()
    return draws
