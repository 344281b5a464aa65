"""Weight sync to engines on the trainer's own GPUs (``run.placement=colocated``): the engines' memory is released while
the trainer trains, and the new weights are handed over on the machine (``/update_weights_from_tensor``: CUDA IPC on a
GPU, shared memory on the CPU, :mod:`moerl.engines.tensor_ipc`), a bucket at a time, so the push costs the engines'
weights plus one bucket.

A colocated step, as the peers run it (waking weights and KV cache together runs out of memory): :meth:`sleep` pauses
the engines (``retract``: what waits holds no KV) and releases all their memory; the trainer reloads its state and
trains, then takes its training state (optimizer, gradients) off the device; :meth:`update` resumes the engines'
weights (uninitialised), pushes, takes the trainer's weights off too (:meth:`~moerl.trainer.trainer.Trainer.offload`),
resumes the engines' KV cache and CUDA graphs, and continues them. So the push holds the trainer's weights, the
engines' and a bucket. An update while the engines are awake (a catch-up between two pieces of a step, the first push
of a resumed run) pauses and resumes them as any full sync, the trainer's state brought back for the push and taken
off again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable

import numpy as np
import torch

from moerl.engines.tensor_ipc import flattened_bucket, serialize
from moerl.errors import EnginesDown
from moerl.weight_sync.base import EngineCall, FullWeightSync, SyncStats, probe_ids, probe_logprobs
from moerl.weight_sync.broadcast import buckets

log = logging.getLogger("moerl.sync")

_AFTER_WEIGHTS = ["kv_cache", "cuda_graph"]


class TensorSync(FullWeightSync):
    def __init__(self, urls: list[str] | None, bucket_bytes: int = 512 << 20, pause: str = "abort"):
        """``urls``: the engines, on global rank 0 (None elsewhere); ``pause``: how an update of awake engines pauses
        them (see :class:`~moerl.weight_sync.base.FullWeightSync`)."""
        super().__init__(urls, "moerl-tensor-sync", pause, flush_cache=True)
        self.bucket_bytes = bucket_bytes
        self.asleep = False  # rank 0: the engines' memory is released (sleep), until the next update wakes them
        self.released: set[str] = set()  # rank 0: the engines the sleep released, less those started again since
        self.sleep_seconds = 0.0  # rank 0: the last sleep's, and the last update's wake (resumes and continue)
        self.wake_seconds = 0.0
        self.probe: np.ndarray | None = None  # every rank: the trainer's log-probs of the probe at the last push
        self.offloaded_bytes = 0  # every rank: what the last push's offload took off its trainer rank's device

    def sleep(self) -> None:
        """Global rank 0, before the trainer's phase: the engines stop and give back their memory (KV cache, weights,
        CUDA graphs). An engine gone meanwhile is passed over: restarted, it holds its memory until the update."""
        start, self.sleep_seconds = time.perf_counter(), 0.0
        self.paused = True  # from here to the update's resume, the engines are asked whether they answer, not /health
        self.on_engines(lambda client: client.pause("retract"))
        self.on_engines(lambda client: client.release_memory())
        self.released = set(self.lead_link.client.targets)
        self.asleep = True
        self.sleep_seconds = time.perf_counter() - start

    def started_again(self, urls: list[str]) -> None:
        super().started_again(urls)
        self.released -= set(urls)

    def before_push(self) -> None:
        start = time.perf_counter()
        if self.asleep:  # an engine started again since holds its memory: it takes the push as it is
            self.on_engines(lambda client: client.resume_memory(["weights"], among=self.released))
        else:
            super().before_push()
        self.wake_seconds = time.perf_counter() - start

    def after_push(self) -> None:
        start = time.perf_counter()
        if self.asleep:
            self.on_engines(lambda client: client.resume_memory(_AFTER_WEIGHTS, among=self.released))
            self.asleep, self.released = False, set()
        super().after_push()
        self.wake_seconds += time.perf_counter() - start

    def push_policy(self, trainer) -> SyncStats | None:
        """Collective: the push, from the trainer's weights on its device; then the trainer's whole state leaves the
        device before the engines take back their KV cache. The trainer's log-probs of the probe are taken first, for
        :meth:`verify`, which runs once the engines generate again."""
        # After a step only the training state is off (the job took it off before the engines' weights came back);
        # the first push of a resumed run, or a catch-up, finds it all off and brings it back for the push.
        with trainer.on_device() if trainer.weights_offloaded else contextlib.nullcontext():
            stats, failed = None, None
            try:
                stats = super().push_policy(trainer)
            except Exception as e:  # noqa: BLE001 - rank 0's, agreed before the probe: it is collective
                failed = e
            self.agreed(error=failed)
            self.probe = probe_logprobs(trainer.model.module, probe_ids(trainer.hf_config["vocab_size"]))
        self.offloaded_bytes = trainer.offload()
        return stats

    def trainer_probe(self, trainer, ids: list[int]) -> np.ndarray:
        if self.probe is None:  # no push yet: the engines started from the trainer's checkpoint
            with trainer.on_device():
                self.probe = probe_logprobs(trainer.model.module, ids)
        return self.probe

    def push(self, named: Iterable[tuple[str, torch.Tensor]], version: str) -> SyncStats:
        """Rank 0: the buckets, then ``version``, to the engines the update chose; one gone meanwhile is passed over.
        With every one of them gone the update reaches none: the job starts them again, each holding its memory and
        the checkpoint it started from, stale until a catch-up brings it the policy. Nothing waits for one to come
        back, which would be told the version without the buckets before it."""
        stats, start = SyncStats(), time.perf_counter()
        failure: Exception | None = None
        tp_sizes: dict[str, int] = {}
        for bucket in buckets(named, self.bucket_bytes):
            # Every rank gathers each layer: after a failure rank 0 still takes the rest, or the others would wait in
            # a gather for good; the failure is raised once they are done.
            if failure is not None:
                continue
            try:
                if not tp_sizes:
                    infos = self.on_engines(lambda client: client.server_info(), EngineCall.REPEATED_ON_CHOSEN)
                    tp_sizes = {url: int(info.get("tp_size", 1)) for url, info in zip(self.engines, infos, strict=True)}
                self.push_bucket(bucket, tp_sizes)
            except Exception as e:  # noqa: BLE001 - raised below, once every gather is done
                failure = e
                continue
            stats.buckets += 1
            stats.tensors += len(bucket)
            stats.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        if failure is None:
            try:
                self.on_engines(lambda client: client.set_weight_version(version), EngineCall.REPEATED_ON_CHOSEN)
            except EnginesDown as e:
                failure = e
        if isinstance(failure, EnginesDown):
            log.warning("colocated push of version %s reached no engine: %s", version, failure)
        elif failure is not None:
            raise failure
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
            ),
            EngineCall.REPEATED_ON_CHOSEN,
        )
