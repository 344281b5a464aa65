"""Weight sync by broadcast: the trainer's rank 0 and every engine share one process group (NCCL on
GPU, gloo on CPU); the Hub-named tensors go out in ``flattened_bucket`` buckets, each announced to the
engines over HTTP while its bytes are broadcast, so an engine never holds more than one bucket extra, and
the trainer two (the one on the wire and the one being gathered).
The buckets of one update go inside a weight-update session (``/begin_weight_update`` ...
``/end_weight_update``), which SGLang 0.5.23 requires around distributed updates.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from moerl.engines.weight_group import flatten_bucket, in_daemon_thread, join_weight_group, weight_store
from moerl.megatron.parallel import collective_device
from moerl.weight_sync.base import FullWeightSync, SyncStats


def group_ranks(tp_sizes: list[int]) -> tuple[list[int], int]:
    """``(rank offset of each engine, world size)`` of a weight group of the trainer (rank 0) and engines of
    these tensor-parallel sizes: SGLang joins replica ``i``'s ranks at ``rank_offset + tp_rank``."""
    offsets, next_rank = [], 1
    for size in tp_sizes:
        offsets.append(next_rank)
        next_rank += size
    return offsets, next_rank


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


class BroadcastSync(FullWeightSync):
    """The trainer side of broadcast weight sync to the engines behind ``urls`` (global rank 0; None elsewhere)."""

    def __init__(self, urls: list[str] | None, master_address: str, backend: str, master_port: int = 0,
                 group_name: str = "moerl-weight-sync", bucket_bytes: int = 512 << 20, pause: str = "abort", flush_cache: bool = True):
        """``pause``, ``flush_cache``: see :class:`~moerl.weight_sync.base.FullWeightSync`."""
        super().__init__(urls, "moerl-weight-sync", pause, flush_cache)
        self.master_address, self.master_port, self.backend = master_address, master_port, backend
        self.group_name, self.bucket_bytes = group_name, bucket_bytes
        self.group: dist.ProcessGroup | None = None

    def connect(self) -> None:
        """Form the group: the trainer is rank 0, and each engine takes as many ranks as its tensor-parallel size."""
        if self.link is None:
            return
        client = self.link.client
        offsets, world = group_ranks([info["tp_size"] for info in self.link.run(client.server_info())])
        store = weight_store(self.master_address, self.master_port, world, 0)
        self.master_port = store.port

        async def both():
            joined = in_daemon_thread(join_weight_group, self.backend, store, world, 0, self.group_name)
            group, _ = await asyncio.gather(joined, client.init_weights_update_group(
                self.master_address, self.master_port, world, self.group_name, self.backend, rank_offsets=offsets))
            return group

        self.group = self.link.run(both())

    def push(self, named: Iterable[tuple[str, torch.Tensor]], version: str) -> SyncStats:
        """Double-buffered: while one bucket is on the wire, the next is gathered and flattened (on the device, in the
        model dtype). The version, and the cache flush, follow the last bucket."""
        if self.group is None:
            raise RuntimeError("BroadcastSync.push before connect()")
        stats, start = SyncStats(), time.perf_counter()
        client = self.link.client
        self.link.run(client.begin_weight_update())
        on_wire = None
        try:
            for bucket in buckets(named, self.bucket_bytes):
                flat, names, dtypes, shapes = flatten_bucket(bucket)
                del bucket
                if self.backend == "nccl":
                    flat = flat.to(collective_device())  # here, on this rank's device: the loop's thread defaults to GPU 0
                stats.buckets, stats.tensors, stats.bytes = stats.buckets + 1, stats.tensors + len(names), stats.bytes + flat.numel()
                if on_wire is not None:
                    on_wire.result()
                on_wire = self.link.submit(self._send(flat, names, dtypes, shapes))
            if on_wire is not None:
                on_wire.result()
        except BaseException:
            if on_wire is not None:  # its bucket leaves the wire before the error goes up, and does not replace it
                concurrent.futures.wait([on_wire])
            raise
        self.link.run(client.end_weight_update())
        self.link.run(client.set_weight_version(version))
        if self.flush_cache:
            self.link.run(client.flush_cache())
        stats.seconds = time.perf_counter() - start
        return stats

    async def _send(self, flat: torch.Tensor, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        """One bucket: its bytes broadcast while the engines are told what they are."""
        await asyncio.gather(
            in_daemon_thread(dist.broadcast, flat, 0, self.group),
            self.link.client.update_weights_from_distributed(names, dtypes, shapes, self.group_name, load_format="flattened_bucket",
                                                             flush_cache=False),
        )
