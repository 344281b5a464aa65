"""Log-probs and entropy on vocab-parallel logits, full-vocabulary (of the targets, or of any ids per row) or
renormalised over kept sets.

Each TP rank holds logits ``[T, V/tp]`` for its vocabulary shard. Reductions across the shards go
through megatron-core's ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity
backward: every rank computes the same loss downstream), so autograd gives the exact gradient with
no hand-written backward. The kept-set ("Keep Sampling Mask") variant touches only the kept ids that
fall in this rank's shard, gathered from the CSR arrays: no ``[T, V]`` mask is ever built.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region


def _tp() -> tuple[int, int]:
    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def _sum(x: torch.Tensor) -> torch.Tensor:
    return reduce_from_tensor_model_parallel_region(x) if _tp()[0] > 1 else x


def _max(x: torch.Tensor) -> torch.Tensor:
    """Max across shards, as a constant: a logsumexp shift does not change its value or gradient."""
    x = x.detach().clone()
    if _tp()[0] > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    return x


def _target_logits(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """``logits[t, targets[t, j]]`` [T, k] at global ids, each from the shard that holds it."""
    local = targets.long() - vocab_start
    inside = (local >= 0) & (local < logits.shape[1])
    picked = logits.gather(1, local.clamp(0, logits.shape[1] - 1))
    return _sum(torch.where(inside, picked, torch.zeros_like(picked)))


def logprobs_at(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits) over the whole vocabulary at ``ids`` [T, k] (global ids, any k per row: a teacher's top-k),
    [T, k]. ``logits`` [T, V/tp]."""
    _, rank = _tp()
    shift = _max(logits.max(dim=1).values)
    sumexp = _sum((logits - shift[:, None]).exp().sum(dim=1))
    return _target_logits(logits, ids, rank * logits.shape[1]) - shift[:, None] - sumexp.log()[:, None]


def full_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[targets] over the whole vocabulary. ``logits`` [T, V/tp], ``targets`` [T] global ids."""
    return logprobs_at(logits, targets[:, None])[:, 0]


def masked_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """log-prob of ``targets`` renormalised over each row's kept set.

    Row ``t``'s kept ids are ``ids[offsets[t]:offsets[t+1]]`` (global vocabulary ids, CSR). The
    target must be in its row's kept set (the sample contract checks it).
    """
    _, rank = _tp()
    rows_total, shard = logits.shape
    # No step waits for the device to say a size (the kept ids outside this rank's shard are masked, not dropped): the
    # loss would otherwise hold the host after the forward, and the backward's launch with it.
    rows = torch.repeat_interleave(
        torch.arange(rows_total, device=logits.device), offsets[1:] - offsets[:-1], output_size=ids.numel()
    )
    local = ids.long() - rank * shard
    inside = (local >= 0) & (local < shard)
    # Masked before the exp: masked after it, an outside logit whose exp overflows would give the backward 0 * inf.
    kept = logits[rows, local.clamp(0, shard - 1)].masked_fill(~inside, float("-inf"))
    shift = torch.full((rows_total,), float("-inf"), dtype=logits.dtype, device=logits.device)
    shift = _max(shift.scatter_reduce(0, rows, kept.detach(), reduce="amax"))
    sumexp = _sum(
        torch.zeros(rows_total, dtype=logits.dtype, device=logits.device).index_add(0, rows, (kept - shift[rows]).exp())
    )
    return _target_logits(logits, targets[:, None], rank * shard)[:, 0] - shift - sumexp.log()


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the whole vocabulary, per row. ``logits`` [T, V/tp]."""
    shift = _max(logits.max(dim=1).values)
    shifted = logits - shift[:, None]
    sumexp = _sum(shifted.exp().sum(dim=1))
    # H = log Z - E_p[z] with z shifted: sum_v p_v z_v = sum_v exp(z_v) z_v / Z.
    return sumexp.log() - _sum((shifted.exp() * shifted).sum(dim=1)) / sumexp
