"""Weight sync to engines on the trainer's own GPUs (``run.placement=colocated``): the engines' memory is released while
the trainer trains, and the new weights are handed over on the machine (``/update_weights_from_tensor``: CUDA IPC on a
GPU, shared memory on the CPU, :mod:`moerl.engines.tensor_ipc`), a bucket at a time, so the push costs the engines'
weights plus one bucket.

A colocated step, as the peers run it (waking weights and KV cache together runs out of memory): :meth:`sleep` pauses
the engines (``retract``: what waits holds no KV) and releases all their memory; the trainer trains; :meth:`update`
resumes the engines' weights (uninitialised), pushes, resumes their KV cache and CUDA graphs, and continues them. An
update while the engines are awake (a catch-up between two pieces of a step) pauses and resumes them as any full sync.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from moerl.engines.tensor_ipc import flattened_bucket, serialize
from moerl.weight_sync.base import FullWeightSync, SyncStats
from moerl.weight_sync.broadcast import buckets

_AFTER_WEIGHTS = ["kv_cache", "cuda_graph"]


class TensorSync(FullWeightSync):
    def __init__(self, urls: list[str] | None, bucket_bytes: int = 512 << 20, pause: str = "abort"):
        """``urls``: the engines, on global rank 0 (None elsewhere); ``pause``: how an update of awake engines pauses
        them (see :class:`~moerl.weight_sync.base.FullWeightSync`)."""
        super().__init__(urls, "moerl-tensor-sync", pause, flush_cache=True)
        self.bucket_bytes = bucket_bytes
        self.asleep = False  # rank 0: the engines' memory is released (sleep), until the next update wakes them
        self.sleep_seconds = 0.0  # rank 0: the last sleep's, and the last update's wake (resumes and continue)
        self.wake_seconds = 0.0

    def sleep(self) -> None:
        """Global rank 0, before the trainer's phase: the engines stop and give back their memory (KV cache, weights,
        CUDA graphs). An engine gone meanwhile is passed over: restarted, it holds its memory until the update."""
        start, self.sleep_seconds = time.perf_counter(), 0.0
        self.paused = True  # from here to the update's resume, the engines are asked whether they answer, not /health
        self.on_engines(lambda client: client.pause("retract"))
        self.on_engines(lambda client: client.release_memory())
        self.asleep = True
        self.sleep_seconds = time.perf_counter() - start

    def before_push(self) -> None:
        start = time.perf_counter()
        if self.asleep:
            self.on_engines(lambda client: client.resume_memory(["weights"]))
        else:
            super().before_push()
        self.wake_seconds = time.perf_counter() - start

    def after_push(self) -> None:
        start = time.perf_counter()
        if self.asleep:
            self.on_engines(lambda client: client.resume_memory(_AFTER_WEIGHTS))
            self.asleep = False
        super().after_push()
        self.wake_seconds += time.perf_counter() - start

    def push(self, named: Iterable[tuple[str, torch.Tensor]], version: str) -> SyncStats:
        stats, start = SyncStats(), time.perf_counter()
        infos = zip(self.engines, self.server_info(), strict=True)
        tp_sizes = {url: int(info.get("tp_size", 1)) for url, info in infos}
        for bucket in buckets(named, self.bucket_bytes):
            self.push_bucket(bucket, tp_sizes)
            stats.buckets += 1
            stats.tensors += len(bucket)
            stats.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        self.on_engines(lambda client: client.set_weight_version(version))
        stats.seconds = time.perf_counter() - start
        return stats

    def push_bucket(self, bucket: list[tuple[str, torch.Tensor]], tp_sizes: dict[str, int]) -> None:
        """Rank 0: one bucket to every engine, flattened on the tensors' device in memory IPC can share; freed once
        every engine answered (an engine answers once it has copied the bucket into its weights)."""
        payload = flattened_bucket(bucket)

        def handles(tp_size: int) -> list[str]:
            return [serialize(payload) for _ in range(tp_size)]  # each TP rank reads its own handles

        self.on_engines(
            lambda client: client.update_weights_from_tensor(
                handles, tp_sizes, "flattened_bucket", flush_cache=self.flush_cache
            )
        )
