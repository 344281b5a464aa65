"""Weight sync by broadcast from several senders, in turns: each pipeline stage's dense tensors are sent by
the senders of its first TP group (spread by bytes), and under expert parallelism each expert-parallel
rank sends its own experts (:func:`~moerl.megatron.weights.sends_weights`), each over a process group of
its own with every engine (NCCL on GPU, gloo on CPU; SGLang keeps one per ``group_name``). So experts
are never gathered across expert-parallel ranks, and no rank holds weights it does not send. The
Hub-named tensors go out in ``flattened_bucket`` buckets, each announced to the engines over HTTP while
its bytes are broadcast, so an engine never holds more than one bucket extra.

The senders take turns because an engine takes one update at a time, in the order the requests reach it:
all engines must take the senders' buckets in one order, or two of them each wait in a broadcast the other
has not reached (one engine takes them in one order whatever it is, so to one engine they send at once).
Every rank gathers the model a layer at a time; once some sender holds a bucket's worth, each sender with
anything to send sends its whole buckets, in rank order, while the others wait (an unfilled last bucket
waits for more, until the end). A sender that fails ends every sender's turns. A sender holds at most a
bucket and a layer's share unsent, and two buckets flattened (the one on the wire and the next). Global
rank 0 alone steers the engines: it opens the weight-update session (``/begin_weight_update`` ...
``/end_weight_update``, which SGLang 0.5.23 requires around distributed updates) before any stage sends,
and closes it, sets the version and flushes once every stage is done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from moerl.engines.protocol import SGLANG_TORCH
from moerl.engines.weight_group import (
    MAX_GROUPS_PER_ENGINE,
    abandon_weight_group,
    flatten_bucket,
    in_daemon_thread,
    join_weight_group,
    weight_store,
)
from moerl.errors import ConfigError, EnginesDown, relayed
from moerl.megatron.parallel import collective_device, lead_agrees
from moerl.megatron.weights import Gather, sends_weights
from moerl.weight_sync.base import EngineCall, EngineLink, FullWeightSync, SyncStats, WeightSyncError
from moerl.weight_sync.export import hf_layers

log = logging.getLogger("moerl.sync")


def group_ranks(tp_sizes: list[int]) -> tuple[list[int], int]:
    """``(rank offset of each engine, world size)`` of a weight group of the trainer (rank 0) and engines of
    these tensor-parallel sizes: SGLang joins replica ``i``'s ranks at ``rank_offset + tp_rank``."""
    offsets, next_rank = [], 1
    for size in tp_sizes:
        offsets.append(next_rank)
        next_rank += size
    return offsets, next_rank


T = TypeVar("T")


def _pair_bytes(pair: tuple[str, torch.Tensor]) -> int:
    return pair[1].nbytes


def buckets(items: Iterable[T], bucket_bytes: int, nbytes: Callable[[Any], int] = _pair_bytes) -> Iterator[list[T]]:
    """Consecutive groups of ``items`` (by default ``(name, tensor)`` pairs; ``nbytes``: an item's size) of at most
    ``bucket_bytes`` (a larger item goes alone)."""
    bucket: list[T] = []
    size = 0
    for item in items:
        if bucket and size + nbytes(item) > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += nbytes(item)
    if bucket:
        yield bucket


class BroadcastSync(FullWeightSync):
    """The trainer side of broadcast weight sync; every trainer rank makes one (``urls``: the engines, on global
    rank 0; None elsewhere) and calls each method, all collective."""

    def __init__(
        self,
        urls: list[str] | None,
        master_address: str,
        backend: str,
        master_port: int = 0,
        group_name: str = "moerl-weight-sync",
        bucket_bytes: int = 512 << 20,
        pause: str = "abort",
        flush_cache: bool = True,
    ):
        """``master_address``: where the engines reach this rank (it hosts its stage's group if it sends one);
        ``master_port``: 0 binds a free one, else global rank ``r`` binds ``master_port + r``; ``pause``,
        ``flush_cache``: see :class:`~moerl.weight_sync.base.FullWeightSync`."""
        super().__init__(urls, "moerl-weight-sync", pause, flush_cache)
        self.master_address, self.master_port, self.backend = master_address, master_port, backend
        # A name of this run's own: an engine keeps its groups for good and refuses a name it has (SGLang: "The
        # specified group name has already been created"), so a run resumed against long-lived engines could not join
        # under the last one's.
        self.base_name, self.bucket_bytes = f"{group_name}-{secrets.token_hex(3)}", bucket_bytes
        self.sender: EngineLink | None = None  # this rank's link to the engines if it sends (rank 0's: ``link``)
        self.group: dist.ProcessGroup | None = None  # its group with the engines
        self.group_name = group_name  # that group's name, as the engines know it
        self.members: list[str] = []  # the engines in it
        self.engine_count = 0  # every rank: how many engines the push goes to
        self.tp_sizes: dict[str, int] = {}  # each engine's tensor-parallel size: its ranks in a group
        self.sent = SyncStats()  # what this rank itself sent in the last push (all zero on a rank that sends nothing)
        self.bucket_lost = False  # every rank: the last push attempt failed with a bucket announced to the engines
        self.groups_held: dict[str, int] = {}  # global rank 0: groups of this run each engine process holds, per sender
        self._announced_lost = False  # this rank: a bucket it announced did not arrive whole
        self._rank, self._groups = 0, 0

    def connect(self) -> None:
        """Each sender forms a group of its own with the engines: it is rank 0 there, and each engine takes as many
        ranks as its tensor-parallel size. A process outside any trainer group (a tool, a benchmark) is the one
        sender."""
        in_trainer = dist.is_initialized()
        sends, self._rank = (sends_weights(), dist.get_rank()) if in_trainer else (True, 0)
        # Rank 0's (engine URLs, their tensor-parallel sizes, what to align of torch for NCCL), sent to every rank.
        engines: list[tuple[list[str], list[int], str | None] | None] = [None]
        if self.link is not None:
            urls, infos = self.link.client.urls, self.link.run(self.link.client.server_info())
            engines = [
                (
                    urls,
                    [info["tp_size"] for info in infos],
                    torch_mismatch(urls, infos) if self.backend == "nccl" else None,
                )
            ]
        if in_trainer and dist.get_world_size() > 1:
            dist.broadcast_object_list(engines, src=0)  # once per run: a few URLs and sizes
        assert engines[0] is not None, "global rank 0 is given the engines' URLs"
        urls, tp_sizes, mismatch = engines[0]
        if mismatch is not None:
            raise (
                ConfigError(mismatch)
                if self.link is not None
                else relayed(
                    ConfigError(
                        "the engines run another torch, and NCCL, than the trainer (global rank 0's error says what "
                        "to align)"
                    )
                )
            )
        if not sends:
            return
        self.tp_sizes = dict(zip(urls, tp_sizes, strict=True))  # server_info answers for every engine
        self.sender = self.link or EngineLink(urls, f"moerl-weight-sync-{self._rank}")
        self._form_group(urls)

    def _form_group(self, members: list[str]) -> None:
        """This sender's group with the engines ``members`` (a new one, under a new name, each time they change: an
        engine that died leaves its groups unusable, one that restarted has none). The group it replaces is aborted on
        this side: an abort is local, and frees that communicator's device buffers (the engines keep theirs)."""
        if self.group is not None:
            abandon_weight_group(self.group)
            self.group = None
        sender = self.sender
        assert sender is not None, "only a rank that sends forms a group"
        client = sender.client
        client.targets = members
        name = f"{self.base_name}-{self._rank}" + (f"-g{self._groups}" if self._groups else "")
        offsets, world = group_ranks([self.tp_sizes[url] for url in members])
        port = self.master_port + self._rank if self.master_port and not self._groups else 0
        store = weight_store(self.master_address, port, world, 0)

        async def both():
            joined = in_daemon_thread(join_weight_group, self.backend, store, world, 0, name)
            group, _ = await asyncio.gather(
                joined,
                client.init_weights_update_group(
                    self.master_address, store.port, world, name, self.backend, rank_offsets=offsets
                ),
            )
            return group

        self.group = sender.run(both())
        self.group_name, self.members, self._groups = name, members, self._groups + 1

    def push_model(self, model, hf_config: dict, version: str) -> SyncStats | None:
        """Every sender sends its share at once, inside one session that rank 0 opens and closes, to the engines
        rank 0 chose (:meth:`choose_engines`): the senders' groups are formed again when those change. A push that
        fails (an engine left during it, or came back restarted, without its groups) is made once more, in new groups,
        to the engines that answer then, less those a failed bucket may have left waiting in its broadcast
        (:meth:`~moerl.weight_sync.base.WeightSync.set_wedged`). Every rank raises together."""
        if self.gather is None:
            self.gather = Gather(model, per_sender=True)
        try:
            return self._push_and_once_more(hf_config, version)
        finally:
            self.wedged = set()  # the next update asks /health of them (a real forward on SGLang) before it chooses

    def _push_and_once_more(self, hf_config: dict, version: str) -> SyncStats | None:
        gave_up: Exception | None = None
        for attempt in range(2):
            try:
                self._regroup(gave_up)
                return self._push_once(hf_config, version)
            except Exception as e:  # noqa: BLE001 - every rank is here together: each step above ends agreed
                if attempt:
                    raise
                if self.link is not None:
                    if self.bucket_lost:
                        self.set_wedged(self.link.client.targets)
                    self.link.run(self.link.client.abandon_weight_update())
                    log.warning(
                        "weight sync failed (%s); pushing once more, in new groups, to the engines that answer", e
                    )
                    try:
                        self.choose_engines()
                    except Exception as err:  # noqa: BLE001 - told to every rank by the next _regroup
                        gave_up = err
                self.members = []  # every sender forms its group again
        return None

    def _regroup(self, gave_up: BaseException | None) -> None:
        """Collective: every rank learns the engines rank 0 chose (rank 0 may have none to offer: ``gave_up``), and
        each sender whose group does not hold exactly those forms a new one; every sender does where one of those may be
        a new process at its address (:attr:`may_be_new`), outside every group."""
        # (the engines, whether one of them is back), or None where rank 0 has none to offer
        chosen: list[tuple[list[str], bool] | None] = [None]
        if self.link is not None:
            new, self.may_be_new = self.may_be_new, set()
            if gave_up is None:
                try:
                    chosen = [self._members(new)]
                except EnginesDown as e:
                    gave_up = e
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(chosen, src=0)  # a few URLs
        if chosen[0] is None:
            if gave_up is not None:
                raise gave_up
            raise relayed(EnginesDown("no engine to push to (global rank 0's error says why)"))
        members, back = chosen[0]
        self.engine_count = len(members)
        formed: Exception | None = None
        if self.sender is not None and (members != self.members or back):
            try:
                self._form_group(members)
            except Exception as e:  # noqa: BLE001 - every rank hears of it below (_agree), then it goes up here
                formed = e
        _agree(
            formed is None, "a sender could not form its group with the engines (that rank's error says why)", formed
        )

    def _members(self, new: set[str]) -> tuple[list[str], bool]:
        """Global rank 0: the engines this push goes to, and whether one of them may be a new process (``new``), outside
        every group. Where the senders form their groups again, an engine that holds :data:`MAX_GROUPS_PER_ENGINE` of
        them already is left out (its communicators are what the memory plan allows): restarted where the job started it
        (:attr:`~moerl.weight_sync.base.WeightSync.restart_engines`), else for the rest of the run."""
        client = self.lead_link.client
        back = new & set(client.targets)
        for url in back:
            self.groups_held[url] = 0
        if client.targets == self.members and not back:
            return client.targets, False
        full = [url for url in client.targets if self.groups_held.get(url, 0) >= MAX_GROUPS_PER_ENGINE]
        if full:
            restarted = set(self.restart_engines(full)) if self.restart_engines is not None else set()
            self.may_be_new |= restarted
            self.retired |= set(full) - restarted
            client.targets = [url for url in client.targets if url not in full]
            log.warning(
                "weight sync: %s hold %d weight groups of this run each (NCCL communicators outside "
                "mem_fraction_static): %s",
                ", ".join(full),
                MAX_GROUPS_PER_ENGINE,
                "; ".join(
                    part
                    for part in (
                        f"restarting {', '.join(sorted(restarted))}" if restarted else "",
                        f"leaving out {', '.join(sorted(set(full) - restarted))} for the rest of the run (restart "
                        "engines given by URL between runs)"
                        if set(full) - restarted
                        else "",
                    )
                    if part
                ),
            )
            if not client.targets:
                raise EnginesDown(
                    f"every engine this push chose holds {MAX_GROUPS_PER_ENGINE} weight groups of this run: "
                    "restart them, then resume the run (run.resume=true)"
                )
        for url in client.targets:
            self.groups_held[url] = self.groups_held.get(url, 0) + 1
        return client.targets, bool(back)

    def _push_once(self, hf_config: dict, version: str) -> SyncStats | None:
        start = time.perf_counter()
        assert self.gather is not None, "push_model makes the gather"
        opened: Exception | None = None
        if self.link is not None:
            try:
                self.link.run(self.link.client.begin_weight_update())
            except Exception as e:  # noqa: BLE001 - every rank hears of it below, then it goes up here
                opened = e
        _agree(
            opened is None,
            "the weight-update session did not open on the engines (global rank 0's error says why)",
            opened,
        )
        self.sent, stopped = SyncStats(), False  # stopped: a sender failed, so no sender sends more
        failed: Exception | None = None
        self.bucket_lost = self._announced_lost = False
        pending: deque[tuple[str, torch.Tensor]] = deque()  # this sender's tensors not yet sent
        layers = hf_layers(self.gather, hf_config, self.quantization)  # every rank iterates: the gathers are collective
        for layer in itertools.chain(layers, [None]):
            last = layer is None
            if layer is not None and not stopped and self.sender is not None:
                pending += layer
            del layer
            if stopped:
                continue
            held = torch.tensor([_nbytes(pending)], dtype=torch.int64, device=collective_device())
            everyone = torch.empty(dist.get_world_size(), dtype=torch.int64, device=collective_device())
            dist.all_gather_into_tensor(everyone, held)
            if everyone.max().item() < self.bucket_bytes and not last:
                continue
            # A turn each, in rank order (the module's docstring says why); one engine takes the senders' buckets in one
            # order whatever it is, so then they send at once.
            holders = everyone.nonzero().flatten().tolist()
            for turn in [holders] if self.engine_count == 1 else [[rank] for rank in holders]:
                if dist.get_rank() in turn:
                    try:  # whole buckets; the last, unfilled, waits for the next turn unless this is the end
                        self._send_buckets(
                            drained(pending, len(pending) if last else whole_buckets(pending, self.bucket_bytes)),
                            self.sent,
                        )
                    except Exception as e:  # noqa: BLE001 - every rank hears of it after this turn
                        failed = e
                # After one sender's failure no sender may send: an engine that took its announcement waits in its
                # broadcast for good, so every later sender's would wait behind it, each to its deadline. 2: a bucket
                # was announced, and the engines may wait in it (see set_wedged).
                lost = 0 if failed is None else 2 if self._announced_lost else 1
                flag = torch.tensor([lost], dtype=torch.int32, device=collective_device())
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item():
                    stopped, self.bucket_lost = True, flag.item() == 2
                    pending.clear()
                    break
        totals = torch.tensor(
            [self.sent.tensors, self.sent.bytes, self.sent.buckets], dtype=torch.int64, device=collective_device()
        )
        dist.reduce(totals, 0)
        _agree(failed is None, "a sender's weights did not reach the engines (that rank's error says why)", failed)
        closed: Exception | None = None
        if self.link is not None:
            try:
                self._close_session(version)
            except Exception as e:  # noqa: BLE001 - told to every rank (lead_agrees), then raised
                closed = e
        # every engine gone: EnginesDown on every rank
        lead_agrees(closed, "closing the weight-update session on the engines")
        if self.link is None:
            return None
        tensors, nbytes, count = totals.tolist()
        return SyncStats(tensors=tensors, bytes=nbytes, buckets=count, seconds=time.perf_counter() - start)

    def push(self, named: Iterable[tuple[str, torch.Tensor]], version: str) -> SyncStats:
        """The one sender: the whole update, session included."""
        stats, start = SyncStats(), time.perf_counter()
        self.lead_link.run(self.lead_link.client.begin_weight_update())
        self._send_buckets(named, stats)
        self._close_session(version)
        stats.seconds = time.perf_counter() - start
        return stats

    def _close_session(self, version: str) -> None:
        """The session ends, and ``version`` is served, on the engines that took the buckets. One gone since is passed
        over, as a verify passes it over (it takes the policy when it is back): else the whole policy would be pushed
        again to the others, and a second such loss would stop the run without its checkpoint. With all of them gone
        the push fails at once (not waiting for one: a replica started again at a chosen address meanwhile would be
        told the version without the weights). The end is not asked twice of an engine (it would refuse: no session
        open); the version and the flush may be."""
        self.on_engines(lambda client: client.end_weight_update(), EngineCall.ONCE_ON_CHOSEN)
        self.on_engines(lambda client: client.set_weight_version(version), EngineCall.REPEATED_ON_CHOSEN)
        if self.flush_cache:
            self.on_engines(lambda client: client.flush_cache(), EngineCall.REPEATED_ON_CHOSEN)

    def _send_buckets(self, named: Iterable[tuple[str, torch.Tensor]], stats: SyncStats) -> None:
        """Double-buffered: while one bucket is on the wire, the next is flattened (on the device, in the model
        dtype)."""
        sender = self.sender
        if self.group is None or sender is None:
            raise RuntimeError("BroadcastSync: a push before connect()")
        # Two buffers in turn, made when a bucket of several tensors first needs one: the one filled is never the one on
        # the wire (that bucket was waited for before this one's turn). A bucket of one tensor is sent as it is.
        on_wire: concurrent.futures.Future | None = None
        spares: list[torch.Tensor | None] = [None, None]
        try:
            for turn, bucket in enumerate(buckets(named, self.bucket_bytes)):
                if len(bucket) > 1 and spares[turn % 2] is None:
                    spares[turn % 2] = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=bucket[0][1].device)
                flat, names, dtypes, shapes = flatten_bucket(bucket, into=spares[turn % 2])
                del bucket
                if self.backend == "nccl":
                    flat = flat.to(
                        collective_device()
                    )  # here, on this rank's device: the loop's thread defaults to GPU 0
                stats.buckets, stats.tensors, stats.bytes = (
                    stats.buckets + 1,
                    stats.tensors + len(names),
                    stats.bytes + flat.numel(),
                )
                if on_wire is not None:
                    on_wire.result()
                on_wire = sender.submit(self._send(flat, names, dtypes, shapes))
            if on_wire is not None:
                on_wire.result()
        except BaseException:
            if on_wire is not None:  # its bucket leaves the wire before the error goes up, and does not replace it
                concurrent.futures.wait([on_wire])
            raise

    async def _send(self, flat: torch.Tensor, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        """One bucket: its bytes broadcast while the engines are told what they are. The broadcast is waited for only
        once the engines have taken it: under NCCL a wait makes this device's stream wait, and one for a broadcast no
        engine joins (an engine that refused the announcement) would hold every later kernel and collective of this
        rank, the turns' all-reduce too, until the watchdog ends the process. So a refused bucket's group is aborted
        instead (ending a broadcast already on the device) and dropped; the push made again forms new ones."""
        # Both set: a bucket is sent only after the one before it arrived (_send_buckets), so no failure dropped them.
        group, sender = self.group, self.sender
        assert group is not None and sender is not None, "a bucket sent outside _send_buckets"
        broadcast = _Broadcast(group)
        try:
            # The first broadcast on a group sets up NCCL's communicator, which blocks until the engines join: in a
            # thread.
            work, _ = await asyncio.gather(
                in_daemon_thread(broadcast.enqueue, flat),
                sender.client.update_weights_from_distributed(
                    names, dtypes, shapes, self.group_name, load_format="flattened_bucket", flush_cache=False
                ),
            )
        except BaseException:
            broadcast.refused()
            self.group, self.members, self._announced_lost = None, [], True
            raise
        try:
            await in_daemon_thread(work.wait)
        except BaseException:
            self._announced_lost = True
            raise

    def close(self) -> None:
        if self.group is not None:  # left by an abort, not a destroy: the engines take no part in this side's exit
            abandon_weight_group(self.group)
            self.group = None
        if self.sender is not None and self.sender is not self.link:
            self.sender.close()
        super().close()


class _Broadcast:
    """One bucket's broadcast, enqueued in a thread while the engines answer: its group is aborted if it was refused and
    something is, or comes to be, on the device. The refusal may come back before the enqueue does, so that the thread
    alone knows; a broadcast still setting up the communicator when refused may never come to be enqueued."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.lock, self.queued, self.refusal = group, threading.Lock(), False, False

    def enqueue(self, flat: torch.Tensor):
        work = dist.broadcast(flat, 0, self.group, async_op=True)
        with self.lock:
            self.queued = True
            if self.refusal:
                abandon_weight_group(self.group)
        return work

    def refused(self) -> None:
        with self.lock:
            self.refusal = True
            if self.queued:
                abandon_weight_group(self.group)


def torch_mismatch(urls: list[str], infos: list[dict], ours: str | None = None) -> str | None:
    """What to align where an engine joins a NCCL weight group with another torch release than this process's (None:
    none does): each torch bundles its own NCCL, and two NCCL releases in one communicator fail or hang. An SGLang
    engine runs the torch its release pins (:data:`~moerl.engines.protocol.SGLANG_TORCH`); moerl's report theirs."""
    ours = _release(ours or torch.__version__)
    differ: list[tuple[str, str, str]] = []  # (engine, its torch, why it has that one)
    for url, info in zip(urls, infos, strict=True):
        reported = info.get("torch_version")
        theirs = reported or SGLANG_TORCH.get(str(info.get("version")))
        if theirs is not None and _release(theirs) != ours:
            differ.append((url, _release(theirs), "" if reported else f", which SGLang {info.get('version')} pins"))
    if not differ:
        return None
    engines = "; ".join(f"{url} runs torch {theirs}{why}" for url, theirs, why in differ)
    return (
        f"a NCCL weight group needs one NCCL release on both sides, and torch bundles its own: {engines}, this "
        f"trainer torch {ours}: install torch=={differ[0][1]} for the trainer, or set sync.method=disk"
    )


def _release(version: str) -> str:
    return version.split("+")[0]


def _nbytes(named: Iterable[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def whole_buckets(pending: deque, bucket_bytes: int) -> int:
    """How many of ``pending``'s first tensors make whole buckets (:func:`buckets`): all but an unfilled last one."""
    groups = list(buckets(pending, bucket_bytes))
    if groups and _nbytes(groups[-1]) < bucket_bytes:
        groups.pop()
    return sum(len(g) for g in groups)


def drained(pending: deque, count: int) -> Iterator:
    """``pending``'s first ``count`` items, each let go of as it is taken: a tensor sent is not held until the turn
    ends."""
    for _ in range(count):
        yield pending.popleft()


def _agree(ok: bool, message: str, error: BaseException | None) -> None:
    """Collective: every rank raises if any rank is not ``ok`` (that rank its own ``error``, the others ``message``)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=collective_device())
    dist.all_reduce(flag)
    if error is not None:
        raise error
    if flag.item():
        raise WeightSyncError(message)
