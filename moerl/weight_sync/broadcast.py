"""Weight sync by broadcast: the trainer's rank 0 and every engine share one process group (NCCL on
GPU, gloo on CPU); the Hub-named tensors go out in ``flattened_bucket`` buckets, each announced to the
engines over HTTP while its bytes are broadcast, so an engine never holds more than one bucket extra.
The buckets of one update go inside a weight-update session (``/begin_weight_update`` ...
``/end_weight_update``), which SGLang 0.5.23 requires around distributed updates.
"""

from __future__ import annotations

import asyncio
import time
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from moerl.engines.weight_group import flatten_bucket, group_ranks, in_daemon_thread, join_weight_group, weight_store
from moerl.weight_sync.base import EngineLink, SyncStats


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    bucket, size = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class BroadcastSync(EngineLink):
    """The trainer side (global rank 0 only) of broadcast weight sync to the engines behind ``urls``."""

    def __init__(self, urls: list[str], master_address: str, backend: str, master_port: int = 0,
                 group_name: str = "moerl-weight-sync", bucket_bytes: int = 512 << 20, flush_cache: bool = True):
        """``flush_cache``: whether the engines flush their cache with the last bucket; false where updates
        land while requests run (an in_place pause), which SGLang refuses to flush."""
        super().__init__(urls, "moerl-weight-sync")
        self.master_address, self.master_port, self.backend = master_address, master_port, backend
        self.group_name, self.bucket_bytes, self.flush_cache = group_name, bucket_bytes, flush_cache
        self.group: dist.ProcessGroup | None = None

    def connect(self) -> None:
        """Form the group: the trainer is rank 0, and each engine takes as many ranks as its tensor-parallel size."""
        offsets, world = group_ranks([info["tp_size"] for info in self.run(self.client.server_info())])
        store = weight_store(self.master_address, self.master_port, world, 0)
        self.master_port = store.port

        async def both():
            joined = in_daemon_thread(join_weight_group, self.backend, store, world, 0, self.group_name)
            group, _ = await asyncio.gather(joined, self.client.init_weights_update_group(
                self.master_address, self.master_port, world, self.group_name, self.backend, rank_offsets=offsets))
            return group

        self.group = self.run(both())

    def push(self, named: Iterable[tuple[str, torch.Tensor]], version: str) -> SyncStats:
        """Send every tensor; the engines take ``version`` with the last bucket."""
        if self.group is None:
            raise RuntimeError("BroadcastSync.push before connect()")
        stats, start = SyncStats(), time.perf_counter()
        self.run(self.client.begin_weight_update())
        pending = None
        for bucket in buckets(named, self.bucket_bytes):
            if pending is not None:
                self._send(pending, None)
                stats.buckets += 1
            pending = bucket
            stats.tensors += len(bucket)
            stats.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        if pending is not None:
            self._send(pending, version)
            stats.buckets += 1
        self.run(self.client.end_weight_update())
        stats.seconds = time.perf_counter() - start
        return stats

    def _send(self, bucket: list[tuple[str, torch.Tensor]], version: str | None) -> None:
        flat, names, dtypes, shapes = flatten_bucket(bucket)
        if self.backend == "nccl":
            flat = flat.cuda()

        async def both():
            await asyncio.gather(
                in_daemon_thread(dist.broadcast, flat, 0, self.group),
                self.client.update_weights_from_distributed(names, dtypes, shapes, self.group_name, weight_version=version,
                                                            load_format="flattened_bucket", flush_cache=self.flush_cache and version is not None),
            )

        self.run(both())
