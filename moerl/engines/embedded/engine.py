"""The embedded engine: SGLang's RL requests over moerl's scheduler, for the HTTP server (:mod:`.server`).

Weight updates check every name and shape (and read every tensor) before the first write: a refused update leaves the
served weights and version as they were. Slow control work runs in pools of its own (group joins, broadcasts, disk
loads, adapter loads), so one stuck join cannot starve the others; the model belongs to the scheduler's thread alone.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic

import numpy as np
import torch
from transformers import PreTrainedModel

from moerl.checkpoint.hf import HFReader, check_hf_tensors, fp8_checkpoint, fp8_names, read_config
from moerl.engines import protocol
from moerl.engines.delta import Delta, apply_to
from moerl.engines.embedded.fp8 import FP8Adapters, FP8Model
from moerl.engines.embedded.lora import AdapterSet
from moerl.engines.embedded.runner import ModelRunner, engine_device, hub_tensor_targets, hub_tensor_view
from moerl.engines.embedded.scheduler import DEFAULT_PREFIX_CACHE_TOKENS, Request, RequestT, Scheduler
from moerl.engines.protocol import ProtocolError
from moerl.engines.weight_group import bucket_layout, join_weight_group, unflatten_bucket, weight_store
from moerl.models import family_for

STORE_PROBE_S = 5.0  # a weight group's store that does not accept a connection in this long is unreachable


@dataclass
class TokenDetails:
    """What an answer tells of a completion's tokens besides their ids; a part is None unless its request asked for it.
    Each engine makes them its own way (:meth:`EmbeddedEngine.token_details`); the answer is built from them alike."""

    versions: list[str]  # each output token's weight version
    # The output tokens' log-probs, and the prompt's from logprob_start_len (the first None: SGLang computes none).
    logprobs: tuple[list[float], list[float | None]] | None = None
    routing: str | None = None  # int32 [positions, layers, top-k] from routed_experts_start_len, as SGLang encodes it
    # Each output token's kept set, and the log-probs over it that the request's sampling_logprobs_mode asks for.
    sampling_mask: tuple[protocol.KeptRows, list | np.ndarray] | None = None
    top_logprobs: list[list[list]] | None = None  # each output token's most likely tokens: [log-prob, id, None]
    # The same in place of each prompt token from logprob_start_len, the first None (as its log-prob)
    input_top_logprobs: list[list[list] | None] | None = None


class EmbeddedEngine(Generic[RequestT]):
    """Owns the model runner, the scheduler and the tokenizer; builds SGLang-shaped responses. Generic over what its
    scheduler queues: :class:`Request`, or a subclass's own."""

    engine_name = "moerl-embedded"  # /server_info's engine
    request_type: type[RequestT]  # what make_requests queues
    fp8: FP8Model | None = None  # set where the model directory is an FP8 checkpoint (:mod:`.fp8`)

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
        if fp8_checkpoint(read_config(model_dir)):  # served in FP8, as SGLang serves such a directory
            self.fp8 = FP8Model.load(model_dir, dtype, engine_device(device))
        self.runner = ModelRunner(model_dir, dtype, device, None if self.fp8 is None else self.fp8.model)
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
        self.scheduler = scheduler(
            (AdapterSet if self.fp8 is None else FP8Adapters)(model, self.family), eos_ids, max_length
        )
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
            meta["routed_experts"] = details.routing
        if details.sampling_mask is not None:
            kept_ids, kept_logprobs = details.sampling_mask
            meta["output_token_sampling_mask"] = kept_ids
            meta["output_token_sampling_mask_length"] = len(kept_ids)
            meta["output_token_sampling_logprobs"] = kept_logprobs
        if details.top_logprobs is not None:
            meta["output_top_logprobs"] = details.top_logprobs
        if details.input_top_logprobs is not None:
            meta["input_top_logprobs"] = details.input_top_logprobs
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
                    None if lp != lp else float(lp)  # the first has no log-prob
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
            details.routing = protocol.encode_routed_experts(rows[req.routed_experts_start_len : max(end, 0)].numpy())
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
            ] + ([] if request.next_top is None else [request.next_top])
            # none without logprob_start_len, as SGLang's; nor before the prefill
            details.input_top_logprobs = [] if request.prompt_top is None else [None]
            if request.prompt_top is not None:
                values, ids = (t.tolist() for t in request.prompt_top)
                details.input_top_logprobs += [
                    [[lp, token, None] for lp, token in zip(row_logprobs, row_ids, strict=True)]
                    for row_logprobs, row_ids in zip(values, ids, strict=True)
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
        names = [name for rule in self.family.all_rules(self.hub_config) for name in rule.hf]
        return [(name, reader.get(name)) for name in (names if self.fp8 is None else fp8_names(names))]

    def model_dir_reader(self, path: str) -> tuple[HFReader, torch.dtype]:
        """A reader of the HF directory ``path`` and its dtype, once its headers say it is the served model (an FP8
        checkpoint where the engine serves FP8)."""
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
        self, named: Sequence[tuple[str, torch.Tensor | Delta]], version: str | None, abort_all: bool, flush: bool
    ) -> None:
        """On the engine thread: write ``named`` (Hub names; each tensor whole, or a delta of it) into the model, all
        checked first."""
        sched = self.scheduler
        self.check_weights_held("weights not updated")
        # a delta is checked as the tensor it changes: its shape and dtype
        stand_ins = [
            (name, torch.empty(item.shape, dtype=item.values.dtype, device="meta") if isinstance(item, Delta) else item)
            for name, item in named
        ]
        pairs = self.weight_targets(stand_ins)
        self.check_flush(flush, abort_all, "weights not updated")
        if abort_all:
            sched.abort(message="weights updated")
        self.write_weights([(dst, item) for (dst, _), (_, item) in zip(pairs, named, strict=True)])
        if self.fp8 is not None:  # the bucket written: what the model computes with follows
            self.fp8.dequantize_written(name for name, _ in named)
        if flush:  # checked above: nothing runs
            sched.prefix_cache.clear()
        if version is not None:
            sched.weight_version = version

    def weight_targets(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) for each Hub-named tensor (an FP8 engine's: weights and scales), all checked before
        anything is written."""
        if self.fp8 is not None:
            return self.fp8.targets(named)
        return hub_tensor_targets(self.family, self.model, named)

    def write_weights(self, pairs: list[tuple[torch.Tensor, torch.Tensor | Delta]]) -> None:
        with torch.no_grad():
            for dst, src in pairs:
                if isinstance(src, Delta):
                    apply_to(dst, src)
                else:
                    dst.copy_(src)

    def weight_values(self, name: str, truncate_size: int) -> list | None:
        """The first ``truncate_size`` rows of the Hub tensor ``name`` as served (None: not a weight of the model)."""
        self.check_weights_held("no weights to read")
        if self.fp8 is not None and (held := self.fp8.values(name, truncate_size)) is not None:
            return held  # an FP8 weight (its values as floats) or its scales
        view = hub_tensor_view(self.family, dict(self.model.named_parameters()), name)
        return None if view is None else view[:truncate_size].float().cpu().tolist()

    def checksum(self) -> str:
        """SGLang's CPU hash: sha256 of each tensor's bytes, then of the names and hashes (an FP8 engine's: of its FP8
        weights and their scales)."""
        self.check_weights_held("no weights to hash")
        digest = hashlib.sha256()
        tensors = self.model.named_parameters() if self.fp8 is None else self.fp8.hashed_tensors()
        for name, param in sorted(tensors, key=lambda item: item[0]):
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
            # gloo has no float8 type: an FP8 weight comes as its bytes (the same bytes over NCCL)
            dist.broadcast(tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor, 0, group)
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
