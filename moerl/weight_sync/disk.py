"""Weight sync through a shared filesystem: the fallback when the engines cannot join a process group
(other clusters, firewalls). The Hub-named tensors are written as safetensors shards beside the model's
config and tokenizer, and every engine reloads them with ``/update_weights_from_disk``."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from moerl.files import staged_dir
from moerl.fp8 import QUANTIZATION_CONFIG
from moerl.megatron.weights import Gather
from moerl.weight_sync.base import FullWeightSync, SyncStats
from moerl.weight_sync.broadcast import buckets
from moerl.weight_sync.export import hf_named_tensors

# Everything of a HF model directory but its weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".safetensors.index.json", ".bin.index.json")


class DiskSync(FullWeightSync):
    def __init__(
        self,
        urls: list[str] | None,
        directory: str | Path,
        hf_dir: str | Path,
        shard_bytes: int = 2 << 30,
        pause: str = "abort",
        flush_cache: bool = True,
    ):
        """``urls``: the engines, on global rank 0 (None elsewhere); ``pause``, ``flush_cache``: see
        :class:`~moerl.weight_sync.base.FullWeightSync`."""
        super().__init__(urls, "moerl-disk-sync", pause, flush_cache)
        self.directory, self.hf_dir, self.shard_bytes = Path(directory), Path(hf_dir), shard_bytes
        self._previous: Path | None = None

    def connect(self) -> None:
        if self.link is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def push_model(self, model, hf_config: dict, version: str) -> SyncStats | None:
        """Collective: every weight gathered on rank 0 (:class:`~moerl.megatron.weights.Gather`), which writes them."""
        if self.gather is None:
            self.gather = Gather(model)
        # every rank iterates: the gathers are collective
        named = hf_named_tensors(self.gather, hf_config, self.quantization)
        if self.link is None:
            for _ in named:
                pass
            return None
        return self.push(named, version)

    def push(self, named: Iterable[tuple[str, torch.Tensor]], version: str) -> SyncStats:
        """Rank 0: the Hub-named tensors written as a new version directory, which every engine loads."""
        stats, start = SyncStats(), time.perf_counter()
        out = self.directory / f"v{version}"
        with staged_dir(out) as staging:  # engines only ever see complete directories
            self._write(staging, named, stats)
        self.on_engines(
            lambda client: client.update_weights_from_disk(
                str(out.resolve()), weight_version=version, flush_cache=self.flush_cache
            )
        )
        if self._previous not in (None, out):  # the same version again: a catch-up of a replica that came back
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = out
        stats.seconds = time.perf_counter() - start
        return stats

    def _write(self, staging: Path, named: Iterable[tuple[str, torch.Tensor]], stats: SyncStats) -> None:
        for item in self.hf_dir.iterdir():
            if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(item, staging / item.name)
        if self.quantization == "fp8":  # the directory holds FP8 weights and scales, and says so
            config = json.loads((staging / "config.json").read_text())
            (staging / "config.json").write_text(json.dumps(config | {"quantization_config": QUANTIZATION_CONFIG}))
        index = {}
        for n, shard in enumerate(buckets(self.on_host(named), self.shard_bytes)):
            name = f"model-{n:05d}.safetensors"
            self.save_shard(shard, staging / name)
            index.update({k: name for k, _ in shard})
            stats.add(shard)
        (staging / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": stats.bytes}, "weight_map": index})
        )

    def on_host(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        # a shard is written from host memory, not held on the GPU
        return ((name, tensor.cpu()) for name, tensor in named)

    def save_shard(self, shard: list[tuple[str, torch.Tensor]], path: Path) -> None:
        save_file({k: t.contiguous() for k, t in shard}, str(path), metadata={"format": "pt"})
