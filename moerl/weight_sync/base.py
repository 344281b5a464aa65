"""What every weight-sync strategy shares, and the interface the job drives.

A strategy (broadcast, disk, adapters: sibling modules) owns the whole sequence that brings the engines to
the trainer's policy: what it gathers, whether and how it pauses the engines, how the bytes travel, what
requests then name. Every trainer rank builds one and calls each method, since gathering the weights is
collective; global rank 0's, given the engines' URLs, also talks to them (``link``), the others' take part
in the gathers only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch
import torch.distributed as dist

from moerl.dtypes import MODEL_DTYPES
from moerl.dtypes import resolve as resolve_dtype
from moerl.engines.client import EngineClient, EngineError
from moerl.errors import EnginesDown
from moerl.megatron.forward import forward_logits
from moerl.megatron.parallel import collective_device, lead_agrees
from moerl.megatron.weights import Gather

log = logging.getLogger("moerl.sync")


@dataclass
class SyncStats:
    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    pause_seconds: float = 0.0  # how long the engines stopped generating for it

    def add(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """One bucket of named tensors sent."""
        self.buckets += 1
        self.tensors += len(bucket)
        self.bytes += sum(t.numel() * t.element_size() for _, t in bucket)

    def strategy_metrics(self) -> dict[str, float]:
        """What a strategy's own stats add to a step's metrics (the fields above are recorded for all)."""
        return {}


class EngineLink:
    """An engine client driven from the (synchronous) training loop through an event loop of its own, in a thread."""

    def __init__(self, urls: list[str], name: str):
        self.client = EngineClient(urls)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine):
        """Run a coroutine of the engine client on this object's event loop; its result."""
        return self.submit(coroutine).result()

    def submit(self, coroutine) -> concurrent.futures.Future:
        """Start a coroutine of the engine client on this object's event loop; a future of its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def close(self) -> None:
        self.run(self.client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


class EngineCall(Enum):
    """How a control call stands on the engines it was made on, where some go while it is made (``(again, wait)``)."""

    # Made again on the engines left, as often as engines keep going (a call that may be repeated); with every engine
    # gone, waits for one (choose_engines, which may start replicas again).
    REPEATED = (True, True)
    # Stands where it succeeded, and fails if it failed on an engine still there (one a second time would refuse).
    ONCE = (False, True)
    # The same two, but with every chosen engine gone they fail at once, as EnginesDown: the calls that end a push,
    # which must not reach an engine started meanwhile at a chosen one's address (it would not hold the push).
    REPEATED_ON_CHOSEN = (True, False)
    ONCE_ON_CHOSEN = (False, False)


class WeightSync(ABC):
    """One way of bringing the engines to the trainer's policy. Each method is collective over the trainer's ranks.

    An update goes to the engines that answer when it starts (:meth:`choose_engines`): one that is down is passed
    over, and one that is back (restarted, or continued after a hang) gets the whole policy with the others."""

    down_timeout_s = 600.0  # how long an update waits for at least one engine to answer

    def __init__(self, urls: list[str] | None, name: str):
        """``urls``: the engines, on global rank 0; None on the other ranks."""
        self.link = EngineLink(urls, name) if urls is not None else None
        self.adapter: str | None = None  # what requests name after the last update (LoRA); None: the base weights
        self.reached = False  # every rank: whether the last update found an engine to go to (see reach_engines)
        self.paused = (
            False  # between an update's pause and its resume: engines are asked whether they answer, not /health
        )
        # Global rank 0: engines that may be another process at the same address since a transport last read this (a
        # call passed them over, see on_engines, or the job started them again); how often the job started each again.
        self.may_be_new: set[str] = set()
        self.starts: Counter[str] = Counter()
        # Global rank 0: called each second an update waits for an engine to answer; the job starts the replicas that
        # died again there, since nothing else does while the update waits.
        self.while_down: Callable[[], None] | None = None
        # Global rank 0: engines left out of the rest of this push, which may wait for good in a broadcast that failed
        # (see set_wedged); those left out for the rest of the run (a broadcast sync's, holding all the weight groups
        # they may); and what the job does with such engines: it restarts those it started, and returns them.
        self.wedged: set[str] = set()
        self.retired: set[str] = set()
        self.restart_engines: Callable[[list[str]], list[str]] | None = None

    @property
    def lead_link(self) -> EngineLink:
        """Global rank 0's :attr:`link`, for the methods that talk to the engines (rank 0 alone calls them)."""
        assert self.link is not None, "only global rank 0, given the engines' URLs, talks to them"
        return self.link

    @property
    def engines(self) -> list[str]:
        """Global rank 0: the engines the last update chose and that are still there (those holding its policy)."""
        return list(self.lead_link.client.targets)

    def server_info(self) -> list[dict]:
        """Global rank 0: every engine's /server_info."""
        return self.lead_link.run(self.lead_link.client.server_info())

    def connect(self) -> None:
        """Prepare the transport (a process group with the engines, a directory). By default there is none to
        prepare: a strategy that needs one overrides this."""
        return None

    @abstractmethod
    def start(self, trainer, engines_hold_it: bool) -> None:
        """Before the first rollout: the engines serve ``trainer``'s policy. ``engines_hold_it``: they were started
        here from the checkpoint the trainer starts from; otherwise (a resumed run, engines given by URL, which may
        hold another run's weights) the policy is pushed."""

    @abstractmethod
    def update(self, trainer, only: list[str] | None = None) -> SyncStats | None:
        """After an optimizer step: the engines serve ``trainer``'s new policy. Its stats on rank 0, None elsewhere (and
        where no engine was there to take it). ``only`` (read on rank 0): a catch-up of the replicas that came back
        since the last update, those of them that answer now (see :meth:`reach_engines`)."""

    @abstractmethod
    def served(self, version: int) -> tuple[str | None, str | None]:
        """(weight version the engines report, adapter requests name) once policy ``version`` is served."""

    def reach_engines(self, only: list[str] | None = None) -> bool:
        """Collective: global rank 0 chooses the engines an update goes to (:meth:`choose_engines`) and every rank
        learns whether there are any. Where none answered for :attr:`down_timeout_s` every rank raises
        :class:`EnginesDown` (rank 0 its own); with ``only``, nothing is waited for and False means none of them
        answers now."""
        chosen: list[str] = []
        self.agreed(lambda: chosen.extend(self.choose_engines(only)))
        outcome = torch.tensor(
            [int(bool(chosen))], dtype=torch.int32, device=collective_device()
        )  # rank 0's goes to all
        if dist.get_world_size() > 1:
            dist.broadcast(outcome, 0)
        self.reached = bool(outcome.item())
        return self.reached

    def agreed(self, call=None, error: Exception | None = None) -> None:
        """Collective: ``call()`` on global rank 0 (a step that may find every engine gone: :meth:`choose_engines` waits
        for one), or ``error``, what a step rank 0 took alone raised; if either failed, every rank raises together
        (:func:`~moerl.megatron.parallel.lead_agrees`: :class:`EnginesDown` as itself, so the job writes its checkpoint
        on each)."""
        if call is not None and self.link is not None:
            try:
                call()
            except Exception as e:  # noqa: BLE001 - told to every rank (lead_agrees), then raised
                error = e
        lead_agrees(error, "the weight sync with the engines")

    def choose_engines(self, only: list[str] | None = None) -> list[str]:
        """Global rank 0: the engines this update goes to, those answering /health, or /model_info while the update has
        them paused (at least one: it waits up to :attr:`down_timeout_s`, then raises :class:`EnginesDown`); every
        control call then goes to them only. ``only``: those of these engines that answer now, perhaps none."""
        link = self.lead_link
        client = link.client
        if self.wedged | self.retired >= set(client.urls):
            why = []
            if self.wedged:
                why.append(
                    f"{', '.join(sorted(self.wedged))} took part in a weight broadcast that failed and may wait in "
                    "it for good"
                )
            if self.retired:
                why.append(f"{', '.join(sorted(self.retired))} hold all the weight groups they may")
            raise EnginesDown(
                f"no engine is left to push to: {'; '.join(why)}: restart them (moerl engines), then resume "
                "the run (run.resume=true)"
            )
        deadline = time.monotonic() + self.down_timeout_s
        while not (
            up := [
                url
                for url, ok in zip(client.urls, link.run(client.healthy(self.paused)), strict=True)
                if ok and url not in self.wedged | self.retired and (only is None or url in only)
            ]
        ):
            if only is not None:
                return up
            if time.monotonic() > deadline:
                raise EnginesDown(
                    f"no engine answered {client.liveness_route(self.paused).path} for {self.down_timeout_s:g} s "
                    "(engines.down_timeout_s): "
                    f"{', '.join(client.urls)}"
                )
            if self.while_down is not None:
                self.while_down()
            time.sleep(1.0)
        if up != client.targets:
            left, back = sorted(set(client.targets) - set(up)), sorted(set(up) - set(client.targets))
            log.warning(
                "weight sync: %d of %d engines answer%s%s",
                len(up),
                len(client.urls),
                f"; passed over: {', '.join(left)}" if left else "",
                f"; back: {', '.join(back)}" if back else "",
            )
        client.targets = up
        return up

    def started_again(self, urls: list[str]) -> None:
        """Global rank 0: the job started these engines' processes again, at their addresses."""
        self.may_be_new |= set(urls)
        self.starts.update(urls)

    def set_wedged(self, urls: list[str]) -> None:
        """Global rank 0: ``urls`` were told of a bucket whose broadcast failed, and those that took it wait in it for
        good (NCCL's kernels do not time out and nothing in SGLang aborts the group; its stream, and so every later
        forward and update, waits behind it), while their HTTP process still answers /model_info. The job restarts
        those it started (:attr:`restart_engines`); the others are left out of the rest of this update, their session
        ended and their generation continued, so that a real forward (SGLang's /health, which the rollout manager's
        probe asks) brings them back once one answers."""
        restarted = set(self.restart_engines(list(urls))) if self.restart_engines is not None else set()
        self.may_be_new |= restarted
        link = self.lead_link
        client = link.client
        left = [url for url in urls if url not in restarted]
        self.wedged |= set(left)
        client.targets = [url for url in client.targets if url not in urls]
        log.warning(
            "weight sync: a broadcast failed after its bucket was announced: %s",
            "; ".join(
                part
                for part in (
                    f"restarting {', '.join(sorted(restarted))}" if restarted else "",
                    f"leaving out {', '.join(left)} until a forward answers there" if left else "",
                )
                if part
            ),
        )
        if left:
            link.run(client.release(left))

    def on_engines(self, call, policy: EngineCall = EngineCall.REPEATED):
        """Global rank 0: ``call(client)`` (a control coroutine) on the chosen engines, its result. While it fails on
        engines that have gone since, those left are the chosen ones, and ``policy`` says what the call then does
        (:class:`EngineCall`). A failure on an engine that is still there is raised; one the job started again
        meanwhile is not still there, though it answers at the same address."""
        again, wait = policy.value
        link = self.lead_link
        client = link.client
        starts = Counter(self.starts)
        while True:
            try:
                return link.run(call(client))
            except EngineError as e:
                before = list(client.targets)
                # not one that came back, nor a new process at a chosen one's address: it missed the push
                left = [
                    url
                    for url in self.choose_engines(None if wait else before)
                    if url in before and self.starts[url] == starts[url]
                ]
                client.targets = left
                self.may_be_new |= set(before) - set(left)
                if not (left or wait):
                    raise EnginesDown(
                        f"none of the engines this update chose answers any more ({', '.join(before)}): {e}"
                    ) from e
                if set(left) >= set(before):
                    raise
                if not again:
                    for failure in e.failures:
                        if failure.url in left:
                            raise failure from None
                    return None

    def verify(self, trainer, tolerance: float) -> dict[str, float]:
        """Collective: every engine the update reached serves ``trainer``'s policy (see :func:`engines_serve`); call it
        after the engines resume. One that has gone since is passed over: it takes the policy when it is back. The worst
        deltas on global rank 0."""
        version, adapter = self.served(trainer.version)
        ids = probe_ids(trainer.hf_config["vocab_size"])
        ours = self.trainer_probe(trainer, ids)
        worst: dict[str, float] = {}
        self.agreed(lambda: worst.update(self.check_engines(ids, ours, version, tolerance, adapter)))
        return worst

    def trainer_probe(self, trainer, ids: list[int]) -> np.ndarray:
        """Collective: the trainer's log-probs of the probe ``ids`` (:func:`probe_logprobs`), which the engines must
        reproduce."""
        return probe_logprobs(trainer.model.module, ids)

    def check_engines(
        self, ids: list[int], ours: np.ndarray, version: str | None, tolerance: float, adapter: str | None = None
    ) -> dict[str, float]:
        """Global rank 0: :func:`engines_serve` on the chosen engines, those gone since passed over."""
        return self.on_engines(lambda client: engines_serve(client, ids, ours, version, tolerance, adapter))

    def close(self) -> None:
        if self.link is not None:
            self.link.close()


class FullWeightSync(WeightSync):
    """Every weight of the model to the engines: paused around the update, they resume under the new version."""

    def __init__(self, urls: list[str] | None, name: str, pause: str = "abort", flush_cache: bool = True):
        """``pause``: ``abort`` (requests in flight end, to be regenerated) or ``in_place`` (they continue under the new
        weights); ``flush_cache``: whether the engines flush their cache with the update, false where updates land while
        requests run (an in_place pause), which SGLang refuses to flush."""
        super().__init__(urls, name)
        self.pause, self.flush_cache = pause, flush_cache
        self.gather: Gather | None = None  # made at the first push (collective), kept for the model's life
        # fp8: the engines serve the policy in FP8 (engines.quantization), and each push quantizes for them
        self.quantization = "none"
        self.verifying = False  # the job verifies each update (sync.verify): a strategy may prepare for it at the push
        self.probe_gather: Gather | None = None  # FP8 engines' verify, where the push's gather is not a whole one

    def start(self, trainer, engines_hold_it: bool) -> None:
        if not engines_hold_it:
            self.push_policy(trainer)
        elif self.link is not None:
            self.link.run(self.link.client.set_weight_version(str(trainer.version)))

    def update(self, trainer, only: list[str] | None = None) -> SyncStats | None:
        start = time.perf_counter()
        if not self.reach_engines(only):
            return None
        self.paused = True
        try:
            self.agreed(self.before_push)
            stats, failed = None, None
            try:
                stats = self.push_policy(trainer)
            except Exception as e:  # noqa: BLE001 - rank 0's own (a disk push's load call), or every rank's (a broadcast's, agreed)
                failed = e
            self.agreed(error=failed)
            self.agreed(self.after_push)
        finally:
            self.paused = False
        if stats is not None:
            stats.pause_seconds = time.perf_counter() - start
        return stats

    def before_push(self) -> None:
        """Global rank 0, before an update's push: the engines stop generating."""
        self.on_engines(lambda client: client.pause(self.pause))

    def after_push(self) -> None:
        """Global rank 0, after an update's push: the engines generate again."""
        self.on_engines(lambda client: client.resume())

    def served(self, version: int) -> tuple[str | None, str | None]:
        return str(version), None

    def trainer_probe(self, trainer, ids: list[int]) -> np.ndarray:
        """Collective: the log-probs of the probe ``ids`` the engines must reproduce. With FP8 engines, those an FP8
        engine computes from exactly the tensors a push sends (quantized as it quantizes them), in the dtype the engines
        compute in, streamed a layer at a time on global rank 0 (:mod:`moerl.weight_sync.fp8_probe`): not the trainer's
        unquantized log-probs, which differ from any FP8 engine's by its rounding."""
        if self.quantization != "fp8":
            return super().trainer_probe(trainer, ids)
        from moerl.weight_sync.fp8_probe import fp8_probe_logprobs  # transformers' model code: verify's alone

        if self.gather is not None and not self.gather.per_sender:
            gather = self.gather  # a push's whole gather
        else:  # none yet, or a sender's share: a whole one of the probe's own, made once (collective)
            if self.probe_gather is None:
                self.probe_gather = Gather(trainer.model.module)
            gather = self.probe_gather
        return fp8_probe_logprobs(gather, trainer.hf_config, ids, self.engine_dtype)

    def engine_dtype(self) -> torch.dtype:
        """Global rank 0: the dtype the chosen engines compute in, as their /server_info reports it (SGLang's ``auto``:
        bfloat16); where they differ, the first of them that is not float32 (every engine is checked against one
        reference, by float32's tolerance only where all compute in float32). With none of them answering, what
        ``auto`` means here: verify then checks no engine."""
        try:
            infos = self.on_engines(lambda client: client.server_info(), EngineCall.REPEATED_ON_CHOSEN)
        except (EngineError, EnginesDown):
            infos = []
        reported = [str(info.get("dtype", "auto")) for info in infos] or [resolve_dtype("auto")]
        dtypes = [reported_dtype(name) or torch.bfloat16 for name in reported]  # SGLang's auto is never float32
        return next((d for d in dtypes if d != torch.float32), torch.float32)

    def push_policy(self, trainer) -> SyncStats | None:
        """Collective: ``trainer``'s weights to the engines under its version; the stats on rank 0, None elsewhere."""
        return self.push_model(trainer.model.module, trainer.hf_config, str(trainer.version))

    @abstractmethod
    def push_model(self, model, hf_config: dict, version: str) -> SyncStats | None:
        """Collective: ``model``'s weights to the engines under ``version``; the stats on rank 0, None elsewhere."""


def reported_dtype(name: str) -> torch.dtype | None:
    """The dtype an engine's /server_info says it computes in (SGLang's --dtype choices); None for ``auto``, which
    SGLang resolves from the checkpoint."""
    return (MODEL_DTYPES | {"half": torch.float16, "float": torch.float32}).get(name)


class WeightSyncError(RuntimeError):
    """An engine does not serve the trainer's weights after a sync; the message names the engine."""


PROBE_TOKENS = 64


def probe_ids(vocab_size: int) -> list[int]:
    """A fixed prompt that touches many rows of the embedding and many experts."""
    return [(7919 * i + 17) % vocab_size for i in range(PROBE_TOKENS)]


def probe_logprobs(model, ids: list[int]) -> np.ndarray:
    """Collective over the trainer's ranks: the model's log-probs of ``ids[1:]`` given the tokens before them, on every
    rank."""
    logits = forward_logits(model, torch.tensor([ids]))
    ours = (
        None
        if logits is None
        else torch.log_softmax(logits[0, :-1].float(), -1)
        .gather(1, torch.tensor(ids[1:])[:, None].to(logits.device))[:, 0]
        .cpu()
    )
    held: list[torch.Tensor | None] = [None] * dist.get_world_size()
    dist.all_gather_object(held, ours)  # PROBE_TOKENS floats from each rank: the last stage's are the answer
    return next(t for t in held if t is not None).numpy()


async def engines_serve(
    client: EngineClient,
    ids: list[int],
    ours: np.ndarray,
    version: str | None,
    tolerance: float,
    lora_path: str | None = None,
) -> dict[str, float]:
    """Check that every engine ``client`` targets serves the policy whose log-probs of the probe ``ids`` are ``ours``.

    Each engine must report ``version`` (unless None); engines that checksum their weights (SGLang's /weights_checker)
    must agree with each other; and each engine's log-probs of the probe (``lora_path``: through that adapter) must be
    within ``tolerance`` (mean |delta|) of ``ours``. The probe is a generation request: the engines must not be paused.
    Raises :class:`WeightSyncError` naming the engine that does not; returns the worst deltas."""
    if version is not None:
        for url, served in zip(client.targets, await client.weight_versions(), strict=True):  # one per target
            if served != version:
                raise WeightSyncError(f"{url} serves weight version {served!r}, not {version!r}")
    checksums = {c for c in await client.weight_checksums() if c is not None}
    if len(checksums) > 1:
        raise WeightSyncError(
            f"the engines hold different weights after the update to version {version}: {sorted(checksums)}"
        )
    worst = {"sync/verify_mean_abs_delta": 0.0, "sync/verify_max_abs_delta": 0.0}
    for url, theirs in zip(client.targets, await client.prompt_logprobs(ids, lora_path), strict=True):
        delta = np.abs(theirs - ours)
        if delta.mean() > tolerance:
            # An adapter is only as right as the base weights under it, which no sync of adapters moves.
            hint = (
                (
                    "; the adapter applies to the engine's base weights, which must be model.path's: an engine given "
                    "by URL keeps those an earlier run loaded into it, so start it again from model.path"
                )
                if lora_path
                else ""
            )
            raise WeightSyncError(
                f"{url} does not serve the trainer's weights "
                f"({f'adapter {lora_path}' if lora_path else f'version {version}'}): its log-probs of the probe "
                f"differ by {delta.mean():.3g} on average (max {delta.max():.3g}), tolerance {tolerance:g}{hint}"
            )
        worst = {
            "sync/verify_mean_abs_delta": max(worst["sync/verify_mean_abs_delta"], float(delta.mean())),
            "sync/verify_max_abs_delta": max(worst["sync/verify_max_abs_delta"], float(delta.max())),
        }
    return worst
