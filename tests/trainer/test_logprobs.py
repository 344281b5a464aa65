"""Vocab-parallel log-probs: the kept-set ("Keep Sampling Mask") and full-vocabulary forms and the
entropy against dense references, across TP shards on gloo ranks, and their gradients."""

from __future__ import annotations

import pytest
import torch

from moerl.megatron.launch import run_ranks
from moerl.trainer.logprobs import entropy, full_logprobs, masked_logprobs
from tests.workers import shard_logprobs

VOCAB, TOKENS = 48, 7


def _problem(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(TOKENS, VOCAB, generator=g) * 3).to(dtype)
    offsets, ids, targets = [0], [], []
    for t in range(TOKENS):
        # kept sets of varied size, some entirely inside one TP shard (the first's or the second's), some spanning both
        k = [1, 3, 5, 2, 12, 4, 30][t]
        kept = torch.randperm(VOCAB // 2 if t % 3 == 0 else VOCAB, generator=g)[:k].sort().values
        if t == 3:
            kept += VOCAB // 2
        ids += kept.tolist()
        offsets.append(len(ids))
        targets.append(int(kept[torch.randint(k, (1,), generator=g)]))
    return logits, torch.tensor(targets), torch.tensor(offsets), torch.tensor(ids)


def _dense_reference(logits, targets, offsets, ids):
    logits = logits.detach().clone().requires_grad_(True)
    mask = torch.full_like(logits, float("-inf"))
    for t in range(TOKENS):
        mask[t, ids[offsets[t] : offsets[t + 1]]] = 0.0
    masked = torch.log_softmax(logits + mask, dim=-1).gather(1, targets[:, None]).squeeze(1)
    logp = torch.log_softmax(logits, dim=-1)
    full = logp.gather(1, targets[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    return logits, masked, full, ent


@pytest.mark.e2e
@pytest.mark.parametrize("tp, outliers", [(1, False), (2, False), (2, True)])
def test_logprobs_and_entropy_match_dense_reference_across_tp_shards(tp, outliers):
    """``outliers``: the logits at each shard's edge far above the rest. A kept id outside a rank's shard is read at the
    edge and masked (no host sync for the compaction); its exp would overflow there, which must not reach the
    gradient."""
    logits, targets, offsets, ids = _problem()
    if outliers:
        logits[:, VOCAB // 2 - 1 : VOCAB // 2 + 1] = 200.0
    upstream = torch.linspace(-1.0, 2.0, TOKENS)
    ref_logits, masked, full, ent = _dense_reference(logits, targets, offsets, ids)
    (upstream * (masked + full + ent)).sum().backward()
    if tp == 1:
        shard = logits.clone().requires_grad_(True)
        got = [
            {
                "masked": masked_logprobs(shard, targets, offsets, ids),
                "full": full_logprobs(shard, targets),
                "entropy": entropy(shard),
            }
        ]
        (upstream * (got[0]["masked"] + got[0]["full"] + got[0]["entropy"])).sum().backward()
        got[0]["grad"] = shard.grad
    else:
        got = run_ranks(shard_logprobs, tp, logits, targets, offsets, ids, upstream)
    for rank_out in got:
        torch.testing.assert_close(rank_out["masked"].detach(), masked.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(rank_out["full"].detach(), full.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(rank_out["entropy"].detach(), ent.detach(), rtol=0, atol=1e-5)
    grad = torch.cat([r["grad"] for r in got], dim=1)
    torch.testing.assert_close(grad, ref_logits.grad, rtol=0, atol=1e-6)
    # single-id kept sets have log-prob exactly 0 and no gradient from the masked term
    assert masked[0].item() == 0.0


def test_masked_logprob_gradient_passes_finite_differences():
    logits, targets, offsets, ids = _problem(torch.float64)
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: masked_logprobs(z, targets, offsets, ids), (logits,), eps=1e-6, atol=1e-7)
    assert torch.autograd.gradcheck(lambda z: entropy(z), (logits,), eps=1e-6, atol=1e-7)
