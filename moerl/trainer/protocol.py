"""What the job drives of a trainer: the real one (:class:`~moerl.trainer.trainer.Trainer`) or a simulation's
(:class:`~moerl.trainer.simulated.SimulatedTrainer`). Each weight sync reads more of the kind it is made for (the
model, or the simulation's Hub tensors)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import torch

from moerl.sample import Sample
from moerl.trainer.distribute import Interlude


class TrainerLike(Protocol):
    """Colocation takes more of the real trainer (its offloads), and refuses a simulation."""

    version: int  # the policy version of the current weights: the optimizer steps taken
    hf_config: dict  # the model's Hugging Face config, normalised (ModelFamily.normalize)
    dtype: torch.dtype  # of the weights, as a sync sends them

    def step(
        self,
        samples: list[Sample] | Iterable[list[Sample] | Interlude] | None,
        interlude: Callable[[int], None] | None = None,
    ) -> dict[str, float]:
        """One optimizer step on a global batch, read on global rank 0 (None elsewhere); its metrics."""
        ...

    def save(self, ckpt_dir: str | Path) -> None:
        """Collective: the trainer's checkpoint, to a directory it makes."""
        ...

    def load(self, ckpt_dir: str | Path) -> None:
        """Collective: the trainer as :meth:`save` left it."""
        ...
