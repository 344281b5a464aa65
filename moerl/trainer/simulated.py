"""A simulated trainer: the job's trainer with time in place of a model, to run the job at production shape on CPU.

A step takes the job's instalments through the real batch distribution (GRPO advantages, aggregation weights,
token-balanced shards: global rank 0's real cost), then holds for the profile's time of their tokens on the GPUs it
stands for, scaled like the engines' time; the optimizer step adds the profile's fixed cost. It reports what the real
trainer reports of the batch (tokens, staleness), nothing of a model (no loss, mismatch or routing agreement). Its
weights are the real model's Hub names, shapes and dtype with no bytes (:meth:`SimulatedTrainer.hub_tensors`), so a
sync moves the model's byte count. Its checkpoint holds its version: the run state beside it is the job's own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moerl.checkpoint.hf import read_config
from moerl.layout import Layout
from moerl.megatron.parallel import init_distributed
from moerl.models import family_for
from moerl.sample import Sample
from moerl.simulation import TrainerProfile
from moerl.trainer.config import TrainerConfig
from moerl.trainer.distribute import BatchDistributor, Interlude
from moerl.trainer.protocol import TrainerLike
from moerl.trainer.trainer import LAG_BINS, staleness_metrics

STATE = "simulated_trainer.json"


class SimulatedTrainer(TrainerLike):
    def __init__(
        self,
        hf_dir: str | Path,
        cfg: TrainerConfig,
        profile: TrainerProfile,
        gpus: int,
        time_scale: float,
        dtype: torch.dtype,
    ):
        """The model of the HF directory ``hf_dir`` (its config alone), trained at ``profile``'s rate on ``gpus`` GPUs,
        time running ``time_scale`` times faster than real; ``dtype``: of the weights a sync sends."""
        init_distributed(Layout())  # one process stands for the whole trainer
        if dist.get_world_size() != 1:
            raise ValueError(f"a simulated trainer runs as one process, not {dist.get_world_size()}")
        self.cfg, self.profile, self.gpus, self.time_scale, self.dtype = cfg, profile, gpus, time_scale, dtype
        raw = read_config(hf_dir)
        family = family_for(raw)
        self.hf_config = family.normalize(raw)
        moe = family.moe_layer_pattern(self.hf_config)
        self.batches = BatchDistributor(cfg, list(range(sum(moe))))  # one stage: every MoE layer's routing
        self.version = 0

    def _spend(self, simulated_s: float) -> None:
        time.sleep(simulated_s / self.time_scale)

    def step(
        self,
        samples: list[Sample] | Iterable[list[Sample] | Interlude] | None,
        interlude: Callable[[int], None] | None = None,
    ) -> dict[str, float]:
        """:meth:`Trainer.step <moerl.trainer.trainer.Trainer.step>`'s contract, each instalment's tokens taking the
        profile's time."""
        instalments = [samples] if isinstance(samples, list) else samples
        lag_tokens, max_lag, tokens = np.zeros(LAG_BINS), float("-inf"), 0
        for instalment in self.batches.instalments(instalments, interlude):
            self._spend(self.profile.seconds(sum(s.fed_len for s in instalment.samples), self.gpus))
            for sample in instalment.samples:
                lag = self.version - sample.at_actions(sample.versions)  # context has no version
                lag_tokens += np.bincount(np.clip(lag, 0, LAG_BINS - 1), minlength=LAG_BINS)
                max_lag, tokens = max(max_lag, float(lag.max())), tokens + len(lag)
        if not tokens:
            raise ValueError("SimulatedTrainer.step got an empty batch")
        self._spend(self.profile.optimizer_step_s)
        self.version += 1
        return {"train/tokens": float(tokens), **staleness_metrics(lag_tokens.tolist(), max_lag, float(tokens))}

    def hub_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight of the model under its Hub name: its shape and dtype on the ``meta`` device, no bytes."""
        for name, shape in family_for(self.hf_config).hub_shapes(self.hf_config).items():
            yield name, torch.empty(shape, dtype=self.dtype, device="meta")

    def save(self, ckpt_dir: str | Path) -> None:
        ckpt_dir = Path(ckpt_dir)
        ckpt_dir.mkdir(parents=True, exist_ok=False)
        (ckpt_dir / STATE).write_text(json.dumps({"version": self.version}))

    def load(self, ckpt_dir: str | Path) -> None:
        state = Path(ckpt_dir) / STATE
        if not state.is_file():
            raise FileNotFoundError(f"{ckpt_dir}: no {STATE}; not a simulated run's checkpoint")
        self.version = json.loads(state.read_text())["version"]
