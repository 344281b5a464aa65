"""Adapter-only weight sync: after a LoRA step only the adapters move (megabytes, not the model).

Every trainer rank joins the gather toward global rank 0 (:class:`~moerl.megatron.weights.Gather`: TP shards,
each EP rank's experts, each PP stage's layers); rank 0 converts them to the ``sglang`` adapter layout and loads them into every engine under a versioned
name (``/load_lora_adapter_from_tensors``, or an adapter directory and ``/load_lora_adapter`` when
``directory`` is set: SGLang takes tensors only from processes on its own machine). The engines'
base weights never change; requests name the adapter they sample with.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from moerl.checkpoint.peft import export_adapter, save_adapter
from moerl.megatron.lora import LoRAConfig, is_lora_param
from moerl.megatron.weights import Gather
from moerl.models import family_for
from moerl.weight_sync.base import SyncStats, WeightSync


def adapter_name(version: int | str) -> str:
    return f"moerl-lora-v{version}"


class AdapterSync(WeightSync):
    """Adapters only, while the engines keep serving: requests in flight finish with the adapter they started with
    (their tokens carry its version), new ones name the new adapter (:attr:`adapter`). Unloading adapters nothing
    uses any more is the rollout manager's part, as only it knows which requests use which."""

    def __init__(self, urls: list[str] | None, lora: LoRAConfig, hf_config: dict, base_model: str, directory: str | Path | None = None):
        """``urls``: the engines, on global rank 0 (None elsewhere); ``directory``: load adapters from directories
        written there (SGLang on other machines) instead of as tensors over HTTP."""
        super().__init__(urls, "moerl-adapter-sync")
        self.lora, self.hf_config, self.base_model = lora, hf_config, base_model
        self.directory = Path(directory) if directory is not None else None
        self.gather: Gather | None = None

    def connect(self) -> None:
        if self.directory is not None and self.link is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def start(self, trainer, engines_hold_it: bool) -> None:
        # A new run's policy is the base model itself (every B starts at zero): engines started here from it need
        # no adapter. Engines given by URL are sent it as on a resume; their base model must be this run's (sync.verify).
        if not engines_hold_it:
            self.update(trainer)

    def update(self, trainer, only: list[str] | None = None) -> SyncStats | None:
        if not self.reach_engines(only):
            return None
        if self.gather is None:
            self.gather = Gather(trainer.model.module, select=is_lora_param)  # every adapter factor, whole, on rank 0
        lora = self.gather.gather()  # every rank: the gather is collective
        self.adapter = adapter_name(trainer.version)
        if self.link is None:
            return None
        return self.push(lora, trainer.version)

    def served(self, version: int) -> tuple[str | None, str | None]:
        # The engines keep their base weight version: the adapter's name carries the policy's.
        return None, adapter_name(version) if version else None

    def push(self, lora: dict[str, torch.Tensor], version: int) -> SyncStats:
        """Rank 0: load the adapters ``lora`` (full megatron names) into every engine as policy ``version``."""
        start = time.perf_counter()
        family = family_for(self.hf_config)
        # The engines (SGLang, moerl serve) take one module per expert.
        files = export_adapter(family, family.normalize(self.hf_config), lora, self.lora, "sglang", self.base_model)
        name = adapter_name(version)
        if self.directory is None:
            self.link.run(self.link.client.load_lora_from_tensors(name, files.config, files.tensors))
        else:
            path = save_adapter(self.directory / name, files)
            self.link.run(self.link.client.load_lora(name, str(path.resolve())))
        tensors = files.tensors
        return SyncStats(tensors=len(tensors), bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
                         buckets=1, seconds=time.perf_counter() - start)
