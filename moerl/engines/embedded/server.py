"""The embedded engine's HTTP server: SGLang's RL routes over moerl's scheduler (``moerl serve``).

Every body is parsed with the route's type from :mod:`moerl.engines.protocol` before anything happens,
so a bad request is a JSON 400 naming the field and never reaches the model. Weight updates check every
name and shape (and read every tensor) before the first write: a refused update leaves the served
weights and version as they were. Slow control work runs in pools of its own (group joins, broadcasts,
disk loads, adapter loads), so one stuck join cannot starve the others; the model belongs to the
scheduler's thread alone.

:class:`EmbeddedEngine` does the work; :class:`EngineServer` gives each route a method over it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hashlib
import json
import logging
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar, Unpack

import numpy as np
import torch
from aiohttp import web
from transformers import PreTrainedModel

from moerl.checkpoint.hf import HFReader, check_hf_tensors, read_config
from moerl.engines import protocol
from moerl.engines.embedded.lora import AdapterSet
from moerl.engines.embedded.runner import ModelRunner, hub_tensor_targets, hub_tensor_view
from moerl.engines.embedded.scheduler import DEFAULT_PREFIX_CACHE_TOKENS, Request, RequestT, Scheduler
from moerl.engines.protocol import ProtocolError
from moerl.engines.tensor_ipc import load_payload
from moerl.engines.weight_group import (
    bucket_layout,
    in_daemon_thread,
    join_weight_group,
    unflatten_bucket,
    weight_store,
)
from moerl.errors import MoerlError
from moerl.models import family_for

log = logging.getLogger("moerl.serve")
DISCONNECT_POLL_S = 1.0  # how often a waiting /generate checks that its client is still there (SGLang: 4 s)
STORE_PROBE_S = 5.0  # a weight group's store that does not accept a connection in this long is unreachable
MAX_JOINING = 16  # weight-group joins waiting for their peers at once
# A finished completion larger than this waits for the rest of its n in an unnamed temporary file, not in memory: at
# true routing size each is tens of MB (a simulated 32K-token Qwen3-30B-A3B response: over 50 MB), and the simulated
# engines of a 96-GPU pool hold thousands of them on one machine. Disk pages the kernel may write back and drop.
SPILL_BYTES = 4 << 20
SEND_CHUNK_BYTES = 4 << 20  # a spilled completion goes back to the socket this much at a time
_dumps = functools.partial(json.dumps, allow_nan=False)  # a NaN in a response is a bug, never invalid JSON on the wire
T = TypeVar("T")
WireModelT = TypeVar("WireModelT", bound=protocol.WireModel)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


@dataclass
class TokenDetails:
    """What an answer tells of a completion's tokens besides their ids; a part is None unless its request asked for it.
    Each engine makes them its own way (:meth:`EmbeddedEngine.token_details`); the answer is built from them alike."""

    versions: list[str]  # each output token's weight version
    # The output tokens' log-probs, and the prompt's from logprob_start_len (None: the first prompt token's).
    logprobs: tuple[list[float], list[float | None]] | None = None
    routing: np.ndarray | None = None  # int32 [positions, layers, top-k], from routed_experts_start_len
    # Each output token's kept set, and the log-probs over it that the request's sampling_logprobs_mode asks for.
    sampling_mask: tuple[list[list[int]], list] | None = None
    top_logprobs: list[list[list]] | None = None  # each output token's most likely tokens: [log-prob, id, None]


class EmbeddedEngine(Generic[RequestT]):
    """Owns the model runner, the scheduler and the tokenizer; builds SGLang-shaped responses. Generic over what its
    scheduler queues: :class:`Request`, or a subclass's own."""

    engine_name = "moerl-embedded"  # /server_info's engine
    request_type: type[RequestT]  # what make_requests queues

    def __init__(
        self: EmbeddedEngine[Request],
        model_dir: str,
        dtype: torch.dtype = torch.float32,
        device: str | None = None,
        max_running: int = 64,
        sampling_mask_max_tokens: int = protocol.DEFAULT_SAMPLING_MASK_MAX_TOKENS,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
        weights_cpu_backup: bool = False,
    ):
        self.request_type = Request
        self.runner = ModelRunner(model_dir, dtype, device)
        self._serve(
            model_dir,
            self.runner.model,
            lambda adapters, eos_ids, max_length: Scheduler(
                self.runner, adapters, eos_ids, max_length, max_running, prefix_cache_tokens=prefix_cache_tokens
            ),
            sampling_mask_max_tokens,
            weights_cpu_backup,
        )

    def _serve(
        self,
        model_dir: str,
        model: PreTrainedModel,
        scheduler: Callable[[AdapterSet, set[int], int], Scheduler[RequestT]],
        sampling_mask_max_tokens: int,
        weights_cpu_backup: bool = False,
    ) -> None:
        """What serving needs besides the computation: ``model`` (the served transformers model: names, shapes,
        device, dtype) and ``scheduler(adapters, eos_ids, max_length)``, which makes the scheduler; with
        ``weights_cpu_backup`` released weights come back as they were (:class:`MemoryOccupation`)."""
        self.model_dir, self.model = model_dir, model
        self.tokenizer = load_tokenizer(model_dir)
        config = model.config
        raw = read_config(model_dir)
        self.family = family_for(raw)
        self.hub_config = self.family.normalize(raw)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None) or config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        max_length = getattr(config, "max_position_embeddings", 1 << 30)
        self.scheduler = scheduler(AdapterSet(model, self.family), eos_ids, max_length)
        self.limits = protocol.EngineLimits(config.vocab_size, self.scheduler.max_length, sampling_mask_max_tokens)
        self.memory = MemoryOccupation(model, weights_cpu_backup)
        self.weight_groups: dict[str, object] = {}
        self.joining: set[str] = set()
        self.update_session = False  # between /begin_weight_update and /end_weight_update
        # Slow loads, each kind in its own thread, so a large disk load does not hold up an adapter. Group
        # joins and broadcasts run in daemon threads of their own (weight_group.in_daemon_thread): a peer
        # that never comes keeps one waiting until the group's timeout, holding up nothing else, not even exit.
        self.pools = {
            kind: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"moerl-{kind}")
            for kind in ("disk", "lora", "tensor")
        }

    @property
    def adapters(self) -> AdapterSet:
        return self.scheduler.adapters

    @property
    def device(self) -> torch.device:
        """Where weight broadcasts are received."""
        return self.runner.device

    @property
    def moe_layers(self) -> list[int]:
        return self.runner.moe_layers

    # ---- /generate --------------------------------------------------------------------------
    def generate(self, body: dict) -> list[protocol.GenerateResponse]:
        """A /generate body served in-process, blocking, without HTTP (library use, tests): one
        SGLang-shaped response per completion. The scheduler must be running."""
        req = protocol.GenerateReqInput.parse(body)
        finished = threading.Semaphore(0)
        requests = self.make_requests(req, lambda r, done: finished.release() if done else None)
        for r in requests:
            self.scheduler.submit(r)
        for _ in requests:
            finished.acquire()
        return [self.response(r, req) for r in requests]

    def make_requests(
        self, req: protocol.GenerateReqInput, on_update: Callable[[Request, bool], None]
    ) -> list[RequestT]:
        """The scheduler's requests for one /generate: ``n`` completions, checked against the served model."""
        if req.input_ids is None:
            if self.tokenizer is None:
                raise ProtocolError(f"{self.model_dir} has no tokenizer: send input_ids instead of text")
            try:
                prompt = self.tokenizer(req.text)["input_ids"]
            except UnicodeError as e:
                raise ProtocolError(f"text is not valid Unicode: {e}") from None
            if not prompt:
                raise ProtocolError("text tokenizes to no tokens")
        else:
            prompt = list(req.input_ids)
        protocol.check_generate(req, prompt, self.limits)
        if req.lora_path is not None and req.lora_path not in self.adapters.adapters:
            if req.lora_path in self.adapters.unloaded:
                raise ProtocolError(f"LoRA adapter {req.lora_path!r} is not loaded (it was unloaded)")
            raise ProtocolError(f"{protocol.ADAPTER_NEVER_LOADED}: {req.lora_path}")
        params = req.sampling_params.resolved()
        rid = req.rid or uuid.uuid4().hex
        requests = []
        for i in range(params.n):
            seed = None if params.sampling_seed is None else params.sampling_seed + i
            requests.append(
                self.request_type(
                    rid=rid if params.n == 1 else f"{rid}-{i}",
                    parent=None if params.n == 1 else rid,
                    input_ids=prompt,
                    params=params.model_copy(update={"sampling_seed": seed}),
                    # SGLang's -1: the output tokens' log-probs alone
                    logprob_start_len=req.logprob_start_len
                    if req.return_logprob and req.logprob_start_len >= 0
                    else None,
                    return_routed_experts=req.return_routed_experts,
                    return_sampling_mask=req.return_sampling_mask,
                    top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,  # SGLang: logprobs' extra
                    lora=req.lora_path,
                    stream=req.stream,
                    on_update=on_update,
                    cache_namespace=(req.extra_key or None, req.cache_salt or None, req.lora_path),
                )
            )
        return requests

    def meta_info(self, request: Request, versions: list[str]) -> protocol.GenerateMetaInfo:
        """What every answer's meta_info holds; ``versions``: each output token's weight version."""
        spans = protocol.version_spans(versions)
        meta: protocol.GenerateMetaInfo = {
            "id": request.rid,
            "finish_reason": request.finish_reason,
            "completion_tokens": len(request.output_ids),
            "weight_version": spans[-1]["version"] if spans else self.scheduler.weight_version,
            "weight_versions": spans,
        }
        if request.prefilled:  # SGLang answers one aborted in its waiting queue without these
            meta["prompt_tokens"], meta["cached_tokens"] = len(request.input_ids), request.cached_tokens
        return meta

    def response(self, request: Request, req: protocol.GenerateReqInput) -> protocol.GenerateResponse:
        """SGLang's answer for ``request``: its tokens, and what ``req`` asked to know of them (``token_details``)."""
        details = self.token_details(request, req)
        meta = self.meta_info(request, details.versions)
        output_ids = request.output_ids
        if details.logprobs is not None:
            output, prompt = details.logprobs
            start = len(request.input_ids) if request.logprob_start_len is None else request.logprob_start_len
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(output, output_ids, strict=True)]
            # Not strict: a request aborted before its prefill has no prompt log-probs.
            meta["input_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(prompt, request.input_ids[start:], strict=False)
            ]
        if details.routing is not None and request.prefilled:
            meta["routed_experts"] = protocol.encode_routed_experts(details.routing)
        if details.sampling_mask is not None:
            kept_ids, kept_logprobs = details.sampling_mask
            meta["output_token_sampling_mask"] = kept_ids
            meta["output_token_sampling_mask_length"] = len(kept_ids)
            meta["output_token_sampling_logprobs"] = kept_logprobs
        if details.top_logprobs is not None:
            meta["output_top_logprobs"] = details.top_logprobs
        text = self.tokenizer.decode(output_ids) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": list(output_ids), "meta_info": meta}

    def token_details(self, request: Request, req: protocol.GenerateReqInput) -> TokenDetails:
        """What ``req`` asked to know of ``request``'s tokens: from its draws, its prefill and the model's routing."""
        details = TokenDetails(request.versions)
        if req.return_logprob:
            prompt = (
                []
                if request.prompt_logprobs is None
                else [
                    None if lp != lp else float(lp)  # the first prompt token has no log-prob
                    for lp in request.prompt_logprobs.tolist()
                ]
            )
            details.logprobs = [d.logprob for d in request.draws], prompt
        if req.return_routed_experts:
            rows = (
                torch.cat(request.routing)
                if request.routing
                else torch.zeros(0, self.runner.num_layers, self.runner.topk, dtype=torch.int32)
            )
            end = len(request.input_ids) + len(request.output_ids) - 1
            details.routing = rows[req.routed_experts_start_len : max(end, 0)].numpy()
        if req.return_sampling_mask:
            selected = req.sampling_logprobs_mode == "selected"
            kept_ids, kept_logprobs = [], []
            for d in request.draws:
                assert d.kept_ids is not None and d.kept_logprobs is not None  # drawn for a request asking for masks
                kept_ids.append(d.kept_ids.tolist())
                kept_logprobs.append(d.selected_logprob if selected else d.kept_logprobs.tolist())
            details.sampling_mask = kept_ids, kept_logprobs
        if req.return_logprob and req.top_logprobs_num:
            details.top_logprobs = [
                [[lp, token, None] for lp, token in zip(d.top_logprobs or [], d.top_ids or [], strict=True)]
                for d in request.draws
            ]
        return details

    # ---- memory occupation (colocated training) ------------------------------------------------
    def release_memory(self, tags: frozenset[str]) -> set[str]:
        """On the engine thread: give back the memory of ``tags`` (the prefix cache's KV, the weights; no CUDA graphs
        are captured here), as SGLang does only while nothing runs: after a pause with abort or retract (retracted
        requests wait without KV). The weights as :class:`MemoryOccupation` keeps them. The tags newly released."""
        sched = self.scheduler
        if sched.running or not sched.paused:
            raise ProtocolError(
                "memory is released only while nothing runs: pause generation with mode abort or retract first"
            )
        if "kv_cache" in tags:
            sched.prefix_cache.clear()
        return self.memory.release(tags)

    def resume_memory(self, tags: frozenset[str]) -> set[str]:
        """On the engine thread: take back the memory of ``tags``; the tags resumed."""
        return self.memory.resume(tags)

    @property
    def released(self) -> set[str]:
        return self.memory.released

    def check_weights_held(self, refused: str) -> None:
        if "weights" in self.released:
            raise ProtocolError(
                f"{refused}: the weights are released; resume them first (/resume_memory_occupation with tags "
                '["weights"])'
            )

    # ---- weights -----------------------------------------------------------------------------
    def read_model_dir(self, path: str) -> list[tuple[str, torch.Tensor]]:
        """Every Hub tensor of the served model from the HF directory ``path``, all read before any is used:
        a directory that is not this model (missing, extra or misshapen tensors, a damaged file) is refused."""
        reader, _ = self.model_dir_reader(path)
        return [(name, reader.get(name)) for rule in self.family.all_rules(self.hub_config) for name in rule.hf]

    def model_dir_reader(self, path: str) -> tuple[HFReader, torch.dtype]:
        """A reader of the HF directory ``path`` and its dtype, once its headers say it is the served model."""
        directory = Path(path)
        if not directory.is_dir():
            raise ProtocolError(f"model_path {path!r} is not a directory")
        reader = HFReader(directory)
        return reader, check_hf_tensors(reader, self.family, self.hub_config)

    def check_flush(self, flush: bool, abort_all: bool, refused: str) -> None:
        """SGLang's rule: an update cannot flush the cache while requests run, unless it aborts them."""
        if flush and not abort_all and not self.scheduler.idle():
            raise ProtocolError(
                f"{refused}: the cache cannot be flushed while requests are running "
                "(send flush_cache=false during an in_place pause, or pause with abort or retract)"
            )

    def apply_weights(
        self, named: list[tuple[str, torch.Tensor]], version: str | None, abort_all: bool, flush: bool
    ) -> None:
        """On the engine thread: write ``named`` (Hub names) into the model, all checked first."""
        sched = self.scheduler
        self.check_weights_held("weights not updated")
        pairs = hub_tensor_targets(self.family, self.model, named)
        self.check_flush(flush, abort_all, "weights not updated")
        if abort_all:
            sched.abort(message="weights updated")
        self.write_weights(pairs)
        if flush:  # checked above: nothing runs
            sched.prefix_cache.clear()
        if version is not None:
            sched.weight_version = version

    def write_weights(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src)

    def weight_values(self, name: str, truncate_size: int) -> list | None:
        """The first ``truncate_size`` rows of the Hub tensor ``name`` as served (None: not a weight of the model)."""
        self.check_weights_held("no weights to read")
        view = hub_tensor_view(self.family, dict(self.model.named_parameters()), name)
        return None if view is None else view[:truncate_size].float().cpu().tolist()

    def checksum(self) -> str:
        """SGLang's CPU hash: sha256 of each tensor's bytes, then of the names and hashes."""
        self.check_weights_held("no weights to hash")
        digest = hashlib.sha256()
        for name, param in sorted(self.model.named_parameters()):
            data = param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data  # its bytes, uncopied
            tensor = hashlib.sha256(data).hexdigest()[:16]
            digest.update(name.encode())
            digest.update(tensor.encode())
        return digest.hexdigest()

    def join_group(self, req: protocol.InitWeightsUpdateGroupReqInput) -> object:
        try:  # fail fast where nothing listens, instead of waiting out the store's timeout
            socket.create_connection((req.master_address, req.master_port), timeout=STORE_PROBE_S).close()
        except OSError as e:
            raise ProtocolError(
                f"weight group {req.group_name!r}: cannot reach the trainer's store at "
                f"{req.master_address}:{req.master_port} ({e})"
            ) from None
        try:
            store = weight_store(req.master_address, req.master_port, req.world_size, req.rank_offset)
            return join_weight_group(req.backend, store, req.world_size, req.rank_offset, req.group_name)
        except RuntimeError as e:  # the rendezvous failed or timed out (torch's DistError and its kin)
            raise ProtocolError(
                f"weight group {req.group_name!r}: could not join as rank {req.rank_offset}: {e}"
            ) from None

    def receive(self, req: protocol.UpdateWeightsFromDistributedReqInput, group) -> list[tuple[str, torch.Tensor]]:
        import torch.distributed as dist

        device = self.device
        if req.load_format == "flattened_bucket":
            spans = bucket_layout(req.dtypes, req.shapes)
            flat = torch.empty(spans[-1][1], dtype=torch.uint8, device=device)
            dist.broadcast(flat, 0, group)
            return unflatten_bucket(flat, req.names, req.dtypes, req.shapes)
        named = [
            (n, torch.empty(s, dtype=getattr(torch, d), device=device))
            for n, d, s in zip(req.names, req.dtypes, req.shapes, strict=True)
        ]
        for _, tensor in named:
            dist.broadcast(tensor, 0, group)
        return named

    # ---- info --------------------------------------------------------------------------------
    def model_info(self) -> protocol.ModelInfo:
        return {
            "model_path": self.model_dir,
            "tokenizer_path": self.model_dir if self.tokenizer is not None else None,
            "is_generation": True,
            "weight_version": self.scheduler.weight_version,
            "num_hidden_layers": self.model.config.num_hidden_layers,
            "moe_layers": self.moe_layers,
            "num_experts_per_tok": self.model.config.num_experts_per_tok,
            "vocab_size": self.model.config.vocab_size,
        }


def load_tokenizer(model_dir: str | Path):
    """The HF directory's tokenizer, None where it has none."""
    if not (Path(model_dir) / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def server_info(engine_name: str, model: PreTrainedModel) -> protocol.ServerInfo:
    """/server_info of a moerl engine (one rank) serving ``model``."""
    from moerl import __version__

    return {
        "tp_size": 1,
        "version": __version__,
        "engine": engine_name,
        "dtype": str(model.dtype).removeprefix("torch."),
        "torch_version": torch.__version__,
    }


class MemoryOccupation:
    """What /release_memory_occupation and /resume_memory_occupation have done to a served model: the tags released
    (until resumed), and its weights. Released, the weights' device memory is given back; resumed, they hold what they
    held where the server keeps a host copy (``cpu_backup``: SGLang's ``--enable-weights-cpu-backup``, for a model no
    push reaches, such as a reward model's), and are uninitialised until a push otherwise."""

    def __init__(self, model: torch.nn.Module, cpu_backup: bool):
        self.model, self.cpu_backup = model, cpu_backup
        self.released: set[str] = set()
        # while released: each weight's host copy (on the CPU, the tensor itself), or its shape
        self.held: dict[torch.nn.Parameter, torch.Tensor | torch.Size] = {}

    def release(self, tags: frozenset[str]) -> set[str]:
        """The tags newly released."""
        new = set(tags - self.released)
        if "weights" in new:
            for p in self.model.parameters():
                self.held[p] = p.data.to("cpu") if self.cpu_backup else p.shape
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.released |= new
        give_back_freed_memory()
        return new

    def resume(self, tags: frozenset[str]) -> set[str]:
        """The tags resumed; a tag not released is refused, as SGLang's scheduler fails on one."""
        if not_released := sorted(tags - self.released):
            raise ProtocolError(
                f"tags {', '.join(not_released)} were not released: resume only what /release_memory_occupation "
                "released (SGLang's scheduler fails on the others)"
            )
        back = set(tags)
        if "weights" in back:
            for p, held in self.held.items():
                if isinstance(held, torch.Tensor):
                    p.data = held.to(p.device)
                else:
                    p.data = torch.empty(held, dtype=p.dtype, device=p.device)
            self.held = {}
        self.released -= back
        return back


def give_back_freed_memory() -> None:
    """Return the heap's freed pages to the OS: tensors below glibc's mmap threshold are freed into the heap, where
    they would stay resident (the non-PyTorch memory left after an offload that verl #5979 reports); and on a GPU the
    caching allocator's freed blocks to the device."""
    import ctypes
    import ctypes.util

    if (libc := ctypes.util.find_library("c")) is not None and hasattr(lib := ctypes.CDLL(libc), "malloc_trim"):
        lib.malloc_trim(0)
    if torch.cuda.is_initialized():  # and the caching allocator's to the device, where another process can take it
        torch.cuda.empty_cache()


@contextlib.contextmanager
def refused_path(field: str, path: str):
    """What the OS says of a path a request gave (too long, not readable, ...) as that field's refusal."""
    try:
        yield
    except OSError as e:
        shown = path if len(path) <= 200 else f"{path[:200]}... ({len(path)} characters)"
        raise ProtocolError(f"{field} {shown!r}: {e.strerror or e}") from None


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class _Spilled:
    """A finished completion's serialized answer held in an unnamed temporary file (gone with the process) until its
    request's other completions finish."""

    def __init__(self, data: bytes):
        self.size = len(data)
        self.file = tempfile.TemporaryFile()
        self.file.write(data)

    def __len__(self) -> int:
        return self.size

    def chunks(self):
        """Its bytes, SEND_CHUNK_BYTES at a time; the file is closed after the last."""
        try:
            self.file.seek(0)
            while chunk := self.file.read(SEND_CHUNK_BYTES):
                yield chunk
        finally:
            self.close()

    def close(self) -> None:
        self.file.close()


# ---- the HTTP server ------------------------------------------------------------------------------
def build_app(engine: EmbeddedEngine[RequestT]) -> web.Application:
    """``engine`` served over HTTP: SGLang's routes; its scheduler runs while the app does."""
    return EngineServer(engine).app()


class EngineServer(Generic[RequestT]):
    """The routes over one engine: each a method named after its route (the route table is :meth:`app`'s)."""

    def __init__(self, engine: EmbeddedEngine[RequestT]):
        self.engine = engine
        self.sched = engine.scheduler

    def app(self) -> web.Application:
        P = protocol
        app = web.Application(middlewares=[_errors], client_max_size=1 << 30)
        app.add_routes(
            [
                web.post(P.GENERATE.path, self.generate),
                web.get(P.HEALTH.path, self.health),
                web.get("/health_generate", self.health),
                web.get(P.SERVER_INFO.path, self.server_info),
                web.get(P.MODEL_INFO.path, self.model_info),
                web.get("/get_model_info", self.model_info),
                web.post(P.PAUSE.path, self.pause_generation),
                web.post(P.CONTINUE.path, self.continue_generation),
                web.post(P.ABORT.path, self.abort_request),
                web.get(P.FLUSH_CACHE.path, self.flush_cache),
                web.post(P.FLUSH_CACHE.path, self.flush_cache),
                web.post(P.GET_WEIGHTS.path, self.get_weights_by_name),
                web.post(P.WEIGHTS_CHECKER.path, self.weights_checker),
                web.post(P.UPDATE_WEIGHT_VERSION.path, self.update_weight_version),
                web.post(P.RELEASE_MEMORY.path, self.release_memory_occupation),
                web.post(P.RESUME_MEMORY.path, self.resume_memory_occupation),
                web.post(P.UPDATE_FROM_DISK.path, self.update_weights_from_disk),
                web.post(P.INIT_GROUP.path, self.init_weights_update_group),
                web.post(P.BEGIN_UPDATE.path, self.begin_weight_update),
                web.post(P.END_UPDATE.path, self.end_weight_update),
                web.post(P.UPDATE_FROM_DISTRIBUTED.path, self.update_weights_from_distributed),
                web.post(P.UPDATE_FROM_TENSOR.path, self.update_weights_from_tensor),
                web.post(P.LOAD_LORA.path, self.load_lora_adapter),
                web.post(P.LOAD_LORA_TENSORS.path, self.load_lora_adapter_from_tensors),
                web.post(P.UNLOAD_LORA.path, self.unload_lora_adapter),
            ]
        )
        app.on_startup.append(self.start_engine)
        app.on_cleanup.append(self.stop_engine)
        return app

    async def start_engine(self, app: web.Application) -> None:
        self.sched.start()

    async def stop_engine(self, app: web.Application) -> None:
        await asyncio.to_thread(self.sched.stop)
        for pool in self.engine.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    async def on_engine(self, fn: Callable[[], T]) -> T:
        """What ``fn()`` returns, run on the engine thread between steps."""
        return await asyncio.wrap_future(self.sched.call(fn))

    async def in_pool(self, kind: str, fn: Callable[..., T], *args: Any) -> T:
        """What ``fn(*args)`` returns, run in the engine's pool for ``kind`` of slow load."""
        return await asyncio.get_running_loop().run_in_executor(self.engine.pools[kind], functools.partial(fn, *args))

    # ---- generation ---------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        """``n`` completions of one prompt: streamed as they decode, or answered whole once all have finished."""
        generation = _Generation(self, request, await _parse(request, protocol.GenerateReqInput))
        generation.submit()
        return await (generation.stream() if generation.req.stream else generation.whole())

    async def health(self, request: web.Request) -> web.Response:
        # As SGLang's: a one-token generation must come back, so a paused engine is not healthy (SGLang's waits for
        # the pause and answers 503 after 20 s; this answers at once).
        why = "engine thread stopped" if not self.sched.alive else "generation is paused" if self.sched.paused else ""
        return web.Response(text=why, status=503 if why else 200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.PauseGenerationReqInput)
        await self.on_engine(lambda: self.sched.pause(req.mode))
        return _ok(f"paused ({req.mode})")

    async def continue_generation(self, request: web.Request) -> web.Response:
        await _parse(request, protocol.ContinueGenerationReqInput)

        def resume() -> None:
            if self.engine.released:
                raise ProtocolError(
                    f"memory is released ({', '.join(sorted(self.engine.released))}): resume it "
                    "(/resume_memory_occupation) before generation continues"
                )
            self.sched.resume()

        await self.on_engine(resume)
        return _ok("continued")

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.ReleaseMemoryOccupationReqInput)
        released = await self.on_engine(lambda: self.engine.release_memory(req.regions()))
        return _ok(f"released {', '.join(sorted(released)) or 'nothing more'}")

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.ResumeMemoryOccupationReqInput)
        resumed = await self.on_engine(lambda: self.engine.resume_memory(req.regions()))
        return _ok(f"resumed {', '.join(sorted(resumed)) or 'nothing released'}")

    async def abort_request(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.AbortReq)
        count = await self.on_engine(lambda: self.sched.abort(None if req.abort_all else req.rid))
        return _ok(f"aborted {count}", aborted=count)

    async def flush_cache(self, request: web.Request) -> web.Response:
        flushed = await self.on_engine(self.sched.flush_cache)
        text = "Cache flushed." if flushed else "Cache not flushed: requests are running."
        return web.Response(text=text, status=200 if flushed else 400)

    # ---- info ---------------------------------------------------------------------------------
    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(server_info(self.engine.engine_name, self.engine.model), dumps=_dumps)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.engine.model_info(), dumps=_dumps)

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.GetWeightsByNameReqInput)
        values = await self.on_engine(lambda: self.engine.weight_values(req.name, req.truncate_size))
        if values is None:
            raise ProtocolError(f"{req.name!r} is not a weight of the served model (give a Hub tensor name)")
        return web.json_response(values, dumps=_dumps)

    async def weights_checker(self, request: web.Request) -> web.Response:
        await _parse(request, protocol.CheckWeightsReqInput)
        return _ok("checksums computed", per_engine_checksum=await self.on_engine(self.engine.checksum))

    # ---- weights ------------------------------------------------------------------------------
    async def update_weight_version(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.UpdateWeightVersionReqInput)

        def apply():
            if req.abort_all_requests:
                self.sched.abort(message="weight version changed")
            self.sched.weight_version = req.new_version

        await self.on_engine(apply)
        return _ok(f"weight version {req.new_version}")

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.UpdateWeightFromDiskReqInput)
        engine = self.engine
        engine.check_weights_held("weights not loaded")  # before reading the directory
        with refused_path("model_path", req.model_path):
            named = await self.in_pool("disk", engine.read_model_dir, req.model_path)
        await self.on_engine(
            lambda: engine.apply_weights(named, req.weight_version, req.abort_all_requests, req.flush_cache)
        )
        return _ok(f"loaded {req.model_path}", num_paused_requests=0)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.InitWeightsUpdateGroupReqInput)
        engine, name = self.engine, req.group_name
        if name in engine.weight_groups or name in engine.joining:
            raise ProtocolError(f"weight group {name!r} is already initialised (or being joined)")
        if len(engine.joining) >= MAX_JOINING:
            raise ProtocolError(f"{MAX_JOINING} weight-group joins are already waiting for their peers; retry later")
        if req.backend == "nccl" and engine.device.type != "cuda":
            raise ProtocolError("backend nccl needs a CUDA engine; this one runs on the CPU (use gloo)")
        engine.joining.add(name)
        try:
            engine.weight_groups[name] = await in_daemon_thread(engine.join_group, req)
        finally:
            engine.joining.discard(name)
        return _ok(f"joined {name} as rank {req.rank_offset}")

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        await _parse(request, protocol.BeginWeightUpdateReqInput)
        if self.engine.update_session:
            raise ProtocolError("a weight-update session is already open; call /end_weight_update first")
        self.engine.update_session = True
        return _ok("weight-update session open")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await _parse(request, protocol.EndWeightUpdateReqInput)
        if not self.engine.update_session:
            raise ProtocolError("no weight-update session is open; call /begin_weight_update first")
        self.engine.update_session = False
        return _ok("weight-update session closed")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.UpdateWeightsFromDistributedReqInput)
        engine = self.engine
        engine.check_weights_held("weights not received")  # before a byte comes
        # Names, shapes and layout are checked before a byte is received: never allocate what a request claims.
        shapes = [
            (n, torch.empty(s, dtype=getattr(torch, d), device="meta"))
            for n, d, s in zip(req.names, req.dtypes, req.shapes, strict=True)
        ]
        hub_tensor_targets(engine.family, engine.model, shapes)
        if req.load_format == "flattened_bucket":
            bucket_layout(req.dtypes, req.shapes)
        group = engine.weight_groups.get(req.group_name)
        if group is None:
            raise ProtocolError(f"group {req.group_name!r} is not initialised: call /init_weights_update_group first")
        if not engine.update_session:
            raise ProtocolError(
                "update_weights_from_distributed must run between /begin_weight_update and /end_weight_update"
            )
        engine.check_flush(req.flush_cache, req.abort_all_requests, "weights not received")  # before a byte comes
        # Logged: the order updates came in.
        log.info("receiving %d tensors from weight group %s", len(req.names), req.group_name)
        named = await in_daemon_thread(engine.receive, req, group)
        await self.on_engine(
            lambda: engine.apply_weights(named, req.weight_version, req.abort_all_requests, req.flush_cache)
        )
        return _ok(f"updated {len(named)} tensors")

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.UpdateWeightsFromTensorReqInput)
        engine = self.engine
        if not engine.update_session:
            raise ProtocolError(
                "update_weights_from_tensor must run between /begin_weight_update and /end_weight_update"
            )
        engine.check_weights_held("weights not updated")
        if len(req.serialized_named_tensors) != 1:
            raise ProtocolError(
                "serialized_named_tensors must hold one entry: the embedded engine is one rank "
                "(SGLang: one per TP rank)"
            )
        named = await self.in_pool("tensor", load_payload, req.serialized_named_tensors[0], req.load_format)
        await self.on_engine(
            lambda: engine.apply_weights(named, req.weight_version, req.abort_all_requests, req.flush_cache)
        )
        return _ok(f"updated {len(named)} tensors")

    # ---- LoRA adapters ------------------------------------------------------------------------
    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.LoadLoRAAdapterReqInput)
        adapters = self.engine.adapters
        with refused_path("lora_path", req.lora_path):
            adapter = await self.in_pool("lora", adapters.from_dir, req.lora_name, req.lora_path)
        await self.on_engine(lambda: adapters.add(adapter))
        return _ok(f"loaded {req.lora_name}", loaded_adapters=sorted(adapters.adapters))

    async def load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.LoadLoRAAdapterFromTensorsReqInput)
        adapters = self.engine.adapters
        if req.load_format != "safetensors":
            raise ProtocolError(
                "the embedded engine takes serialized_named_tensors with load_format='safetensors' "
                "(base64 safetensors bytes; SGLang's default is a CUDA-IPC pickle that cannot cross "
                "machines)"
            )
        if len(req.serialized_named_tensors) != 1:
            raise ProtocolError("serialized_named_tensors must hold one entry (the embedded engine has one rank)")
        adapter = await self.in_pool(
            "lora", adapters.from_base64, req.lora_name, req.config_dict, req.serialized_named_tensors[0]
        )
        await self.on_engine(lambda: adapters.add(adapter))
        return _ok(f"loaded {req.lora_name}", loaded_adapters=sorted(adapters.adapters))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        req = await _parse(request, protocol.UnloadLoRAAdapterReqInput)
        await self.on_engine(lambda: self.sched.unload_adapter(req.lora_name))
        return _ok(f"unloaded {req.lora_name}", loaded_adapters=sorted(self.engine.adapters.adapters))


class _Generation(Generic[RequestT]):
    """One /generate call: its completions' requests on the scheduler, the queue their updates come back through, and
    the answer made of them: streamed as they decode, or whole once all have finished."""

    def __init__(self, server: EngineServer[RequestT], request: web.Request, req: protocol.GenerateReqInput):
        self.server, self.engine, self.request, self.req = server, server.engine, request, req
        self.loop = asyncio.get_running_loop()
        self.updates: asyncio.Queue = asyncio.Queue()  # (rid, finished, payload), put from the scheduler's thread
        self.unread = threading.Event()  # the requests were aborted for good: what they decoded is made for nobody
        self.done = 0  # completions finished (counted on the scheduler's thread, the only one calling on_update)
        self.requests = self.engine.make_requests(req, self.on_update)
        # As SGLang does, chunks of an n > 1 stream say which completion they belong to.
        self.index_of = {r.rid: i for i, r in enumerate(self.requests)} if len(self.requests) > 1 else {}

    def submit(self) -> None:
        for r in self.requests:
            self.server.sched.submit(r)

    def on_update(self, r: Request, finished: bool) -> None:
        """On the scheduler's thread: ``r`` has a new token, or has finished."""
        if self.unread.is_set():
            return
        if self.req.stream:
            update = (r.rid, finished, self.engine.response(r, self.req))
            self.loop.call_soon_threadsafe(self.updates.put_nowait, update)
        elif finished:
            # Serialized here, as it finishes: a long answer's lists take several times its JSON, and answers waiting
            # as objects for the event loop held a simulated engine's process at twice its memory. Spilled here too,
            # all but the last: spilled by the handler, each answer's bytes also stayed in its frame until the next
            # completion came (at 32 trainer + 96 engine GPUs, 0.5 GB in each process of four simulated replicas).
            self.done += 1
            self.loop.call_soon_threadsafe(self.updates.put_nowait, (r.rid, finished, self._answer(r)))

    def _answer(self, r: Request) -> bytes | _Spilled | ValueError:
        """``r``'s answer as JSON, on disk past SPILL_BYTES unless it finished last (that one is sent at once); the
        error of one that cannot be serialized."""
        try:
            answer = _dumps(self.engine.response(r, self.req)).encode()
        except ValueError as e:  # a NaN: the handler answers 500
            return e
        return _Spilled(answer) if len(answer) > SPILL_BYTES and self.done < len(self.requests) else answer

    async def abandon(self, message: str) -> None:
        """Abort the requests, and make nothing more of what they decoded."""
        self.unread.set()
        await self.server.on_engine(lambda: self.server.sched.abort_these(self.requests, message))

    async def next_update(self) -> tuple | None:
        """The next update, or None once the client has gone away (its requests are then aborted)."""
        while True:
            try:
                return await asyncio.wait_for(self.updates.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if _gone(self.request):
                    await self.abandon("client disconnected")
                    return None

    async def stream(self) -> web.StreamResponse:
        """Each completion's answer so far, as server-sent events, until all have finished."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(self.request)
        remaining = len(self.requests)
        try:
            while remaining:
                update = await self.next_update()
                if update is None:
                    return resp
                rid, finished, payload = update
                remaining -= finished
                if self.index_of:
                    payload["index"] = self.index_of[rid]
                await resp.write(f"data: {_dumps(payload)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionError:  # the client left mid-stream: stop generating what nobody reads
            await self.abandon("client disconnected")
        return resp

    async def whole(self) -> web.StreamResponse:
        """Every completion's answer once all have finished: one JSON answer, a list of them when n > 1; 499 for a
        client gone before."""
        # Finished completions wait for the other n - 1, past SPILL_BYTES on disk (spilled by on_update).
        results: dict[str, bytes | _Spilled] = {}
        pieces: list[bytes | _Spilled] = []
        try:
            if not await self._collect(results):
                return web.Response(status=499, text="client disconnected")
            pieces = _json_list([results.pop(r.rid) for r in self.requests])
            return await self._send(pieces)
        finally:  # a client gone, or an answer that could not be made: no file left open (one still on its way to the
            # queue, put before abandon stopped them, closes with its last reference)
            queued = [self.updates.get_nowait()[2] for _ in range(self.updates.qsize())]
            for held in [*results.values(), *pieces, *queued]:
                if isinstance(held, _Spilled):
                    held.close()

    async def _collect(self, results: dict[str, bytes | _Spilled]) -> bool:
        """Every completion's answer into ``results`` by rid; False if the client went away first."""
        while len(results) < len(self.requests):
            update = await self.next_update()
            if update is None:
                return False
            rid, _, answer = update
            if isinstance(answer, ValueError):  # a 500, and nothing left running for an answer that cannot be sent
                await self.abandon("the answer could not be serialized")
                raise answer
            results[rid] = answer
        return True

    async def _send(self, pieces: list[bytes | _Spilled]) -> web.StreamResponse:
        """One JSON body of ``pieces``, taken from the list as they are sent."""
        resp = web.StreamResponse()
        resp.content_type, resp.content_length = "application/json", sum(map(len, pieces))
        try:
            await resp.prepare(self.request)
            while pieces:
                piece = pieces.pop(0)  # each one freed once the socket has taken it
                for chunk in piece.chunks() if isinstance(piece, _Spilled) else (piece,):
                    await resp.write(chunk)
            await resp.write_eof()
        except ConnectionError:  # the client left while its answer was sent: nothing is running for it any more
            pass
        return resp


def _json_list(answers: list[bytes | _Spilled]) -> list[bytes | _Spilled]:
    """Several answers as the pieces of one JSON list, written piece by piece: never joined into a second copy of the
    whole answer. One answer stays itself."""
    if len(answers) <= 1:
        return answers
    separated = [x for answer in answers for x in (b", ", answer)]
    return [b"[", *separated[1:], b"]"]


async def _parse(request: web.Request, kind: type[WireModelT]) -> WireModelT:
    charset = request.charset
    if charset is not None and charset.lower().replace("-", "").replace("_", "") != "utf8":
        raise ProtocolError(f"charset {charset!r}: JSON bodies are UTF-8")
    raw = await request.read()
    return kind.parse(raw if raw.strip() else b"{}")


def _ok(message: str, /, **extra: Unpack[protocol.ControlResponse]) -> web.Response:
    body: protocol.ControlResponse = {"success": True, "message": message, **extra}
    return web.json_response(body, dumps=_dumps)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except MoerlError as e:
        return _error(400, str(e))
    except web.HTTPException as e:  # no such route, a wrong method, a body over the size limit
        if e.status < 400:
            raise
        return _error(e.status, f"{request.method} {request.path}: {e.reason}")
    except Exception as e:  # a bug: the server keeps serving and the caller learns what failed
        log.exception("request %s failed", request.path)
        return _error(500, f"{type(e).__name__}: {e}")
