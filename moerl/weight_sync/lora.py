"""Adapter-only weight sync: after a LoRA step only the adapters move (megabytes, not the model).

Every trainer rank joins the gather toward global rank 0 (:class:`~moerl.megatron.weights.Gather`: TP shards,
each EP rank's experts, each PP stage's layers); rank 0 converts them to the ``sglang`` adapter layout and loads
them into every engine under a versioned name (``/load_lora_adapter_from_tensors``, or an adapter directory and
``/load_lora_adapter`` when ``directory`` is set: SGLang takes tensors only from processes on its own machine). The
engines' base weights never change; requests name the adapter they sample with.
"""

from __future__ import annotations

import logging
import secrets
import time
from pathlib import Path

import torch

from moerl.checkpoint.peft import AdapterFiles, export_adapter, save_adapter
from moerl.engines.client import EngineError
from moerl.megatron.lora_config import LoRAConfig, is_lora_param
from moerl.megatron.weights import Gather
from moerl.models import family_for
from moerl.weight_sync.base import EngineCall, SyncStats, WeightSync

log = logging.getLogger("moerl.sync")


class AdapterSync(WeightSync):
    """Adapters only, while the engines keep serving: requests in flight finish with the adapter they started with
    (their tokens carry its version), new ones name the new adapter (:attr:`adapter`). Unloading adapters nothing
    uses any more is the rollout manager's part, as only it knows which requests use which."""

    def __init__(
        self,
        urls: list[str] | None,
        lora: LoRAConfig,
        hf_config: dict,
        base_model: str,
        directory: str | Path | None = None,
    ):
        """``urls``: the engines, on global rank 0 (None elsewhere); ``directory``: load adapters from directories
        written there (SGLang on other machines) instead of as tensors over HTTP."""
        super().__init__(urls, "moerl-adapter-sync")
        self.lora, self.hf_config, self.base_model = lora, hf_config, base_model
        self.directory = Path(directory) if directory is not None else None
        self.gather: Gather | None = None
        # Names unique to this start of the job: engines given by URL may still hold a crashed or earlier run's adapter
        # of the same version, which an engine refuses to load again.
        self.run_tag = secrets.token_hex(3)
        self.pushes: dict[int, int] = {}  # policy version -> adapters loaded for it

    def adapter_name(self, version: int | str) -> str:
        return f"moerl-lora-{self.run_tag}-v{version}"

    def connect(self) -> None:
        if self.directory is not None and self.link is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def start(self, trainer, engines_hold_it: bool) -> None:
        # A new run's policy is the base model itself (every B starts at zero): engines started here from it need
        # no adapter. Engines given by URL are sent it as on a resume; their base model must be this run's
        # (sync.verify).
        if not engines_hold_it:
            self.update(trainer)

    def update(self, trainer, only: list[str] | None = None) -> SyncStats | None:
        if not self.reach_engines(only):
            return None
        if self.gather is None:
            self.gather = Gather(trainer.model.module, select=is_lora_param)  # every adapter factor, whole, on rank 0
        lora = self.gather.gather()  # every rank: the gather is collective
        # A catch-up loads the same policy again under a name of its own: a replica that only hung still holds the
        # first.
        again = self.pushes.get(trainer.version, 0)
        self.pushes[trainer.version] = again + 1
        self.adapter = self.adapter_name(trainer.version) + (f".{again}" if again else "")
        stats, failed = None, None
        if self.link is not None:
            try:
                assert lora is not None, "the gather ends on global rank 0, the one with the link"
                stats = self.push(lora, self.adapter)
            except Exception as e:  # noqa: BLE001 - every engine went while it loaded, or a load failed: every rank stops
                failed = e
        self.agreed(error=failed)
        return stats

    def close(self) -> None:
        """Unload the adapter in use: engines given by URL outlive the job, and would keep it."""
        if self.link is not None and self.adapter is not None:
            try:
                self.link.run(self.link.client.unload_lora(self.adapter))
            except EngineError as e:  # an engine that is down has lost it anyway
                log.warning("unloading adapter %s at the end: %s", self.adapter, e)
        super().close()

    def served(self, version: int) -> tuple[str | None, str | None]:
        # The engines keep their base weight version: the adapter's name carries the policy's.
        return None, self.adapter

    def push(self, lora: dict[str, torch.Tensor], name: str) -> SyncStats:
        """Rank 0: load the adapters ``lora`` (full megatron names) into every engine under ``name``."""
        start = time.perf_counter()
        family = family_for(self.hf_config)
        # The engines (SGLang, moerl serve) take one module per expert.
        files = export_adapter(family, family.normalize(self.hf_config), lora, self.lora, "sglang", self.base_model)
        self.load(name, files)
        tensors = files.tensors
        return SyncStats(
            tensors=len(tensors),
            bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
            buckets=1,
            seconds=time.perf_counter() - start,
        )

    def load(self, name: str, files: AdapterFiles) -> None:
        """Rank 0: the adapter ``files`` into every chosen engine under ``name``. An engine that goes meanwhile is
        passed over (it takes the adapter when it is back); those that loaded it are not asked again, which they would
        refuse."""
        if self.directory is None:
            self.on_engines(
                lambda client: client.load_lora_from_tensors(name, files.config, files.tensors), EngineCall.ONCE
            )
        else:
            path = save_adapter(self.directory / name, files)
            self.on_engines(lambda client: client.load_lora(name, str(path.resolve())), EngineCall.ONCE)
