"""A simulated engine: the embedded engine's server, routes and scheduler rules with no model computing.

Each request's response length is drawn from the profile's distribution when it is admitted (a function of its prompt
and sampling seed, so a prompt's responses have the profile's correlation, and a continuation of a request, its output
so far fed back, ends where the whole request would); its tokens then accrue at the decode rate the profile gives the
engine's current number of running requests, and nothing accrues while the engine prefills (prompt tokens at the
profile's prefill rate) or is paused, so a long response holds its slot as it would on a GPU. Time may run faster than
real (``time_scale``): the loop sleeps until the next response is due, so a replica idles between events and many fit on
one machine. A finished response carries what SGLang's would, at its true size: token ids, log-probs, per-token weight
versions, the routing of every position at the model's layers and top-k (SGLang's encoding), kept sets of the request's
top-k. Their values are random: the wire, the decoding and the memory are the real costs, the numbers are not a model's.

The control routes are the embedded engine's: pause (abort, retract, in_place), continue, abort, versions, flush,
LoRA adapters (checked against the model's shapes), weight updates checked name by name. The served model is a
``meta``-device transformers model: every name and shape of the real one, no bytes. A broadcast update receives
its bytes (the transport is real) and drops them; a disk update reads the safetensors headers and holds the
engine for the checkpoint's bytes at the profile's weight-update rate. Nothing can be read back: a weight read or
checksum is refused.

The profile's format is :mod:`moerl.simulation`'s.
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import json
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from moerl.dtypes import MODEL_DTYPES
from moerl.engines import protocol
from moerl.engines.delta import Delta
from moerl.engines.embedded.engine import EmbeddedEngine, TokenDetails
from moerl.engines.embedded.lora import AdapterSet
from moerl.engines.embedded.runner import DENSE_LAYER, hub_tensor_view, moe_gates
from moerl.engines.embedded.scheduler import DEFAULT_PREFIX_CACHE_TOKENS, Request, Scheduler
from moerl.engines.protocol import ProtocolError
from moerl.simulation import EngineProfile, Profile

# (layers, top-k, experts, MoE layers) -> the rows of the routing table responses take, and the table encoded
_ROUTING_TABLES: dict[tuple, tuple[int, str]] = {}
# (served model's config, checkpoint directory's files) -> its Hub tensors on the meta device, checked; the last few
# kept. Replicas share the tensors: nothing writes a meta tensor.
_CHECKED_DIRS: dict[tuple[str, tuple], tuple[tuple[str, torch.Tensor], ...]] = {}
_CHECKED_DIRS_LOCK = threading.Lock()
CHECKED_DIRS_KEPT = 4
STREAM_INTERVAL_S = 0.05  # how often a streamed request sends what it decoded since (only these wake the loop)


@dataclass
class SimulatedRequest(Request):
    target: int = -1  # output tokens it ends with (planned at its first admission)
    stop_token: int | None = None  # the token it ends on (None: it runs to its length cap)
    progress: float = 0.0  # output tokens decoded so far, fractional
    # (first output position, weight version) per version change, in its own output's positions
    marks: list[tuple[int, str]] = field(default_factory=list)
    key: int = 0  # of its tokens (_tokens), set when it is planned


class SimulatedScheduler(Scheduler[SimulatedRequest]):
    """The embedded scheduler's queues and control, with time in place of a model (``runner`` is None)."""

    def __init__(
        self,
        profile: EngineProfile,
        time_scale: float,
        vocab_size: int,
        adapters: AdapterSet,
        eos_token_ids: set[int],
        max_length: int,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
    ):
        super().__init__(
            None,
            adapters,
            eos_token_ids,
            max_length,
            profile.max_running_requests,
            prefix_cache_tokens=prefix_cache_tokens,
        )
        self.profile, self.time_scale, self.vocab_size = profile, time_scale, vocab_size
        self._clock = time.monotonic()  # up to when the running requests' progress is counted
        self._prefill_ends = 0.0  # the engine decodes nothing before this (monotonic seconds)

    # ---- the loop's phases ----------------------------------------------------------------------
    def _wait(self) -> None:
        admissible = not self.paused and self.waiting and len(self.running) < self.max_running
        if not (self._stop or self._commands or admissible):
            self._wake.wait(self._until_next_finish())

    def _run(self, commands: list[tuple[Callable[[], Any], concurrent.futures.Future]]) -> None:
        self._advance()  # an abort or a version change sees every token decoded until now
        super()._run(commands)

    def _work(self) -> None:
        self._advance()
        self._admit()

    def _keep_cache_rows(self, rows: list[int]) -> None:
        pass  # no batch cache

    def _cache_finished(self, row: int, request: SimulatedRequest) -> None:
        if self.prefix_cache.takes(len(request.fed_tokens)):
            self.prefix_cache.insert(request.cache_namespace, request.fed_tokens)  # the tokens alone: no KV is computed

    # ---- time ----------------------------------------------------------------------------------
    def _decoding_since(self, now: float) -> float:
        return max(self._clock, self._prefill_ends) if not self.paused else now

    def _advance(self) -> None:
        """Count the tokens decoded since the last call and finish the requests that reached their length."""
        now = time.monotonic()
        start = self._decoding_since(now)
        if self.running and now > start:
            tokens = (now - start) * self.time_scale * self.profile.decode_rate(len(self.running))
            for request in self.running:
                if not request.marks or request.marks[-1][1] != self.weight_version:
                    request.marks.append((int(request.progress), self.weight_version))
                request.progress += tokens
                if request.progress >= request.target:
                    self._finish(
                        request,
                        {"type": "length", "length": request.target}
                        if request.stop_token is None
                        else {"type": "stop", "matched": request.stop_token},
                    )
                elif request.stream and self._decoded(request):
                    request.on_update(request, False)
            self._drop_finished()
        self._clock = now

    def _decoded(self, request: SimulatedRequest, upto: int | None = None) -> bool:
        """Make its output tokens up to ``upto`` (default: as far as it has decoded); whether there are new ones. Each a
        function of its key and position, so a seeded request makes the same tokens however its time is cut."""
        upto = min(int(request.progress), request.target) if upto is None else upto
        new = upto - len(request.output_ids)
        if new > 0:
            start = len(request.input_ids) + len(request.output_ids)
            request.output_ids += _tokens(request.key, start, start + new, self.vocab_size).tolist()
        return new > 0

    def _until_next_finish(self) -> float | None:
        """Real seconds until the first running request is due (None: nothing runs)."""
        if self.paused or not self.running:
            return None
        remaining = min(r.target - r.progress for r in self.running)
        now = time.monotonic()
        simulated = max(remaining, 0.0) / self.profile.decode_rate(len(self.running))
        due = max(self._prefill_ends - now, 0.0) + simulated / self.time_scale
        return min(due, STREAM_INTERVAL_S) if any(r.stream for r in self.running) else due

    def _admit(self) -> None:
        prompt_tokens = 0
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting.popleft()
            if request.lora is not None and request.lora not in self.adapters.adapters:
                message = f"engine error: adapter {request.lora!r} is not loaded"
                self._finish(request, {"type": "abort", "message": message})
                continue
            if request.target < 0:
                self._plan(request)
            request.prefilled = True
            if request.target == 0:
                self._finish(request, {"type": "length", "length": 0})
                continue
            if request.progress:  # retracted: prefilled again whole
                prompt_tokens += len(request.input_ids) + int(request.progress)
                request.recomputed = True
            else:  # the prefix cache's part of its prompt is not computed
                request.cached_tokens = self.cached_prefix(request)[0]
                prompt_tokens += len(request.input_ids) - request.cached_tokens
                self.prefix_cache.insert(request.cache_namespace, request.input_ids)
            self.running.append(request)
        if prompt_tokens:
            now = time.monotonic()
            prefill_s = prompt_tokens / self.profile.prefill_tokens_per_s / self.time_scale
            self._prefill_ends = max(self._prefill_ends, now) + prefill_s

    def _plan(self, request: SimulatedRequest) -> None:
        """Its tokens and its length. A token is a function of the request's key (its sampling seed) and its absolute
        position in the sequence, so a continuation (the prompt and the first k tokens a simulated engine made for the
        same seed, on any replica) is recognised: the longest suffix of its input that is the key's tokens at those
        positions is output already, the rest is the prompt. A prompt's last tokens match by chance with probability
        1/vocab each (negligible at a real vocabulary), and then match alike in the request it continues: the split
        is the same either way. The sample's whole length comes from the prompt and the seed (the profile's
        ResponseLengths); the request ends where the sample stops (its stop token the last), or at its cap
        (max_new_tokens, the context) if that comes first. A seeded request, and a greedy one (same prompt, same
        weights), is the same each time and continues exactly (a greedy one's tokens are its weight version's, its
        length its prompt's and version's); an unseeded sampled one is random. An episode's later turn (its tool's
        tokens last) is a prompt of its own."""
        p = request.params
        greedy = p.sampling_seed is None and p.top_k == 1
        if p.sampling_seed is not None:
            request.key = p.sampling_seed % 2**64
        elif greedy:
            request.key = _digest(b"greedy", self.weight_version)
        else:
            request.key = secrets.randbits(64)
        ids = np.asarray(request.input_ids, dtype=np.int64)
        differs = np.flatnonzero(ids != _tokens(request.key, 0, len(ids), self.vocab_size))
        prompt = ids[: differs[-1] + 1 if len(differs) else 0]
        seed = _digest(prompt.tobytes(), self.weight_version) if greedy else request.key
        left = math.ceil(self.profile.response_tokens.tokens(prompt, seed)) - (len(ids) - len(prompt))
        left = max(left, 1)  # (an input that is past the sample's end, by chance: it stops at once)
        cap = max(min(p.max_new_tokens, self.max_length - len(ids)), 0)
        stop_ids = ([] if p.ignore_eos else sorted(self.eos_token_ids)) + list(p.stop_token_ids or [])
        request.stop_token = stop_ids[0] if stop_ids and left <= cap else None
        request.target = left if request.stop_token is not None else cap

    def _finish(self, request: SimulatedRequest, reason: dict) -> None:
        """Its tokens made to the end: all of them, or those decoded before an abort."""
        if request.target >= 0:
            if reason["type"] == "abort":
                self._decoded(request)
            else:
                self._decoded(request, request.target - (request.stop_token is not None))
                if request.stop_token is not None:
                    request.output_ids.append(request.stop_token)
        super()._finish(request, reason)


class SimulatedEngine(EmbeddedEngine[SimulatedRequest]):
    engine_name = "moerl-simulated"
    request_type = SimulatedRequest

    def __init__(
        self,
        profile: Profile,
        model_dir: str,
        time_scale: float = 1.0,
        sampling_mask_max_tokens: int = protocol.DEFAULT_SAMPLING_MASK_MAX_TOKENS,
        prefix_cache_tokens: int | None = None,
    ):
        """``model_dir``: the Hub model (its config.json and tokenizer): the profile's, or one in its place;
        ``prefix_cache_tokens``: the profile's (``engine.prefix_cache_tokens``) unless given, else the embedded
        engine's default."""
        if not time_scale > 0:
            raise ProtocolError(f"time_scale must be > 0, got {time_scale}")
        self.profile, self.time_scale = profile, time_scale
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):  # names and shapes, no bytes
            model = AutoModelForCausalLM.from_config(config, dtype=MODEL_DTYPES[profile.dtype])
        self._moe_layers = list(moe_gates(model, model_dir))
        self.num_experts = getattr(config, "num_experts", None) or config.num_local_experts
        self._disk_update_began = 0.0  # monotonic seconds
        if prefix_cache_tokens is None:
            prefix_cache_tokens = profile.engine.prefix_cache_tokens
        cache_tokens = DEFAULT_PREFIX_CACHE_TOKENS if prefix_cache_tokens is None else prefix_cache_tokens
        self._serve(
            model_dir,
            model,
            lambda adapters, eos_ids, max_length: SimulatedScheduler(
                profile.engine, time_scale, config.vocab_size, adapters, eos_ids, max_length, cache_tokens
            ),
            sampling_mask_max_tokens,
        )

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def moe_layers(self) -> list[int]:
        return self._moe_layers

    # ---- responses ---------------------------------------------------------------------------
    def token_details(self, request: Request, req: protocol.GenerateReqInput) -> TokenDetails:
        """Random values at their true sizes; a token's log-prob is at most its log-prob over its kept set."""
        assert isinstance(request, SimulatedRequest), "this engine makes SimulatedRequests (request_type)"
        n = len(request.output_ids)
        rng = np.random.default_rng()
        details = TokenDetails(_token_versions(request.marks, n))
        params = request.params
        if req.return_sampling_mask:
            if params.top_p >= 1 and params.min_p == 0:
                kept_sizes = np.full(n, params.top_k)
            else:
                kept_sizes = rng.integers(1, params.top_k + 1, n)
            tokens = np.asarray(request.output_ids, dtype=np.int64)
            kept_ids, kept_logprobs, selected = self._kept_sets(rng, tokens, kept_sizes)
            mask_logprobs = selected if req.sampling_logprobs_mode == "selected" else kept_logprobs
            details.sampling_mask = kept_ids, mask_logprobs
        else:
            selected = -rng.exponential(1.0, n)
        if req.return_logprob:
            truncated = 0 < params.top_k < self.model.config.vocab_size or params.top_p < 1 or params.min_p > 0
            full = selected + (np.log(rng.uniform(0.5, 1.0, n)) if truncated else 0.0)
            start = len(request.input_ids) if request.logprob_start_len is None else request.logprob_start_len
            prompt: list[float | None] = (-rng.exponential(2.0, len(request.input_ids) - start)).tolist()
            if prompt:
                prompt[0] = None  # SGLang computes none for the token at logprob_start_len
            details.logprobs = full.tolist(), prompt
        if req.return_routed_experts:
            details.routing = self._routing(max(len(request.input_ids) + n - 1 - req.routed_experts_start_len, 0))
        return details

    def _routing(self, rows: int) -> str:
        """``rows`` positions of distinct top-k experts at every MoE layer (dense layers: -1), as an answer carries them
        (SGLang's base64 of int32 rows): the first rows of one random table that every replica of this process shares,
        grown as needed and encoded once. Drawing and encoding tens of MB per response would cost the replicas' shared
        CPU more than the response is meant to (a 32K-token response of Qwen3-30B-A3B carries 50 MB), and a table per
        replica would cost each replica as much memory."""
        config = self.model.config
        layers, topk = config.num_hidden_layers, config.num_experts_per_tok
        shape = (layers, topk, self.num_experts, tuple(self._moe_layers))
        size, encoded = _ROUTING_TABLES.get(shape, (0, ""))
        if rows > size:
            size = max(rows, 2 * size)
            table = np.full((size, layers, topk), DENSE_LAYER, dtype=np.int32)
            stride = np.arange(topk, dtype=np.int32) * max(self.num_experts // topk, 1)  # distinct modulo the experts
            start = np.random.default_rng(0).integers(0, self.num_experts, (size, len(self._moe_layers), 1), np.int32)
            table[:, self._moe_layers] = (start + stride) % self.num_experts
            encoded = protocol.encode_routed_experts(table)
            _ROUTING_TABLES[shape] = size, encoded  # two replicas growing it at once both make one: either is kept
        # Every 3 bytes are 4 characters: the prefix's whole groups are the table's, its last bytes encoded alone.
        length = rows * layers * topk * 4
        whole = length // 3
        rest = base64.b64decode(encoded[4 * whole : 4 * whole + 4])[: length - 3 * whole]
        return encoded[: 4 * whole] + base64.b64encode(rest).decode("ascii")

    def _kept_sets(
        self, rng: np.random.Generator, tokens: np.ndarray, sizes: np.ndarray
    ) -> tuple[np.ndarray | list[np.ndarray], np.ndarray | list[np.ndarray], np.ndarray]:
        """Each token's kept set (ascending ids that include it), its log-probs over the set, and the token's own; drawn
        for all tokens at once (a per-token loop costs a second per 32K-token response). Kept as arrays, rows of one
        when the sizes differ, which the answer's JSON writes as the lists they hold: as lists they cost an 8K-token
        response 0.1 s of the replicas' shared CPU, eight times the drawing."""
        vocab, widest = self.model.config.vocab_size, int(sizes.max(initial=1))
        column = np.arange(widest)
        inside = column < sizes[:, None]
        # Distinct ids, each row padded with vocab past its size.
        ids = np.where(inside, (tokens[:, None] + column * max(vocab // widest, 1)) % vocab, vocab)
        order = np.argsort(ids, axis=1, kind="stable")
        ids = np.take_along_axis(ids, order, axis=1)
        logits = np.where(inside, rng.standard_normal(ids.shape), -np.inf)
        logprobs = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
        selected = logprobs[np.arange(len(tokens)), np.argmax(order == 0, axis=1)]  # column 0 holds the token itself
        if (sizes == widest).all():
            return ids, logprobs, selected
        rows = sizes.tolist()
        return (
            [r[:k] for r, k in zip(ids, rows, strict=True)],
            [r[:k] for r, k in zip(logprobs, rows, strict=True)],
            selected,
        )

    # ---- weights -----------------------------------------------------------------------------
    def read_model_dir(self, path: str) -> list[tuple[str, torch.Tensor]]:
        """The checkpoint's names and shapes, from its safetensors headers (no tensor is read). The headers of one
        directory's files are checked once for every replica of this process: each GPU engine checks its own beside the
        others, where here the replicas would take turns on the same CPU (12 replicas of Qwen3-30B-A3B: 11-16 s, against
        the profile's 8 s update)."""
        self._disk_update_began = time.monotonic()
        files = _directory_files(path)
        if files is None:  # not a readable directory: the check says what is wrong
            self.model_dir_reader(path)
        key = (json.dumps(self.hub_config, sort_keys=True, default=str), (os.path.realpath(path), files))
        with _CHECKED_DIRS_LOCK:
            checked = _CHECKED_DIRS.get(key)
            if checked is None:
                _, dtype = self.model_dir_reader(path)
                checked = _CHECKED_DIRS[key] = tuple(
                    (name, torch.empty(shape, dtype=dtype, device="meta"))
                    for name, shape in self.family.hub_shapes(self.hub_config).items()
                )
                while len(_CHECKED_DIRS) > CHECKED_DIRS_KEPT:
                    del _CHECKED_DIRS[next(iter(_CHECKED_DIRS))]
        return list(checked)

    def write_weights(self, pairs: list[tuple[torch.Tensor, torch.Tensor | Delta]]) -> None:
        """A disk update takes its bytes' time at the profile's rate, counted from when it began, so the headers' checks
        (real CPU here, once a process) do not add to it; a broadcast's bytes already came."""
        from_disk = sum(
            src.numel() * src.element_size() for _, src in pairs if isinstance(src, torch.Tensor) and src.is_meta
        )
        due = from_disk / (self.profile.engine.weight_update_gb_per_s * 1e9) / self.time_scale
        time.sleep(max(due - (time.monotonic() - self._disk_update_began), 0.0))

    def weight_values(self, name: str, truncate_size: int) -> list | None:
        if hub_tensor_view(self.family, dict(self.model.named_parameters()), name) is None:
            return None
        raise ProtocolError(
            "the simulated engine holds no weights to read back (run sync.verify against a real engine)"
        )

    def checksum(self) -> str:
        raise ProtocolError("the simulated engine holds no weights to checksum (run sync.verify against a real engine)")


def _directory_files(path: str) -> tuple[tuple[str, int, int, int], ...] | None:
    """Each file of the directory ``path`` as (name, size, modification time in ns, inode): rewriting one changes it.
    None if ``path`` cannot be listed."""
    try:
        with os.scandir(path) as entries:
            stats = [(entry.name, entry.stat()) for entry in entries]
    except OSError:
        return None
    return tuple(sorted((name, st.st_size, st.st_mtime_ns, st.st_ino) for name, st in stats))


def _tokens(key: int, start: int, stop: int, vocab: int) -> np.ndarray:
    """The tokens at absolute positions ``start`` to ``stop`` of a request with this key: SplitMix64 of the key and the
    position, modulo the vocabulary. Counter-based, so any stretch is made alone, in any process."""
    positions = np.arange(start, stop, dtype=np.uint64)
    base = _mix(np.array([key], dtype=np.uint64))  # arrays throughout: numpy's uint64 arrays wrap silently
    return (_mix(base + positions * np.uint64(0x9E3779B97F4A7C15)) % np.uint64(vocab)).astype(np.int64)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: each 64-bit input to a well-spread 64-bit output."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _digest(data: bytes, version: str) -> int:
    """A 64-bit key from ``data`` and a weight version: a greedy request's tokens and length."""
    return int.from_bytes(hashlib.sha256(data + b"|" + version.encode()).digest()[:8], "little")


def _token_versions(marks: list[tuple[int, str]], n: int) -> list[str]:
    """The weight version of each of the ``n`` output positions, from the marks (each version from its position on)."""
    versions: list[str] = []
    for i, (_, version) in enumerate(marks):
        end = min(marks[i + 1][0] if i + 1 < len(marks) else n, n)
        versions += [version] * max(end - len(versions), 0)
    return versions
