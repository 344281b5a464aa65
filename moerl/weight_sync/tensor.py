"""Weight sync to engines on the trainer's own GPUs (``run.placement=colocated``): the engines' memory is released while
the trainer trains, and the new weights are handed over on the machine (``/update_weights_from_tensor``: CUDA IPC on a
GPU, shared memory on the CPU, :mod:`moerl.engines.tensor_ipc`), a bucket at a time from every GPU an engine runs on
(:class:`Handover`), so the push costs the engines' weights plus one bucket on each.

A colocated step, as the peers run it (waking weights and KV cache together runs out of memory): :meth:`sleep` pauses
the engines (``retract``: what waits holds no KV) and releases all their memory; the trainer reloads its state and
trains, then takes its training state (optimizer, gradients) off the device; :meth:`update` resumes the engines'
weights (uninitialised), pushes, takes the trainer's weights off too (:meth:`~moerl.trainer.trainer.Trainer.offload`),
resumes the engines' KV cache and CUDA graphs, and continues them. So the push holds the trainer's weights, the
engines' and a bucket. An update while the engines are awake (a catch-up between two instalments of a step, the first
push of a resumed run) pauses and resumes them as any full sync, the trainer's state brought back for the push and taken
off again."""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moerl.engines.client import EngineError
from moerl.engines.tensor_ipc import flattened_bucket, serialize, shareable_allocations
from moerl.errors import ConfigError, EnginesDown
from moerl.megatron.parallel import collective_device
from moerl.megatron.weights import Gather
from moerl.weight_sync.base import EngineCall, FullWeightSync, SyncStats, probe_ids
from moerl.weight_sync.broadcast import buckets, drained, whole_buckets
from moerl.weight_sync.export import hf_layers

log = logging.getLogger("moerl.sync")

_AFTER_WEIGHTS = ["kv_cache", "cuda_graph"]


class TensorSync(FullWeightSync):
    def __init__(
        self, urls: list[str] | None, bucket_bytes: int = 512 << 20, gpus_per_replica: int = 1, pause: str = "abort"
    ):
        """``urls``: the engines, on global rank 0 (None elsewhere), in the order of the GPUs they run on;
        ``gpus_per_replica``: each one's TP size; ``pause``: how an update of awake engines pauses them (see
        :class:`~moerl.weight_sync.base.FullWeightSync`)."""
        super().__init__(urls, "moerl-tensor-sync", pause, flush_cache=True)
        self.bucket_bytes, self.gpus_per_replica = bucket_bytes, gpus_per_replica
        self.handover: Handover | None = None  # every rank: made at the first push (collective)
        self.asleep = False  # rank 0: the engines' memory is released (sleep), until the next update wakes them
        self.released: set[str] = set()  # rank 0: the engines the sleep released, less those started again since
        self.sleep_seconds = 0.0  # rank 0: the last sleep's, and the last update's wake (resumes and continue)
        self.wake_seconds = 0.0
        self.probe: np.ndarray | None = None  # every rank: the trainer's log-probs of the probe at the last push
        self.offloaded_bytes = 0  # every rank: what the last push's offload took off its trainer rank's device

    def sleep(self) -> None:
        """Global rank 0, before the trainer's phase: the engines stop and give back their memory (KV cache, weights,
        CUDA graphs). An engine gone meanwhile is passed over: restarted, it holds its memory until the update. Where
        some engines fail to release, those that did are still asleep, and the update wakes them before it pushes; the
        failures are raised (each engine's in :attr:`EngineError.failures`)."""
        start, self.sleep_seconds = time.perf_counter(), 0.0
        self.paused = True  # from here to the update's resume, the engines are asked whether they answer, not /health
        self.on_engines(lambda client: client.pause("retract"))
        link = self.lead_link
        asked, failed = list(link.client.targets), set()
        self.asleep = True
        try:  # once on each: SGLang stashes the released weights' state again on a second release
            link.run(link.client.release_memory())
        except EngineError as e:
            failed = {failure.url for failure in e.failures}
            raise
        finally:
            self.released = set(asked) - failed
            self.sleep_seconds = time.perf_counter() - start

    def started_again(self, urls: list[str]) -> None:
        super().started_again(urls)
        self.released -= set(urls)

    def before_push(self) -> None:
        start = time.perf_counter()
        if self.asleep:  # an engine started again since holds its memory: it takes the push as it is
            # Once on each: SGLang's scheduler dies on a resume of a tag it holds.
            self.on_engines(lambda client: client.resume_memory(["weights"], among=self.released), EngineCall.ONCE)
        else:
            super().before_push()
        self.wake_seconds = time.perf_counter() - start

    def after_push(self) -> None:
        start = time.perf_counter()
        if self.asleep:
            self.on_engines(lambda client: client.resume_memory(_AFTER_WEIGHTS, among=self.released), EngineCall.ONCE)
            self.asleep, self.released = False, set()
        super().after_push()
        self.wake_seconds += time.perf_counter() - start

    def push_policy(self, trainer) -> SyncStats | None:
        """Collective: the push, from the trainer's weights on its device; then the trainer's whole state leaves the
        device before the engines take back their KV cache. The trainer's log-probs of the probe are taken first, for
        :meth:`verify`, which runs once the engines generate again."""
        # After a step only the training state is off (the job took it off before the engines' weights came back);
        # the first push of a resumed run, or a catch-up, finds it all off and brings its weights back for the push.
        with trainer.weights_on_device():
            stats, failed = None, None
            try:
                stats = super().push_policy(trainer)
            except Exception as e:  # noqa: BLE001 - rank 0's, agreed before the probe: it is collective
                failed = e
            self.agreed(error=failed)
            if trainer.communicators is not None and self.handover is not None:  # idle until the next push
                trainer.communicators.include(self.handover.group)
            if self.verifying:  # an FP8 engine's reference gathers the whole model: only where it is read
                self.probe = super().trainer_probe(trainer, probe_ids(trainer.hf_config["vocab_size"]))
        self.offloaded_bytes = trainer.offload()
        return stats

    def trainer_probe(self, trainer, ids: list[int]) -> np.ndarray:
        if self.probe is None:  # no push yet (the engines started from the trainer's checkpoint), or not verifying
            with trainer.weights_on_device():
                self.probe = super().trainer_probe(trainer, ids)
        return self.probe

    def push_model(self, model, hf_config: dict, version: str) -> SyncStats | None:
        """Collective: each weight layer gathered whole on rank 0 (:class:`~moerl.megatron.weights.Gather`), in buckets
        handed over to the engines from every GPU they run on (:class:`Handover`), then ``version`` served. An engine
        gone meanwhile is passed over. With every one of them gone the update reaches none: the job starts them again,
        each holding its memory and the checkpoint it started from, stale until a catch-up brings it the policy. Nothing
        waits for one to come back, which would be told the version without the buckets before it. Any other failure
        is rank 0's, raised there once every gather is done (see :meth:`push_policy`)."""
        if self.gather is None:
            self.gather = Gather(model)
        if self.handover is None:
            self.handover = Handover.between(
                len(self.lead_link.client.urls) * self.gpus_per_replica if self.link is not None else None
            )
        handover, lead = self.handover, self.link is not None
        stats, start = SyncStats(), time.perf_counter()
        failure: Exception | None = None
        if lead:  # SGLang takes tensors only within a weight-update session
            try:
                self.on_engines(lambda client: client.begin_weight_update(), EngineCall.ONCE_ON_CHOSEN)
            except Exception as e:  # noqa: BLE001 - rank 0's, raised once every gather is done
                failure = e
        pending: deque[tuple[str, torch.Tensor]] = deque()  # rank 0: tensors not yet handed over
        layers = hf_layers(self.gather, hf_config, self.quantization)  # every rank iterates: the gathers are collective
        for layer in itertools.chain(layers, [None]):
            if layer is not None and failure is None:
                pending += layer  # a layer is empty but on rank 0
            # whole buckets; the last, unfilled, waits for the next layer unless the layers are over
            count = len(pending) if layer is None else whole_buckets(pending, self.bucket_bytes)
            del layer
            for bucket in handover.buckets(list(buckets(drained(pending, count), self.bucket_bytes))):
                error = handover.hand_over(bucket, self.post, self.chosen_gpus() if lead and failure is None else [])
                if error is not None:  # rank 0's post: raised below, once every gather is done
                    failure = error
                    pending.clear()
                elif bucket is not None and failure is None:
                    stats.add(bucket)
        if not lead:
            return None
        if failure is None:
            try:
                self.on_engines(lambda client: client.end_weight_update(), EngineCall.ONCE_ON_CHOSEN)
                self.on_engines(lambda client: client.set_weight_version(version), EngineCall.REPEATED_ON_CHOSEN)
            except EnginesDown as e:
                failure = e
        else:  # a session left open would refuse the next push's
            self.lead_link.run(self.lead_link.client.end_sessions(self.lead_link.client.targets))
        if isinstance(failure, EnginesDown):
            log.warning("colocated push of version %s reached no engine: %s", version, failure)
        elif failure is not None:
            raise failure
        stats.seconds = time.perf_counter() - start
        return stats

    def chosen_gpus(self) -> list[int]:
        """Rank 0: the GPUs the engines this update goes to run on (see :class:`Handover`)."""
        client, width = self.lead_link.client, self.gpus_per_replica
        return [client.urls.index(url) * width + t for url in client.targets for t in range(width)]

    def post(self, handles: list[str | None]) -> None:
        """Rank 0: one bucket to every chosen engine, each TP rank the handle made on its GPU (``handles``, by GPU); it
        answers once it has copied the bucket into its weights. Made once on each: CUDA IPC counts a handle's references
        per pickle, so none is read twice."""
        urls, width = self.lead_link.client.urls, self.gpus_per_replica

        def theirs(url: str) -> list[str]:
            first = urls.index(url) * width
            mine = [handle for handle in handles[first : first + width] if handle is not None]
            assert len(mine) == width, f"{url}: a chosen engine's GPU made no handle"
            return mine

        self.on_engines(
            lambda client: client.update_weights_from_tensor(theirs, "flattened_bucket", flush_cache=self.flush_cache),
            EngineCall.ONCE_ON_CHOSEN,
        )


@dataclass
class Handover:
    """The trainer ranks whose GPUs the engines run on, which hand each bucket over. Engine replica ``k``'s TP rank
    ``t`` runs on GPU ``k * T + t`` of global rank 0's node (the job starts each on its GPUs only, CUDA_VISIBLE_DEVICES
    naming them), the GPU of the trainer rank of that local rank. CUDA IPC maps memory of a GPU the engine sees, so
    each of those ranks takes a copy of the bucket (broadcast from rank 0) and makes the handle to its own; on the CPU
    the same ranks hand over shared memory. ``ranks``: the rank on each of those GPUs, in order. Two groups join them
    and global rank 0, which talks to the engines (None on the other ranks): ``group`` carries the bytes (NCCL on a
    GPU), ``control`` the rest (gloo), so that no rank's kernel spins on an engine's GPU while rank 0 posts."""

    ranks: list[int]
    group: dist.ProcessGroup | None = None
    control: dist.ProcessGroup | None = None

    @property
    def members(self) -> list[int]:
        """The groups' ranks in their own order (torch's: ascending)."""
        return sorted({0, *self.ranks})

    @classmethod
    def between(cls, gpus: int | None) -> Handover:
        """Collective over the world: ``gpus``, rank 0's (None elsewhere), the engines' GPUs on its node. Raises
        :class:`ConfigError` on every rank where a GPU has no trainer rank."""
        here = (socket.gethostname(), int(os.environ.get("LOCAL_RANK", dist.get_rank())))
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (here, gpus))  # once: a host name and two numbers a rank
        (host, _), gpus = everyone[0]
        local = {place[1]: rank for rank, (place, _) in enumerate(everyone) if place[0] == host}
        missing = [gpu for gpu in range(gpus) if gpu not in local]
        if missing:
            raise ConfigError(
                f"run.placement=colocated: the engines run on {gpus} GPUs of global rank 0's node, and no trainer rank "
                f"runs on GPU(s) {missing} there; give the trainer that node's GPUs (run.trainer_ranks), or fewer "
                "engines.replicas x engines.gpus_per_replica"
            )
        handover = cls([local[gpu] for gpu in range(gpus)])
        group, control = dist.new_group(handover.members), dist.new_group(handover.members, backend="gloo")
        if dist.get_rank() in handover.members:  # every rank makes the groups, members or not
            handover.group, handover.control = group, control
        return handover

    def buckets(self, ready: list) -> list:
        """Collective over the members: ``ready`` on rank 0; on the other members as many Nones; nothing elsewhere."""
        if self.control is None:
            return []
        count = torch.tensor([len(ready)], dtype=torch.int64)
        dist.broadcast(count, src=0, group=self.control)
        return ready if ready else [None] * int(count.item())

    def hand_over(self, bucket: list[tuple[str, torch.Tensor]] | None, post, gpus: list[int]) -> Exception | None:
        """Collective over the members: ``bucket`` (rank 0's; None on the others) flattened on every member's device in
        memory IPC can share, handles to the copies on ``gpus`` (rank 0's: those of the engines it goes to) gathered on
        rank 0, and ``post(handles by GPU)`` there while every copy is held. No other handle is made: torch parks an
        IPC-shared block no engine releases for the life of the process. What rank 0's post raised, returned there."""
        payload = flattened_bucket(bucket) if bucket is not None else None
        told: list = [(payload["metadata"], gpus) if payload is not None else None]
        dist.broadcast_object_list(told, src=0, group=self.control)  # names, shapes, dtypes, spans; where it goes
        metadata, gpus = told[0]
        if payload is None:
            with shareable_allocations(collective_device()):
                flat = torch.empty(metadata[-1].end_idx, dtype=torch.uint8, device=collective_device())
            payload = {"flattened_tensor": flat, "metadata": metadata}
        dist.broadcast(payload["flattened_tensor"], src=0, group=self.group)
        rank, members = dist.get_rank(), self.members
        posted = rank in self.ranks and self.ranks.index(rank) in gpus
        held: list | None = [None] * len(members) if bucket is not None else None
        dist.gather_object(serialize(payload) if posted else None, held, dst=0, group=self.control)
        failure = None
        if held is not None and gpus:
            try:
                post([held[members.index(r)] for r in self.ranks])
            except Exception as e:  # noqa: BLE001 - rank 0's, raised once every gather is done
                failure = e
        dist.barrier(group=self.control)  # every copy is held until the engines have read theirs
        return failure
