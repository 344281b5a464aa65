"""One async client for every engine replica, SGLang or embedded: same routes, same decoding.

Generation, and any other request a caller routes by :meth:`EngineClient.on_replica`, goes to the least-loaded
healthy replica (fewest in flight; :mod:`moerl.engines.health`). Each completion is returned as soon as it finishes; a
request that fails in transport, answers 5xx or runs past the client's deadline takes its replica out of rotation and
raises :class:`ReplicaDown`, for the caller to re-issue elsewhere (:meth:`EngineClient.until_served` does so itself).
On control routes transport failures and 5xx answers are retried a bounded number of times where a second attempt is
harmless (never a group join, a broadcast or an adapter load); a 4xx answer is the caller's mistake and raises at once
with the engine's message. Every body is built with the route's type from :mod:`moerl.engines.protocol`.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import functools
import json
import logging
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import numpy as np

from moerl.engines import protocol as P
from moerl.engines.generation_workers import GenerationWorkers
from moerl.engines.health import ReplicaHealth, State
from moerl.engines.protocol import Completion, Route, SamplingParams, WireModel
from moerl.env import raise_open_files_limit
from moerl.errors import EnginesDown
from moerl.models.family import ModelShape

log = logging.getLogger(__name__)
R = TypeVar("R")

# An answer that cannot be larger than this is read and decoded here (about 4 ms per MB): less than the round trip to a
# generation worker costs. Larger ones (an 8K-token response of a 48-layer model is 25 MB) go to the workers.
CARRY_ELSEWHERE_BYTES = 1 << 20
# Bodies one client reads at once, by their Content-Length; the rest wait in the engines' sockets. An answer waiting
# there holds the kernel's TCP memory (several MB a connection, both ends), and past net.ipv4.tcp_mem's pressure mark
# (1.5 GB on a 24 GB machine) the kernel drops packets on every connection: transfers, health checks and weight syncs
# then stall on retransmit timers while both ends sit idle. Reading many at once keeps few waiting; one larger than
# this is read alone.
READ_BUDGET_BYTES = 512 << 20


class ByteBudget:
    """Bytes held at once across tasks: :meth:`hold` waits while ``budget`` would be exceeded (one request larger than
    the whole budget goes alone), in the order the holds were asked."""

    def __init__(self, budget: int):
        self.budget, self.held = budget, 0
        self._turns: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @contextlib.asynccontextmanager
    async def hold(self, size: int) -> AsyncIterator[None]:
        if self._turns or not self._fits(size):
            turn = asyncio.get_running_loop().create_future()
            self._turns.append((size, turn))
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():  # let in just as it was cancelled: its bytes go back
                    self._release(size)
                else:
                    self._turns.remove((size, turn))
                    self._admit()
                raise
        else:
            self.held += size
        try:
            yield
        finally:
            self._release(size)

    def _fits(self, size: int) -> bool:
        return self.held == 0 or self.held + size <= self.budget

    def _release(self, size: int) -> None:
        self.held -= size
        self._admit()

    def _admit(self) -> None:
        while self._turns and self._fits(self._turns[0][0]):
            size, turn = self._turns.popleft()
            self.held += size
            turn.set_result(None)


class EngineError(RuntimeError):
    """An engine refused a request (4xx) or stayed unreachable after the retries."""

    def __init__(self, url: str, message: str, status: int | None = None):
        super().__init__(f"{url}: {message}")
        self.url, self.message, self.status = url, message, status
        # A call that ended on every engine (EngineClient._on_each): each engine's error, this one first.
        self.failures: list[EngineError] = [self]

    def __reduce__(self):  # raised in a generation worker, re-raised in its owner
        return type(self), (self.url, self.message, self.status)


class ReplicaDown(EngineError):
    """A generation failed because of its replica (transport error, 5xx, deadline): re-issue it to another."""


class NoHealthyEngine(RuntimeError):
    """Every replica is out of rotation."""


@dataclass(frozen=True)
class Returns:
    """What a /generate answer carries beside each token and its log-prob."""

    routing_from: int | None = None  # each fed position's routed experts from this one on (None: no routing)
    sampling_mask: bool = False  # each token's kept set (top-k/top-p), its log-prob renormalised over it
    top_logprobs: int = 0  # each token's most likely tokens, with their log-probs


TOKENS_ONLY = Returns()


class EngineClient:
    def __init__(
        self,
        urls: Iterable[str],
        shape: ModelShape | None = None,
        timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        failures_to_dead: int = 3,
        workers: int | GenerationWorkers = 0,
    ):
        """``timeout_s``: each request's deadline; ``failures_to_dead``: see :class:`ReplicaHealth`; ``workers``:
        processes that carry the generations whose answers may exceed :data:`CARRY_ELSEWHERE_BYTES`, their HTTP and
        decoding (:mod:`~moerl.engines.generation_workers`; 0: this one carries all), or another client's, shared
        (:attr:`workers`: a scorer's beside the policy's; that client closes them)."""
        self.urls = [u.rstrip("/") for u in urls]
        if not self.urls:
            raise ValueError("EngineClient needs at least one engine URL")
        self.health = ReplicaHealth(self.urls, failures_to_dead)
        self.targets = list(self.urls)  # where control calls go (a weight sync narrows it to the engines that are up)
        self.shape = shape
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.retries, self.backoff_s = retries, backoff_s
        self.in_flight = {u: 0 for u in self.urls}
        self._session: aiohttp.ClientSession | None = None
        self._reading = ByteBudget(READ_BUDGET_BYTES)
        self._owns_workers = isinstance(workers, int)
        self.workers: GenerationWorkers | None = None
        if isinstance(workers, GenerationWorkers):
            self.workers = workers
        elif workers > 0:
            make_client = functools.partial(EngineClient, self.urls, shape, timeout_s, retries=0)
            self.workers = GenerationWorkers(workers, make_client, timeout_s)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.workers is not None and self._owns_workers:
            self.workers.close()

    def worker_pids(self) -> list[int]:
        """The generation workers' processes, to count their CPU (bench/engine_client_cpu.py)."""
        return self.workers.pids() if self.workers is not None else []

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Each request in flight holds a connection, and aiohttp's default pool holds 100: the 101st generation
            # would wait for one to finish, while its caller counts it as running. How many run is the caller's
            # bound (the job's depth, its schedule's max_running), never the pool's.
            raise_open_files_limit()
            self._session = aiohttp.ClientSession(timeout=self.timeout, connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def _call(
        self,
        url: str,
        route: Route,
        request: WireModel | None = None,
        retries: int | None = None,
        parse: Callable[[bytes], Awaitable[Any]] | None = None,
    ) -> Any:
        """One route on one engine; transport errors and 5xx are retried (``retries``, default the client's) where the
        route is idempotent. ``parse``: what a success's raw body becomes, read and parsed within the client's
        :data:`READ_BUDGET_BYTES`."""
        body = request.body() if request is not None else None
        last: Exception | None = None
        attempts = (self.retries if retries is None else retries) + 1 if route.idempotent else 1
        for attempt in range(attempts):
            try:
                async with self._http().request(route.method, url + route.path, json=body) as resp:
                    if parse is not None and resp.status < 400:
                        async with self._reading.hold(resp.content_length or 0):
                            return await parse(await resp.read())
                    text = await resp.text()
                    if resp.status < 400:
                        return json.loads(text) if text and resp.content_type == "application/json" else text
                    message = _error_message(text)
                    if resp.status < 500:
                        raise EngineError(url, f"{route.path} refused ({resp.status}): {message}", resp.status)
                    last = EngineError(url, f"{route.path} failed ({resp.status}): {message}", resp.status)
            # a broken answer is a transport failure
            except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as e:
                last = EngineError(url, f"{route.path}: {type(e).__name__}: {e}")
            if attempt + 1 < attempts:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        assert last is not None, "every attempt that did not return set it"
        raise last

    async def _everywhere(
        self, route: Route, request: WireModel | None = None, among: Iterable[str] | None = None
    ) -> list[Any]:
        """``route`` on every engine (those of them in ``among``, where given)."""
        kept = None if among is None else set(among)
        chosen = [u for u in self.targets if kept is None or u in kept]
        return list(await asyncio.gather(*(self._call(u, route, request) for u in chosen)))

    async def _on_each(self, route: Route, request: WireModel | None = None) -> list[Any]:
        """As :meth:`_everywhere`, for a call that must not be repeated where it succeeded: it ends on every engine
        before it raises (a failure of one stops none of the others unseen), the error carrying each engine's
        (:attr:`EngineError.failures`). Not for the weight-group routes: there one engine's refusal must fail the
        collective its peers wait in at once."""
        outcomes = await asyncio.gather(*(self._call(u, route, request) for u in self.targets), return_exceptions=True)
        errors: list[EngineError] = []
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, EngineError):  # not an engine's failure: ours
                    raise outcome
                errors.append(outcome)
        if not errors:
            return outcomes
        errors[0].failures = errors
        raise errors[0]

    # ---- generation -----------------------------------------------------------------------------
    async def generate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        returns: Returns = TOKENS_ONLY,
        *,
        rid: str | None = None,
        lora_path: str | None = None,
        extra_key: str | None = None,
        affinity: str | None = None,
        replica: str | None = None,
    ) -> list[Completion]:
        """All ``sampling_params.n`` completions of one prompt, from the least-loaded healthy replica, or with an
        ``affinity`` key from the healthy replica that key hashes to (the same one for as long as the healthy set
        stays: an agent group's turns reuse its prompt's prefix there), or from ``replica`` while it is healthy (a
        scheduler's choice); ``returns``: what the answer carries beside each
        token and its log-prob; ``extra_key``: the prefix-cache partition it may reuse KV from (SGLang's; a policy
        version's, say). Raises
        :class:`ReplicaDown` for the replica's failures, :class:`~moerl.engines.generation_workers.WorkerLost` when
        the worker carrying it died (the replica is not blamed): either may be re-issued."""
        if isinstance(sampling_params, dict):
            sampling_params = SamplingParams.parse(sampling_params)
        fields: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling_params or SamplingParams(),
            "return_logprob": True,
        }
        routing_start = returns.routing_from or 0
        if returns.routing_from is not None:
            if self.shape is None:
                raise ValueError("routed experts need EngineClient(shape=ModelShape...) to decode the routing")
            fields.update(return_routed_experts=True, routed_experts_start_len=routing_start)
        if returns.sampling_mask:
            fields.update(return_sampling_mask=True, sampling_logprobs_mode="selected")
        if returns.top_logprobs:
            fields.update(top_logprobs_num=returns.top_logprobs)
        # Those not given stay unset, so the body leaves them out.
        optional = {"rid": rid, "lora_path": lora_path, "extra_key": extra_key}
        fields.update({name: value for name, value in optional.items() if value is not None})
        return await self._served(P.GenerateReqInput(**fields), routing_start, affinity, replica)

    async def token_logprobs(
        self, input_ids: list[int], start: int, top: int = 0, affinity: str | None = None
    ) -> Completion:
        """The served model's log-prob of each of ``input_ids[start:]`` given the tokens before it (the completion's
        ``input_logprobs``, float32 [len - start]: a teacher's scoring of a student's tokens), with the ``top`` most
        likely tokens in each one's place (``input_top_ids`` and ``input_top_logprobs``), computing no new token. Served
        as :meth:`generate` is (``affinity`` the same); the KV of the first ``start - 1`` tokens may come from the
        prefix cache. A completion aborted (a pause that aborts, say) may have no ``input_logprobs``."""
        (completion,) = await self._served(scoring_request(input_ids, start, top), 0, affinity)
        return completion

    async def _served(
        self, request: P.GenerateReqInput, routing_start: int, affinity: str | None, replica: str | None = None
    ) -> list[Completion]:
        """``request``'s completions, by :meth:`on_replica`: read in a generation worker where the answer may be large,
        and the replica taken out of rotation where it has lost the adapter or the weights the run gave it."""
        lora_path = request.lora_path

        async def on(url: str) -> list[Completion]:
            epoch = self.health.epochs[url]
            try:
                completions = await self.read_on(url, request, routing_start)
            except EngineError as e:
                said = str(e)
                if lora_path is not None and e.status == 400 and P.ADAPTER_NEVER_LOADED in said and lora_path in said:
                    reason = f"refused adapter {lora_path}, which a sync loaded there: it restarted unseen"
                    self.health.lost_policy(url, reason, epoch)
                    raise ReplicaDown(url, said.removeprefix(f"{url}: "), e.status) from None
                raise
            versions = (span["version"] for c in completions for span in c.weight_versions)
            if (stray := self.health.foreign_version(versions)) is not None:
                reason = (
                    f"answered under weight version {stray!r}, which no weight sync of this run left: it restarted "
                    "unseen"
                )
                self.health.lost_policy(url, reason, epoch)
                raise ReplicaDown(url, reason)
            return completions

        return await self.on_replica(on, affinity, replica)

    async def on_replica(
        self, call: Callable[[str], Awaitable[R]], affinity: str | None = None, replica: str | None = None
    ) -> R:
        """``call(url)``, once, on the least-loaded healthy replica, or with an ``affinity`` key on the healthy replica
        that key hashes to (the same one for as long as the healthy set stays), or on ``replica`` if it is healthy
        (else as without it). A failure of the replica's (transport,
        5xx, deadline, an answer that cannot be read) takes it out of rotation and raises :class:`ReplicaDown`, for the
        caller to ask again elsewhere, as does a :class:`ReplicaDown` of ``call``'s own (the replica's health told
        already); a refusal (4xx) is raised as it came. :class:`NoHealthyEngine` where no replica is healthy."""
        usable = self.health.usable()
        if not usable:
            states = ", ".join(f"{u} {self.health.state(u).value}" for u in self.urls)
            raise NoHealthyEngine(f"no engine replica is healthy: {states}")
        if replica in usable:
            url = replica
        elif affinity is None:
            url = min(usable, key=self.in_flight.__getitem__)
        else:
            url = sorted(usable)[zlib.crc32(affinity.encode()) % len(usable)]
        self.in_flight[url] += 1
        try:
            return await call(url)
        except ReplicaDown:
            raise
        except EngineError as e:
            if e.status is not None and e.status < 500:
                raise
            self.health.request_failed(url, str(e))
            raise ReplicaDown(url, str(e).removeprefix(f"{url}: "), e.status) from None
        except P.BrokenAnswer as e:
            self.health.request_failed(url, str(e))
            raise ReplicaDown(url, str(e)) from None
        finally:
            self.in_flight[url] -= 1

    async def until_served(
        self,
        call: Callable[[str], Awaitable[R]],
        failed: Callable[[ReplicaDown], None],
        down_timeout_s: float,
        timeout_key: str,
        poll_s: float,
        meanwhile: Callable[[], Awaitable[bool]] | None = None,
        affinity: str | None = None,
    ) -> R:
        """``call(url)`` by :meth:`on_replica` (``affinity`` its) until a replica serves it: each replica's failure is
        told to ``failed`` and the call is made again, on another replica or once one is healthy again. The four
        arguments before ``affinity`` are :meth:`until_usable`'s: :class:`EnginesDown` after ``down_timeout_s`` with
        none."""
        while True:
            await self.until_usable(down_timeout_s, timeout_key, poll_s, meanwhile)
            try:
                return await self.on_replica(call, affinity)
            except ReplicaDown as e:
                failed(e)

    async def classify_on(self, url: str, input_ids: list[list[int]]) -> list[list[float]]:
        """A reward model's scores of each input (SGLang's /classify), from the engine at ``url``."""
        answers = await self._call(url, P.CLASSIFY, P.ClassifyReqInput(input_ids=input_ids))
        return [answer["embedding"] for answer in answers]

    async def step_scores_on(self, url: str, input_ids: list[list[int]], step_token_id: int) -> list[list[float]]:
        """A process reward model's score of each step of each input (moerl's /step_scores: at each ``step_token_id``
        of the input, in order, p(label 1)), from the embedded engine at ``url``."""
        request = P.StepScoresReqInput(input_ids=input_ids, step_token_id=step_token_id)
        answers = await self._call(url, P.STEP_SCORES, request)
        return [answer["scores"] for answer in answers]

    async def read_on(self, url: str, request: P.GenerateReqInput, routing_start: int) -> list[Completion]:
        """One /generate on ``url``, carried by a generation worker where its answer may be large (past
        :data:`CARRY_ELSEWHERE_BYTES`), else read and decoded here; no retry, no health accounting. Raises
        :class:`~moerl.engines.generation_workers.WorkerLost` when the worker carrying it died."""
        if self.workers is not None and P.largest_answer_bytes(request, self.shape) > CARRY_ELSEWHERE_BYTES:
            return await self.workers.generate(url, request, routing_start)
        return await self.generate_on(url, request, routing_start)

    async def generate_on(self, url: str, request: P.GenerateReqInput, routing_start: int) -> list[Completion]:
        """One /generate on ``url``, read and decoded in this process; no retry, no health accounting."""

        prompt_len = len(request.input_ids) if request.input_ids is not None else None
        scored = P.scored_ids(request)

        async def decode(body: bytes) -> list[Completion]:
            return P.decode_generate_body(body, self.shape, routing_start, prompt_len, scored)

        if (split := P.one_by_one(request)) is None:
            return await self._call(url, P.GENERATE, request, retries=0, parse=decode)
        prefill, each = split
        await self._call(url, P.GENERATE, prefill, retries=0)
        tasks = [asyncio.ensure_future(self._call(url, P.GENERATE, one, retries=0, parse=decode)) for one in each]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:  # the first failure, or a cancel: the others end (the engine aborts what nobody reads)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [completion for part in parts for completion in part]

    # ---- control ------------------------------------------------------------------------------
    async def pause(self, mode: str = "abort") -> None:
        # model_validate, as the constructor would check it: ``mode`` is any string (a config value), not yet one of the
        # wire type's Literal modes.
        await self._everywhere(P.PAUSE, P.PauseGenerationReqInput.model_validate({"mode": mode}))

    async def resume(self) -> None:
        await self._everywhere(P.CONTINUE, P.ContinueGenerationReqInput())

    async def release(self, urls: list[str], timeout_s: float = 5.0) -> None:
        """End the weight-update session and continue generation on ``urls``, engines a failed update leaves out that
        may be stuck: each call given ``timeout_s``, whatever they answer."""
        await self._quietly(
            urls, [(P.END_UPDATE, P.EndWeightUpdateReqInput()), (P.CONTINUE, P.ContinueGenerationReqInput())], timeout_s
        )

    async def end_sessions(self, urls: list[str], timeout_s: float = 5.0) -> None:
        """End the weight-update session on ``urls``, where a failed push opened one (or may have), whatever they
        answer: the next push's would be refused while it is open."""
        await self._quietly(urls, [(P.END_UPDATE, P.EndWeightUpdateReqInput())], timeout_s)

    async def _quietly(self, urls: list[str], calls: list[tuple[Route, WireModel]], timeout_s: float) -> None:
        """Each of ``calls`` in turn on each of ``urls``, given ``timeout_s`` each, whatever it answers."""

        async def one(url: str) -> None:
            for route, request in calls:
                try:
                    await asyncio.wait_for(self._call(url, route, request, retries=0), timeout_s)
                except (TimeoutError, EngineError):
                    pass

        await asyncio.gather(*(one(u) for u in urls))

    async def abort(self, rid: str | None = None, quietly: bool = False) -> None:
        """Abort request ``rid`` (None: all) everywhere; ``quietly``: on the healthy replicas only, once each, whatever
        they answer (a stop that must not wait on a replica that is down)."""
        request = P.AbortReq(rid=rid or "", abort_all=rid is None)
        if not quietly:
            await self._everywhere(P.ABORT, request)
            return
        await asyncio.gather(
            *(self._call(u, P.ABORT, request, retries=0) for u in self.health.usable()), return_exceptions=True
        )

    async def server_info(self) -> list[P.ServerInfo]:
        return await self._everywhere(P.SERVER_INFO)

    async def weight_versions(self) -> list[str]:
        return [info["weight_version"] for info in await self._everywhere(P.MODEL_INFO)]

    async def set_weight_version(self, version: str, abort_all_requests: bool = False) -> None:
        await self._everywhere(
            P.UPDATE_WEIGHT_VERSION,
            P.UpdateWeightVersionReqInput(new_version=version, abort_all_requests=abort_all_requests),
        )

    async def flush_cache(self) -> None:
        """Drop every engine's prefix cache (refused while requests run)."""
        await self._everywhere(P.FLUSH_CACHE)

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True
    ) -> None:
        await self._everywhere(
            P.UPDATE_FROM_DISK,
            P.UpdateWeightFromDiskReqInput(
                model_path=model_path, weight_version=weight_version, flush_cache=flush_cache
            ),
        )

    async def update_weights_from_tensor(
        self,
        payloads: Callable[[str], list[str]],
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        """Tensors handed over on the engines' own machine (:mod:`moerl.engines.tensor_ipc`): each engine gets
        ``payloads(url)``, handles of its own, one per TP rank (SGLang's TP rank i reads entry i)."""
        await asyncio.gather(
            *(
                self._call(
                    url,
                    P.UPDATE_FROM_TENSOR,
                    P.UpdateWeightsFromTensorReqInput.model_validate(
                        {
                            "serialized_named_tensors": payloads(url),
                            "load_format": load_format,
                            "weight_version": weight_version,
                            "flush_cache": flush_cache,
                        }
                    ),
                )
                for url in self.targets
            )
        )

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """Give back the engines' memory of ``tags`` (None: all): after a pause with abort or retract. Asked once of
        each engine and ended on every one before a failure is raised, each engine's failure in it
        (:attr:`EngineError.failures`): the others have released theirs."""
        await self._on_each(
            P.RELEASE_MEMORY, P.ReleaseMemoryOccupationReqInput.model_validate({"tags": tags} if tags else {})
        )

    async def resume_memory(self, tags: list[str] | None = None, among: Iterable[str] | None = None) -> None:
        """Take back the memory of ``tags`` (None: all) on the engines (those of them in ``among``: the ones that
        released it; SGLang's scheduler dies on a tag it did not release, so it is asked once of each). Weights resumed
        hold nothing until a push, unless the server keeps a host copy."""
        request = P.ResumeMemoryOccupationReqInput.model_validate({"tags": tags} if tags else {})
        await self._everywhere(P.RESUME_MEMORY, request, among)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str,
        backend: str,
        rank_offsets: list[int] | None = None,
    ) -> None:
        """Each replica joins the trainer's broadcast group at its own rank offset (default 1, 2, ...)."""
        offsets = rank_offsets or list(range(1, len(self.targets) + 1))
        # model_validate, as the constructor would check it: ``backend`` is any string, not yet one of the Literal's.
        await asyncio.gather(
            *(
                self._call(
                    u,
                    P.INIT_GROUP,
                    P.InitWeightsUpdateGroupReqInput.model_validate(
                        {
                            "master_address": master_address,
                            "master_port": master_port,
                            "rank_offset": offset,
                            "world_size": world_size,
                            "group_name": group_name,
                            "backend": backend,
                        }
                    ),
                )
                for u, offset in zip(self.targets, offsets, strict=True)
            )
        )

    async def begin_weight_update(self) -> None:
        await self._everywhere(P.BEGIN_UPDATE, P.BeginWeightUpdateReqInput())

    async def end_weight_update(self) -> None:
        """Ends on every engine before a failure is raised (asked once: an engine whose session it ended refuses
        another)."""
        await self._on_each(P.END_UPDATE, P.EndWeightUpdateReqInput())

    async def abandon_weight_update(self) -> None:
        """After a failed update: end the session wherever one is open (engines without one, or gone, are passed
        over)."""
        await asyncio.gather(
            *(self._call(u, P.END_UPDATE, P.EndWeightUpdateReqInput(), retries=0) for u in self.targets),
            return_exceptions=True,
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        # model_validate, as the constructor would check it: ``dtypes`` and ``load_format`` are any strings, not yet
        # the Literals the wire type takes.
        await self._everywhere(
            P.UPDATE_FROM_DISTRIBUTED,
            P.UpdateWeightsFromDistributedReqInput.model_validate(
                {
                    "names": names,
                    "dtypes": dtypes,
                    "shapes": shapes,
                    "group_name": group_name,
                    "weight_version": weight_version,
                    "load_format": load_format,
                    "flush_cache": flush_cache,
                }
            ),
        )

    async def prompt_logprobs(self, input_ids: list[int], lora_path: str | None = None) -> list[np.ndarray]:
        """Each engine's log-probs of ``input_ids[1:]`` given the tokens before them (float32 [len - 1])."""
        request = P.GenerateReqInput(
            input_ids=list(input_ids),
            return_logprob=True,
            logprob_start_len=0,
            lora_path=lora_path,
            sampling_params=SamplingParams(max_new_tokens=1, temperature=1.0),
        )
        scored = P.scored_ids(request)
        logprobs = []
        for answer in await self._everywhere(P.GENERATE, request):
            completion = P.decode_generate(answer, None, scored=scored)
            assert completion.input_logprobs is not None, "decoding refuses a finished answer without them"
            logprobs.append(completion.input_logprobs)
        return logprobs

    async def weight_checksums(self) -> list[str | None]:
        """Each engine's checksum over all its weights, None where it has no /weights_checker."""

        async def one(url):
            try:
                return (await self._call(url, P.WEIGHTS_CHECKER, P.CheckWeightsReqInput()))["per_engine_checksum"]
            except EngineError as e:
                if e.status == 404:
                    return None
                raise

        return list(await asyncio.gather(*(one(u) for u in self.targets)))

    async def load_lora(self, name: str, path: str) -> None:
        await self._on_each(P.LOAD_LORA, P.LoadLoRAAdapterReqInput(lora_name=name, lora_path=path))

    async def load_lora_from_tensors(self, name: str, config: dict[str, Any], tensors: dict[str, Any]) -> None:
        """Push an adapter's PEFT tensors without a shared filesystem, as base64 safetensors bytes
        (``load_format='safetensors'``). The embedded engine takes this; SGLang's own tensor format is
        a CUDA-IPC pickle that only works on the same machine, so SGLang replicas elsewhere are given
        adapters with :meth:`load_lora` and a shared directory instead."""
        from safetensors.torch import save

        payload = base64.b64encode(save({k: v.contiguous() for k, v in tensors.items()})).decode("ascii")
        await self._on_each(
            P.LOAD_LORA_TENSORS,
            P.LoadLoRAAdapterFromTensorsReqInput(
                lora_name=name, config_dict=config, serialized_named_tensors=[payload], load_format="safetensors"
            ),
        )

    async def unload_lora(self, name: str) -> None:
        await self._everywhere(P.UNLOAD_LORA, P.UnloadLoRAAdapterReqInput(lora_name=name))

    async def probe(self, url: str) -> tuple[bool, str | None]:
        """Whether ``url`` answers ``/health`` (within 5 s), and the weight version it then reports."""
        if not (await self._healthy(url)):
            return False, None
        try:
            info = await self._call(url, P.MODEL_INFO, retries=0)
        except EngineError:
            return False, None
        return (True, info.get("weight_version")) if isinstance(info, dict) else (False, None)

    async def probe_out_of_rotation(self, urls: Iterable[str] | None = None) -> None:
        """Probe each of ``urls`` (default: every replica) that is out of rotation and tell the health table; an
        answer is dropped where a sync reached the replica while it was asked (it may predate that)."""
        health = self.health
        for url in health.urls if urls is None else urls:
            if health.state(url) is State.HEALTHY:
                continue
            epoch = health.epochs[url]
            try:
                answered, version = await self.probe(url)
            except Exception as e:  # noqa: BLE001 - a probe that fails in any way is an unanswered probe
                log.warning("probing %s: %s: %s", url, type(e).__name__, e)
                answered, version = False, None
            if health.epochs[url] == epoch:
                health.probed(url, answered, version)

    async def until_usable(
        self,
        down_timeout_s: float,
        timeout_key: str,
        poll_s: float,
        meanwhile: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        """Return once a replica is healthy; while none is, awaits ``meanwhile`` (a probe, where nothing else probes)
        before each look. Raises :class:`EnginesDown`, naming ``timeout_key`` and each replica's state, after
        ``down_timeout_s`` without one; a wait that ``meanwhile`` finds a replica alive in (True: paused by another
        process, say) does not count."""
        deadline = time.monotonic() + down_timeout_s
        while not self.health.usable():
            if meanwhile is not None:
                if await meanwhile():
                    deadline = time.monotonic() + down_timeout_s
                if self.health.usable():
                    return
            if time.monotonic() > deadline:
                states = ", ".join(f"{r.url} {r.state.value} ({r.reason})" for r in self.health.replicas.values())
                raise EnginesDown(
                    f"no engine replica has been healthy for {timeout_key}={down_timeout_s:g} s: {states}"
                )
            await asyncio.sleep(poll_s)

    @staticmethod
    def liveness_route(paused: bool) -> P.Route:
        """What asks an engine whether it answers: SGLang's /health generates a token, which waits while generation is
        paused (then 503); its /model_info is answered by the HTTP process alone."""
        return P.MODEL_INFO if paused else P.HEALTH

    async def _healthy(self, url: str, paused: bool = False) -> bool:
        try:
            async with self._http().get(
                url + self.liveness_route(paused).path, timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def healthy(self, paused: bool = False) -> list[bool]:
        """Whether each engine answers (``paused``: while this client has generation paused, whether its server
        does)."""
        return list(await asyncio.gather(*(self._healthy(u, paused) for u in self.urls)))


def scoring_request(input_ids: list[int], start: int, top: int = 0) -> P.GenerateReqInput:
    """The request :meth:`EngineClient.token_logprobs` makes: the log-prob of each of ``input_ids[start:]`` given those
    before it, and the ``top`` most likely tokens in its place, computing no new token."""
    if not 1 <= start <= len(input_ids):
        raise ValueError(f"start={start}: the tokens scored start in [1, {len(input_ids)}] (the first has none)")
    return P.GenerateReqInput(
        input_ids=list(input_ids),
        sampling_params=SamplingParams(max_new_tokens=0),
        return_logprob=True,
        logprob_start_len=start - 1,  # SGLang answers the token there null: the scored ones follow it
        top_logprobs_num=top,
    )


def health(urls: list[str]) -> list[bool]:
    """Whether each engine answers ``/health`` with 200, from code that runs no event loop."""

    async def ask():
        async with EngineClient(urls, retries=0) as client:
            return await client.healthy()

    return asyncio.run(ask())


def _error_message(text: str) -> str:
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text.strip() or "(empty body)"
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return text
