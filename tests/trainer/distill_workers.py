"""Per-rank bodies of tests/trainer/test_distill.py (importable by spawned processes)."""

from __future__ import annotations

import os

import torch

from moerl.layout import Layout
from tests.workers import full_tensors, refusal


def step_with_teacher(mcore_dir: str, trainer_cfg, samples: list) -> dict:
    """One trainer step on ``samples`` (given on rank 0): its metrics and the full gradients it applied."""
    from moerl.trainer.trainer import Trainer

    trainer = Trainer(mcore_dir, trainer_cfg)
    metrics = trainer.step(samples if torch.distributed.get_rank() == 0 else None)
    return {"metrics": metrics, "grads": full_tensors(trainer.model.module, grads=True)}


def scatter_with_and_without_teacher(trainer_cfg, lacking: list, samples: list, pp: int) -> dict:
    """A bare distributor (no model) at ``pp`` stages: what rank 0's plan of ``lacking`` says (every rank is told it
    failed), then what this rank receives of ``samples``."""
    from moerl.megatron.parallel import init_distributed
    from moerl.trainer.distribute import BatchDistributor, LocalInstalment

    init_distributed(Layout(pp=pp))
    batches = BatchDistributor(trainer_cfg, columns=[])
    rank0 = torch.distributed.get_rank() == 0
    out: dict = {"needs": batches.needs, "refused": refusal(batches, lacking)}
    local = batches.scatter(samples if rank0 else None)
    assert isinstance(local, LocalInstalment), "rank 0 sent an instalment"
    out["samples"], out["received"] = local.samples, local.received
    return out


def shard_logprobs_at(logits: torch.Tensor, ids: torch.Tensor, upstream: torch.Tensor) -> dict:
    """:func:`~moerl.trainer.logprobs.logprobs_at` on this TP rank's vocabulary shard of ``logits``, with the gradient
    of ``sum(upstream * logprobs_at)`` w.r.t. the shard."""
    from megatron.core import parallel_state

    from moerl.megatron.parallel import init_distributed
    from moerl.trainer.logprobs import logprobs_at

    init_distributed(Layout(tp=int(os.environ["WORLD_SIZE"])))
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    shard = logits.chunk(tp, dim=1)[rank].clone().requires_grad_(True)
    got = logprobs_at(shard, ids)
    (upstream * got).sum().backward()
    return {"logprobs": got.detach(), "grad": shard.grad}
