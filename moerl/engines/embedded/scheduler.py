"""Continuous batching for the embedded engine.

One engine thread owns the model. Requests join the running batch after their prefill and leave it
the step they finish, so a short completion returns at once instead of waiting for the longest one in
its batch. Control operations (pause, weight updates, aborts) are queued to the engine thread and run
between decode steps, so the model and the batch are only ever touched by that thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import random
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from moerl.engines.embedded.lora import AdapterSet
from moerl.engines.embedded.prefix_cache import KV, CachedPrefix, Namespace, PrefixCache
from moerl.engines.embedded.runner import ModelRunner
from moerl.engines.embedded.sampler import Draw, position_uniform, sample_batch
from moerl.engines.protocol import SamplingParams
from moerl.errors import LoRAError

log = logging.getLogger("moerl.serve")
DEFAULT_PREFIX_CACHE_TOKENS = 32768


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams  # resolved (greedy is top_k 1)
    parent: str | None = None  # the rid of the request this is one of n > 1 completions of
    logprob_start_len: int | None = None  # prompt log-probs from here (None: none)
    return_routed_experts: bool = False
    return_sampling_mask: bool = False
    # each output token's most likely alternatives, with its log-prob (and each prompt token's after logprob_start_len)
    top_logprobs_num: int = 0
    lora: str | None = None  # adapter name
    stream: bool = False  # its client reads each token as it comes
    cache_namespace: Namespace = (None, None, None)  # which cached prefixes it may reuse (prefix_cache.Namespace)
    # Called on the engine thread with (request, finished: bool) after every new token and at the end.
    on_update: Callable[[Request, bool], None] = lambda request, finished: None

    output_ids: list[int] = field(default_factory=list)
    draws: list[Draw] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # weight version that produced each output token
    routing: list[torch.Tensor] = field(default_factory=list)  # int32 [n, layers, topk] chunks, one row per fed token
    prompt_logprobs: torch.Tensor | None = None
    prompt_top: tuple[torch.Tensor, torch.Tensor] | None = None  # runner.PrefillResult's
    # Of a request for no new token: the most likely next tokens, [log-prob, id, None] (top_logprobs_num of them)
    next_top: list[list] | None = None
    cached_tokens: int = 0  # of its prompt, reused from the prefix cache
    prefilled: bool = False  # its prompt computed (or taken from the cache) once: an abort before is answered otherwise
    recomputed: bool = False  # prefilled again after a retract: its KV no longer matches the routing it keeps
    finish_reason: dict | None = None
    seed: int | None = None  # what its draws hash with their positions (position_uniform): set at its first prefill

    @property
    def fed_tokens(self) -> list[int]:
        """Tokens whose keys are in the cache once the last sampled token is fed: prompt + output[:-1]."""
        return self.input_ids + self.output_ids[:-1]


# SGLang's finish_reason message for a request aborted in its waiting queue, before its prefill
WAITING_ABORT = "Abort in waiting queue"
RequestT = TypeVar("RequestT", bound=Request)  # what a scheduler queues: Request, or a subclass's own


class Scheduler(Generic[RequestT]):
    def __init__(
        self,
        runner: ModelRunner | None,
        adapters: AdapterSet,
        eos_token_ids: set[int],
        max_length: int,
        max_running: int = 64,
        weight_version: str = "default",
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
    ):
        """``runner``: the model's (None where a subclass computes no tokens); ``max_length``: the context length;
        ``prefix_cache_tokens``: what the prefix cache holds at most (0: none)."""
        self.runner = runner
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.adapters = adapters
        self.eos_token_ids = eos_token_ids
        self.max_running = max_running
        self.weight_version = weight_version
        self.max_length = max_length
        self.waiting: deque[RequestT] = deque()
        self.running: list[RequestT] = []
        self.paused = False
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="moerl-engine", daemon=True)

    # ---- called from other threads ------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: RequestT) -> None:
        self.call(lambda: self.waiting.append(request))

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the engine thread between steps; its result or exception lands in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            self._commands.append((fn, future))
            self._wake.notify()
        return future

    # ---- engine thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                self._wait()
                if self._stop:
                    break
                commands = list(self._commands)
                self._commands.clear()
            self._run(commands)
            if not self.paused:
                self._work()

    def _wait(self) -> None:
        """Under ``_wake``: until there is something to do."""
        while not (self._stop or self._commands or (not self.paused and (self.waiting or self.running))):
            self._wake.wait()

    def _run(self, commands: list[tuple[Callable[[], Any], concurrent.futures.Future]]) -> None:
        for fn, future in commands:
            if not future.set_running_or_notify_cancel():
                continue  # the caller gave up before it ran (its client went away)
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - whatever it raises, the caller gets; the engine keeps serving
                future.set_exception(e)

    def _work(self) -> None:
        """Admit what fits and take one decode step."""
        try:
            self._admit()
            if self.running:
                self._decode_step()
        except BaseException as e:  # a model failure fails the requests in flight, not the server
            log.exception("decode step failed: aborting the %d running request(s)", len(self.running))
            for request in list(self.running) + list(self.waiting):
                self._finish(request, {"type": "abort", "message": f"engine error: {e!r}"})
            self._keep_cache_rows([])
            self.running.clear()
            self.waiting.clear()

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            # A batch shares one merged adapter: a request for another one waits (FIFO) for the
            # batch to drain, then the adapter is switched.
            if self.running and self.waiting[0].lora != self.running[0].lora:
                return
            request = self.waiting.popleft()
            try:
                kv = self._prefill(request)
            except Exception as e:  # this request fails alone; the batch and the queue go on
                log.exception("request %s failed at admission", request.rid)
                self._finish(request, {"type": "abort", "message": f"engine error: {e!r}"})
                continue
            if kv is not None:
                self._model().join(kv)
                self.running.append(request)

    def _model(self) -> ModelRunner:
        """The model's runner: only a scheduler that computes tokens reaches the phases that use it (one without, a
        subclass's, replaces them)."""
        assert self.runner is not None, "this scheduler computes no tokens"
        return self.runner

    def _prefill(self, request: RequestT) -> KV | None:
        """Prefill ``request`` (and sample its first token); its cache to join the batch, or None if it finished."""
        self.adapters.activate(request.lora)
        if request.output_ids:  # retracted earlier: its next token is already sampled
            # The routing of the positions fed before the retract stays what produced their tokens: a re-prefill under
            # weights updated meanwhile routes them otherwise, and the trainer replays what sampled (miles #3277).
            request.recomputed = True
            return self._model().prefill(request.fed_tokens).kv
        cached, prefix = self.cached_prefix(request)
        top = request.top_logprobs_num if request.logprob_start_len is not None else 0
        prefill = self._model().prefill(request.input_ids, request.logprob_start_len, cached, prefix, top)
        request.cached_tokens, request.prefilled = cached, True
        request.routing = [prefill.routing]
        if self.prefix_cache.takes(len(request.input_ids)):
            self.prefix_cache.insert(request.cache_namespace, request.input_ids, prefill.kv, prefill.routing)
        request.prompt_logprobs, request.prompt_top = prefill.prompt_logprobs, prefill.prompt_top
        if request.params.max_new_tokens == 0:
            if request.top_logprobs_num:  # SGLang 0.5.23 answers them (untempered) though it samples no token
                logprobs = torch.log_softmax(prefill.last_logits.float(), -1)
                values, ids = logprobs.topk(min(request.top_logprobs_num, len(logprobs)))
                request.next_top = [[lp, token, None] for lp, token in zip(values.tolist(), ids.tolist(), strict=True)]
            self._finish(request, {"type": "length", "length": 0})
            return None
        if request.seed is None:
            seed = request.params.sampling_seed
            request.seed = seed if seed is not None else random.getrandbits(62)
        (draw,) = sample_batch(
            prefill.last_logits[None],
            [request.params],
            _uniforms([request]),
            [request.return_sampling_mask],
            [request.top_logprobs_num],
        )
        self._accept(request, draw)
        return prefill.kv if request.finish_reason is None else None

    def _accept(self, request: RequestT, draw: Draw) -> None:
        p = request.params
        request.output_ids.append(draw.token)
        request.draws.append(draw)
        request.versions.append(self.weight_version)
        if draw.token in (p.stop_token_ids or ()) or (not p.ignore_eos and draw.token in self.eos_token_ids):
            self._finish(request, {"type": "stop", "matched": draw.token})
        elif len(request.output_ids) >= p.max_new_tokens:
            self._finish(request, {"type": "length", "length": p.max_new_tokens})
        elif len(request.input_ids) + len(request.output_ids) >= self.max_length:
            self._finish(request, {"type": "length", "length": len(request.output_ids)})
        else:
            request.on_update(request, False)

    def _decode_step(self) -> None:
        batch = self.running
        self.adapters.activate(batch[0].lora)  # a weight update in between restores the base
        logits, routing = self._model().decode(
            [r.output_ids[-1] for r in batch], [len(r.input_ids) + len(r.output_ids) - 1 for r in batch]
        )
        draws = sample_batch(
            logits,
            [r.params for r in batch],
            _uniforms(batch),
            [r.return_sampling_mask for r in batch],
            [r.top_logprobs_num for r in batch],
        )
        for i, (request, draw) in enumerate(zip(batch, draws, strict=True)):  # one draw per row
            request.routing.append(routing[i : i + 1])
            self._accept(request, draw)
        self._drop_finished()

    def cached_prefix(self, request: Request) -> tuple[int, CachedPrefix | None]:
        """How much of a new request's prompt the prefix cache holds, as SGLang matches it: the last prompt token is
        always computed (its logits sample the first output), and so is every position from logprob_start_len on (its
        logits give the next token's log-prob; the token there has none)."""
        limit = len(request.input_ids) - 1
        if request.logprob_start_len is not None:
            limit = min(limit, request.logprob_start_len)
        return self.prefix_cache.match(request.cache_namespace, request.input_ids, limit)

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self.running) if r.finish_reason is None]
        if len(keep) != len(self.running):
            for row, request in enumerate(self.running):
                if request.finish_reason is not None and not request.recomputed:
                    self._cache_finished(row, request)
            self._keep_cache_rows(keep)
            self.running = [self.running[i] for i in keep]

    def _cache_finished(self, row: int, request: RequestT) -> None:
        """As SGLang does, a finished request leaves what it fed (its prompt and output but the last token) in the
        cache."""
        fed = request.fed_tokens
        if self.prefix_cache.takes(len(fed)):
            self.prefix_cache.insert(
                request.cache_namespace, fed, self._model().row_kv(row, len(fed)), torch.cat(request.routing)
            )

    def _keep_cache_rows(self, rows: list[int]) -> None:
        self._model().keep_rows(rows)

    def _finish(self, request: RequestT, reason: dict) -> None:
        request.finish_reason = reason
        request.on_update(request, True)

    # ---- control (run through call()) -----------------------------------------------------------
    def abort(self, rid: str | None = None, message: str = "aborted") -> int:
        """Finish matching requests (all when ``rid`` is None; else that request and its n > 1
        completions) with their partial output."""
        return self.abort_these(
            [r for r in list(self.waiting) + self.running if rid is None or rid in (r.rid, r.parent)], message
        )

    def abort_these(self, requests: list[RequestT], message: str) -> int:
        """Finish those of ``requests`` still queued or running with their partial output."""
        hits = [r for r in requests if r.finish_reason is None]
        for request in hits:  # one never prefilled is answered as SGLang answers it (server.meta_info)
            self._finish(request, {"type": "abort", "message": message if request.prefilled else WAITING_ABORT})
        self.waiting = deque(r for r in self.waiting if r.finish_reason is None)
        self._drop_finished()
        return len(hits)

    def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort(message="generation paused with mode abort")
        elif mode == "retract":
            # Keep outputs, drop their KV: they are prefilled again (with whatever weights are live
            # then) when generation continues.
            self.waiting.extendleft(reversed(self.running))
            self.running = []
            self._keep_cache_rows([])
        self.paused = True

    def unload_adapter(self, name: str) -> None:
        users = sum(r.lora == name for r in list(self.waiting) + self.running)
        if users:
            raise LoRAError(f"adapter {name!r} is in use by {users} request(s); abort or wait for them first")
        self.adapters.remove(name)

    def resume(self) -> None:
        self.paused = False

    def idle(self) -> bool:
        """Whether a cache flush is allowed, by SGLang's rule: nothing running, and nothing queued unless
        generation is paused (a retract pause queues what it retracted: those are prefilled again anyway)."""
        return not self.running and (self.paused or not self.waiting)

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) unless idle, as SGLang's."""
        if not self.idle():
            return False
        self.prefix_cache.clear()
        return True


def _uniforms(batch: list[RequestT]) -> list[float]:
    """Each request's uniform for its next token, at the position that token takes (seeds are set at the prefill,
    before a request joins the batch)."""
    uniforms = []
    for r in batch:
        assert r.seed is not None, f"{r.rid} runs without a seed"
        uniforms.append(position_uniform(r.seed, len(r.input_ids) + len(r.output_ids)))
    return uniforms
