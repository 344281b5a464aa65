"""Per-rank bodies of tests/trainer/test_loss_mask.py (importable by spawned processes)."""

from __future__ import annotations

from tests.workers import full_tensors


def action_logprobs_and_step(mcore_dir: str, trainer_cfg, samples: list) -> dict:
    """What this rank receives of ``samples`` (given on rank 0) and, on the last pipeline stage, the old-policy
    log-probs the trainer scores for each of its samples; then one step on them: its metrics and the full gradients it
    applied (rank 0)."""
    from moerl.trainer.trainer import Trainer

    trainer = Trainer(mcore_dir, trainer_cfg)
    instalment = trainer.batches.scatter(samples)
    batches = trainer.micro_batches(instalment)
    trainer.score(batches)
    logprobs: list = [None] * len(instalment.samples)
    for mb in batches:
        if mb.dummy or mb.old is None:  # old: scored on the last stage only
            continue
        assert mb.sample_indices is not None, "micro_batches numbers them"
        for j, i in enumerate(mb.sample_indices):
            logprobs[i] = mb.old[mb.seq == j].cpu()
    return {
        "last": trainer.batches.needs.last,
        "samples": instalment.samples,
        "advantages": instalment.advantages,
        "action_counts": instalment.action_counts,
        "logprobs": logprobs,
        "metrics": trainer.step(samples),
        "grads": full_tensors(trainer.model.module, grads=True),
    }
