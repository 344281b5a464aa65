"""The engine wire contract: SGLang 0.5.23's HTTP API, the subset RL uses, every route in one module.

Each route has one request type, strict (a wrong type, an unknown field, a non-finite number or a value
out of range is refused with the field named), and its answer's shape. The embedded engine parses with
these types, the client builds its bodies with them, and tests check them against SGLang's own types.
Field names, defaults and encodings are SGLang's (``sglang/srt/managers/io_struct.py``,
``sglang/srt/sampling/sampling_params.py``); what depends on the served model (ids inside the vocabulary,
the context length) is checked by :func:`check_generate`. One route is moerl's own, served by its embedded engine
only: ``/step_scores``, a process reward model's per-step scores (SGLang has no per-token head).
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self, TypedDict, get_args

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from moerl.dtypes import WIRE_DTYPES
from moerl.errors import MoerlError

if TYPE_CHECKING:
    from moerl.models.family import ModelShape


class ProtocolError(MoerlError):
    """A request the engine refuses (HTTP 400); the message says which field and why."""


class BrokenAnswer(ValueError):
    """An engine's answer that is not JSON, or not a finished completion: a transport failure (the replica is at fault,
    not the request)."""


SGLANG_VERSION = "0.5.23"  # the release this contract is written and tested against (the sglang extra pins it)
# The torch release each SGLang release's wheel pins, and with it the NCCL its engines join a weight group with.
SGLANG_TORCH = {"0.5.23": "2.14.1"}
DEFAULT_SAMPLING_MASK_MAX_TOKENS = 4096  # SGLang's --sampling-mask-max-tokens default
GREEDY_BELOW = 1e-6  # SGLang samples greedily (temperature 1, top_k 1) below this temperature
MAX_N = 1024  # completions of one prompt per request (SGLang sets no bound; one request must not flood the engine)
INT64 = (-(2**63), 2**63 - 1)
# moerl.dtypes.WIRE_DTYPES as a type: a type checker reads a Literal's values only where they are written out.
WireDtype = Literal["float32", "bfloat16", "float16", "float64", "int64", "int32", "int8", "uint8", "float8_e4m3fn"]
assert get_args(WireDtype) == WIRE_DTYPES, "WireDtype must list moerl.dtypes.WIRE_DTYPES, in its order"


def _no_nul(path: str) -> str:
    if "\0" in path:
        raise ValueError("a path cannot contain a NUL character")
    return path


LocalPath = Annotated[str, Field(min_length=1), AfterValidator(_no_nul)]  # a path on the engine's machine


class WireModel(BaseModel):
    """A JSON body: strict types, no unknown fields, finite numbers."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @classmethod
    def parse(cls, body: bytes | str | dict) -> Self:
        """The validated request of a raw JSON body (or an already decoded one); :class:`ProtocolError` if bad."""
        try:
            return cls.model_validate_json(body) if isinstance(body, (bytes, str)) else cls.model_validate(body)
        except ValidationError as e:
            raise ProtocolError(_not_unicode(body, e) or describe(e)) from None

    def body(self) -> dict[str, Any]:
        """What a client sends: the fields it set (the server applies the defaults)."""
        return self.model_dump(mode="json", exclude_unset=True)


def _not_unicode(body: bytes | str | dict, error: ValidationError) -> str | None:
    """For a body the JSON parser refused: the field holding text that is not Unicode (bytes that are not UTF-8, or an
    unpaired surrogate escape such as ``\\ud800``), which the parser's own message does not name. None otherwise."""
    if isinstance(body, dict) or not any(p["type"] == "json_invalid" for p in error.errors()):
        return None
    text = body.decode("utf-8", "surrogateescape") if isinstance(body, bytes) else body
    try:  # Python's parser keeps what is not Unicode as lone surrogates, where it can be found
        decoded = json.loads(text)
    except (ValueError, RecursionError):
        return None
    where = _first_not_unicode(decoded, ())
    if where is None:
        return None
    return (
        f"{'.'.join(map(str, where)) or 'the body'}: "
        "not valid Unicode (bytes that are not UTF-8, or an unpaired surrogate escape)"
    )


def _first_not_unicode(value: Any, path: tuple) -> tuple | None:
    if isinstance(value, str):
        return None if value.isascii() or _encodes(value) else path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and not _encodes(key):
            return path
        found = _first_not_unicode(item, (*path, key))
        if found is not None:
            return found
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def describe(error: ValidationError) -> str:
    """A validation error as ``field: problem`` parts, without echoing the (possibly huge) input."""
    problems = error.errors(include_url=False, include_input=False)
    unknown = [".".join(map(str, p["loc"])) for p in problems if p["type"] == "extra_forbidden"]
    parts = [f"unknown or unsupported field(s): {', '.join(unknown)}"] if unknown else []
    for p in problems:
        if p["type"] != "extra_forbidden":
            where = ".".join(map(str, p["loc"]))
            message = p["msg"].removeprefix("Value error, ")  # our own checks' messages, as raised
            parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts[:5])


class _NullMeansDefault(WireModel):
    """SGLang's /generate takes ``null`` for any field as "use the default"."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        # Only a known field's null: an unknown field is refused whatever its value.
        return (
            {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
            if isinstance(data, dict)
            else data
        )


# ---- /generate ----------------------------------------------------------------------------------


class SamplingParams(_NullMeansDefault):
    """``sampling_params`` of /generate."""

    temperature: float = Field(default=1.0, ge=0)  # below GREEDY_BELOW: greedy
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1, le=INT64[1])  # -1: the whole vocabulary; 0 is refused
    min_p: float = Field(default=0.0, ge=0, le=1)
    max_new_tokens: int = Field(default=128, ge=0, le=INT64[1])
    stop_token_ids: list[int] | None = None  # stop on any of these, besides the model's end token
    ignore_eos: bool = False
    # completions of the prompt; the embedded engine seeds completion i sampling_seed + i
    n: int = Field(default=1, ge=1, le=MAX_N)
    # SGLang 0.5.23 reads it only under --enable-deterministic-inference, and then gives all n completions this one seed
    sampling_seed: int | None = Field(default=None, ge=INT64[0], le=INT64[1])

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must be -1 (no limit) or >= 1")
        return value

    def resolved(self) -> SamplingParams:
        """What is sampled: a temperature below GREEDY_BELOW means greedy, as in SGLang (temperature 1, top_k 1)."""
        return self.model_copy(update={"temperature": 1.0, "top_k": 1}) if self.temperature < GREEDY_BELOW else self


class GenerateReqInput(_NullMeansDefault):
    """One prompt (``text`` or ``input_ids``) and ``n`` completions of it."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = SamplingParams()
    # n > 1: the embedded engine names completion i "<rid>-<i>" and aborts them all by rid (SGLang: neither)
    rid: str | None = None
    return_logprob: bool = False
    # Prompt log-probs from this position (-1: none); the token there gets null, as it always does in SGLang 0.5.23.
    logprob_start_len: int = Field(default=-1, ge=-1)
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(default=0, ge=0)  # routing rows from this position
    return_sampling_mask: bool = False  # each output token's kept set (needs a finite top_k)
    # with return_logprob: each output token's most likely tokens and their log-probs (as output_token_logprobs'), and
    # each prompt token's from logprob_start_len (as input_token_logprobs')
    top_logprobs_num: int = Field(default=0, ge=0)
    sampling_logprobs_mode: Literal["selected", "support"] = "selected"
    lora_path: str | None = None  # name of a loaded LoRA adapter
    stream: bool = False
    # Either partitions the prefix cache: a prompt reuses only KV (and routing) that requests of the same keys left.
    extra_key: str | None = None
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        if self.input_ids is not None and not self.input_ids:
            raise ValueError("input_ids is empty")
        if self.text is not None and not self.text:
            raise ValueError("text is empty")
        return self


def one_by_one(req: GenerateReqInput) -> tuple[GenerateReqInput, list[GenerateReqInput]] | None:
    """``req`` as SGLang serves ``n > 1`` itself, where it cannot: with kept sets. SGLang 0.5.23 first prefills the
    prompt in a request of its own (max_new_tokens 0) that keeps every flag, return_sampling_mask included; a prefill
    samples nothing whose kept set it could capture, so every such request fails with a 500 ("The sampling backend did
    not return captured sampling support"), on a GPU as on the CPU. The client sends the same requests itself: the
    prompt's prefill asking for nothing back, then one completion per request (completion i seeded
    ``sampling_seed + i`` as the embedded engine seeds it, named ``<rid>-<i>``), whose prompts reuse that prefill's KV
    and routing. None: ``req`` goes as it is."""
    n = req.sampling_params.n
    if not (req.return_sampling_mask and n > 1):
        return None
    # What the prefill's prompt KV is keyed by; nothing else of the request (SGLang refuses sampling_logprobs_mode
    # without return_sampling_mask).
    keyed = {"text", "input_ids", "lora_path", "extra_key", "cache_salt"} & req.model_fields_set
    prefill = GenerateReqInput.model_validate(
        {k: getattr(req, k) for k in keyed}
        | {"sampling_params": req.sampling_params.model_copy(update={"n": 1, "max_new_tokens": 0})}
        | ({} if req.rid is None else {"rid": f"{req.rid}-prefill"})
    )
    seed = req.sampling_params.sampling_seed
    completions = [
        req.model_copy(
            update={
                "sampling_params": req.sampling_params.model_copy(
                    update={"n": 1, "sampling_seed": None if seed is None else seed + i}
                ),
                "rid": None if req.rid is None else f"{req.rid}-{i}",
            }
        )
        for i in range(n)
    ]
    return prefill, completions


@dataclass(frozen=True)
class EngineLimits:
    """What a request is checked against on the serving engine."""

    vocab_size: int
    context_len: int
    sampling_mask_max_tokens: int = DEFAULT_SAMPLING_MASK_MAX_TOKENS


def check_generate(req: GenerateReqInput, prompt: list[int], limits: EngineLimits) -> None:
    """Refuse what the served model cannot take (as SGLang does, plus ids outside the vocabulary)."""
    outside = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if outside:
        raise ProtocolError(f"input_ids has ids outside the vocabulary [0, {limits.vocab_size}): {outside[:5]}")
    s = req.sampling_params.resolved()
    stops = [t for t in s.stop_token_ids or [] if not 0 <= t < limits.vocab_size]
    if stops:
        raise ProtocolError(
            f"sampling_params.stop_token_ids has ids outside the vocabulary [0, {limits.vocab_size}): {stops[:5]}"
        )
    if len(prompt) >= limits.context_len:
        raise ProtocolError(
            f"The input ({len(prompt)} tokens) is longer than the model's context length ({limits.context_len} tokens)."
        )
    if len(prompt) + s.max_new_tokens > limits.context_len:
        raise ProtocolError(
            f"Requested token count exceeds the model's maximum context length of {limits.context_len} tokens: "
            f"{len(prompt)} prompt + {s.max_new_tokens} max_new_tokens; reduce either"
        )
    if req.return_logprob and req.logprob_start_len >= len(prompt):
        raise ProtocolError(f"logprob_start_len={req.logprob_start_len} must be < the prompt length {len(prompt)}")
    if req.routed_experts_start_len > len(prompt):
        raise ProtocolError(
            f"routed_experts_start_len={req.routed_experts_start_len} exceeds the prompt length {len(prompt)}"
        )
    if req.return_sampling_mask and not 1 <= s.top_k <= limits.sampling_mask_max_tokens:
        raise ProtocolError(
            f"return_sampling_mask needs a finite top_k in [1, {limits.sampling_mask_max_tokens}] "
            f"(--sampling-mask-max-tokens), got top_k={s.top_k}"
        )


# Rows of ids (or log-probs), one per output token: lists on the wire; an answer made in-process may hold them as numpy
# arrays, which its JSON (orjson, as SGLang's) writes as the same lists.
KeptRows = list[list[int]] | np.ndarray | list[np.ndarray]


class GenerateMetaInfo(TypedDict, total=False):
    id: str
    finish_reason: dict | None  # {"type": "stop" | "length" | "abort", ...}; None: a streamed chunk, still running
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of the prompt, reused from the prefix cache (KV and routing computed by an earlier request)
    weight_version: str  # of the last output token
    weight_versions: list[dict]  # spans {version, start, end} (end exclusive) over output positions
    output_token_logprobs: list[list]  # [logprob, token id, None]: temperature-scaled, before truncation
    # [logprob | None, token id, None] for each prompt token from logprob_start_len (empty without one): the first null,
    # the log-prob of each other given those before it, never temperature-scaled
    input_token_logprobs: list[list]
    routed_experts: str  # base64 of int32 [positions, num_hidden_layers, topk] (dense layers -1)
    output_token_sampling_mask: KeptRows  # each output token's kept ids, ascending
    output_token_sampling_mask_length: int
    # selected: the token's log-prob over its kept set; support: the set's
    output_token_sampling_logprobs: list | np.ndarray
    # per output token: [[logprob, token id, None], ...] most likely first (or null); and for a request of no new token,
    # one: the next token's, untempered
    output_top_logprobs: list
    input_top_logprobs: list  # as output_top_logprobs, for input_token_logprobs' tokens: the first null


class GenerateResponse(TypedDict, total=False):
    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo
    index: int  # which of n completions a stream chunk belongs to


# ---- control routes -----------------------------------------------------------------------------


class PauseGenerationReqInput(WireModel):
    # abort: finish running requests now; retract: drop their KV, re-prefill on continue; in_place: hold them
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(WireModel):
    pass


class AbortReq(WireModel):
    rid: str = ""  # this request (and its n > 1 completions)
    abort_all: bool = False

    @model_validator(mode="after")
    def _something(self) -> AbortReq:
        if not self.abort_all and not self.rid:
            raise ValueError("give rid or abort_all=true")
        return self


# What /release_memory_occupation and /resume_memory_occupation take (SGLang 0.5.23's tags; none given: all).
MemoryTag = Literal["weights", "kv_cache", "cuda_graph"]
MEMORY_TAGS: frozenset[str] = frozenset(("weights", "kv_cache", "cuda_graph"))


class ReleaseMemoryOccupationReqInput(WireModel):
    tags: list[MemoryTag] | None = None

    def regions(self) -> frozenset[str]:
        return MEMORY_TAGS if self.tags is None else frozenset(self.tags)


class ResumeMemoryOccupationReqInput(ReleaseMemoryOccupationReqInput):
    pass


class UpdateWeightVersionReqInput(WireModel):
    new_version: str = Field(min_length=1)
    abort_all_requests: bool = True


class UpdateWeightFromDiskReqInput(WireModel):
    model_path: LocalPath  # a HF directory with the served model's tensors
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True  # refused while requests run (an in_place pause): send false then


class InitWeightsUpdateGroupReqInput(WireModel):
    master_address: str = Field(min_length=1)  # where the trainer hosts the group's rendezvous store
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)  # this replica's first rank (the trainer is rank 0)
    world_size: int = Field(ge=2, le=1 << 16)
    group_name: str = Field(default="weight_update_group", min_length=1)
    backend: Literal["nccl", "gloo"] = "nccl"

    @model_validator(mode="after")
    def _rank_inside(self) -> InitWeightsUpdateGroupReqInput:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset={self.rank_offset} must be below world_size={self.world_size}")
        return self


class BeginWeightUpdateReqInput(WireModel):
    """Opens a weight-update session: distributed updates are refused outside one (SGLang 0.5.23)."""

    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdateReqInput(WireModel):
    pass


class UpdateWeightsFromDistributedReqInput(WireModel):
    names: list[str] = Field(min_length=1)  # Hub tensor names
    dtypes: list[WireDtype]
    shapes: list[list[int]]
    group_name: str = Field(default="weight_update_group", min_length=1)
    flush_cache: bool = True  # refused while requests run (an in_place pause): send false then
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: Literal["flattened_bucket"] | None = None  # one uint8 broadcast of every tensor back to back

    @model_validator(mode="after")
    def _aligned(self) -> UpdateWeightsFromDistributedReqInput:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(
                f"names, dtypes and shapes differ in length ({len(self.names)}, {len(self.dtypes)}, {len(self.shapes)})"
            )
        bad = [i for i, shape in enumerate(self.shapes) if any(d < 0 for d in shape)]
        if bad:
            raise ValueError(f"shapes[{bad[0]}]={self.shapes[bad[0]]} has a negative dimension")
        return self


class UpdateWeightsFromTensorReqInput(WireModel):
    """Tensors handed over on the engine's own machine (colocated training): each entry a base64 pickle
    (:mod:`moerl.engines.tensor_ipc`) whose tensors live in memory the engine maps, CUDA IPC on a GPU and shared memory
    on the CPU; one entry per TP rank of the engine (SGLang: rank r reads entry r only)."""

    serialized_named_tensors: list[str] = Field(min_length=1)
    # None: a list of (Hub name, tensor) pairs; flattened_bucket: one uint8 tensor and each tensor's span in it;
    # moerl's delta loader (moerl.engines.delta.LOAD_FORMAT, which SGLang must be started with as a custom weight
    # loader): a list of pairs, each tensor whole under its name or a delta of it (moerl.engines.delta's encoding).
    load_format: Literal["flattened_bucket", "moerl.engines.delta.apply_delta"] | None = None
    flush_cache: bool = True  # refused while requests run (an in_place pause): send false then
    abort_all_requests: bool = False
    weight_version: str | None = None


class ClassifyReqInput(WireModel):
    """/classify, SGLang's route for a reward model (a sequence-classification model, served as an embedding model):
    ``text`` or ``input_ids``, one input or a batch; each answer's ``embedding`` is the model's scores (one for a
    reward model)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None

    @model_validator(mode="after")
    def _one_kind_of_input(self) -> ClassifyReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give text or input_ids (one of them)")
        batch = self.batch()
        if not 1 <= len(batch) <= MAX_N:
            raise ValueError(f"a batch holds 1 to {MAX_N} inputs, not {len(batch)}")
        if any(len(one) == 0 for one in batch):
            raise ValueError("an input is empty")
        if isinstance(self.rid, list) and len(self.rid) != len(batch):
            raise ValueError(f"rid names {len(self.rid)} requests for {len(batch)} inputs")
        return self

    @property
    def batched(self) -> bool:
        given = self.text if self.text is not None else self.input_ids
        return isinstance(given, list) and (self.text is not None or bool(given) and isinstance(given[0], list))

    def batch(self) -> list:
        """The inputs, each a text or a list of ids, whether one was given or a batch."""
        given = self.text if self.text is not None else self.input_ids
        assert given is not None, "the validator requires one kind of input"
        return list(given) if self.batched else [given]


class ClassifyResponse(TypedDict):
    embedding: list[float]  # the model's scores
    meta_info: dict[str, Any]  # id, prompt_tokens


class StepScoresReqInput(WireModel):
    """/step_scores, moerl's own route (SGLang 0.5.23 serves no per-token head): a process reward model's score of each
    step of each input, in the Qwen2.5-Math-PRM convention. Each step of a response ends with ``step_token_id`` (the
    step separator, e.g. ``<extra_0>``); the answer, one per input, is :class:`StepScoresResponse`."""

    input_ids: list[list[int]]
    step_token_id: int = Field(ge=0)

    @model_validator(mode="after")
    def _inputs(self) -> StepScoresReqInput:
        if not 1 <= len(self.input_ids) <= MAX_N:
            raise ValueError(f"a batch holds 1 to {MAX_N} inputs, not {len(self.input_ids)}")
        if empty := [i for i, ids in enumerate(self.input_ids) if not ids]:
            raise ValueError(f"input_ids[{empty[0]}] is empty")
        return self


class StepScoresResponse(TypedDict):
    # At each position of the input holding step_token_id, in order: p(label 1), the softmax over the head's 2 labels
    # (a 1-label head: the sigmoid of its logit). An input without a step token: [].
    scores: list[float]


class GetWeightsByNameReqInput(WireModel):
    name: str = Field(min_length=1)
    truncate_size: int = Field(default=100, ge=1)


class CheckWeightsReqInput(WireModel):
    action: Literal["checksum"] = "checksum"  # SGLang also snapshots and compares; moerl asks for checksums only


class LoadLoRAAdapterReqInput(WireModel):
    lora_name: str = Field(min_length=1)
    lora_path: LocalPath  # a PEFT directory
    pinned: bool = False


class LoadLoRAAdapterFromTensorsReqInput(WireModel):
    lora_name: str = Field(min_length=1)
    config_dict: dict[str, Any]  # the PEFT adapter_config.json
    # SGLang: one serialized copy per TP rank. The embedded engine (one rank) takes one base64 safetensors
    # payload with load_format="safetensors"; SGLang's own is a CUDA-IPC pickle that cannot cross machines.
    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: str | None = None
    pinned: bool = False


class UnloadLoRAAdapterReqInput(WireModel):
    lora_name: str = Field(min_length=1)


class ControlResponse(TypedDict, total=False):
    success: bool
    message: str
    aborted: int  # /abort_request: completions aborted
    loaded_adapters: list[str]  # LoRA routes
    num_paused_requests: int  # /update_weights_from_disk
    per_engine_checksum: str  # /weights_checker: one hash over every weight of the engine (every TP rank)


class ServerInfo(TypedDict, total=False):
    """/server_info: SGLang's resolved server arguments and more; the fields moerl reads."""

    tp_size: int  # ranks the engine takes in a weight-update group
    version: str  # SGLang's version (the embedded engine: moerl's, with engine "moerl-embedded")
    engine: str
    # What it computes in: SGLang's --dtype ("auto": fp16/bf16 from the checkpoint), the embedded engine's torch dtype.
    dtype: str
    torch_version: str  # moerl's engines: the torch they run (SGLang's is what its release pins: SGLANG_TORCH)


class ModelInfo(TypedDict):
    model_path: str
    tokenizer_path: str | None
    is_generation: bool
    weight_version: str
    num_hidden_layers: int
    moe_layers: list[int]
    num_experts_per_tok: int
    vocab_size: int


# SGLang 0.5.23's 400 for a request naming an adapter its server never loaded: a replica that restarted since the sync
# that loaded it there (an adapter loaded and unloaded since is loaded again from its path, not refused).
ADAPTER_NEVER_LOADED = "Got LoRA adapter that has never been loaded"


@dataclass(frozen=True)
class Route:
    path: str
    method: str
    # Retried after a transport error or a 5xx: only where doing it twice is harmless. A join or a broadcast
    # sent again would wait for peers that never come; an adapter loaded twice is refused; SGLang keeps one
    # pending disk update, so a second load sent while a slow first one runs takes its result slot, and the
    # first's answer then lands on an answered future.
    idempotent: bool = True


GENERATE = Route("/generate", "POST")
CLASSIFY = Route("/classify", "POST")
STEP_SCORES = Route("/step_scores", "POST")  # moerl's own: the embedded engine serving a process reward model
HEALTH = Route("/health", "GET")
MODEL_INFO = Route("/model_info", "GET")
SERVER_INFO = Route("/server_info", "GET")
PAUSE = Route("/pause_generation", "POST")
CONTINUE = Route("/continue_generation", "POST")
ABORT = Route("/abort_request", "POST")
FLUSH_CACHE = Route("/flush_cache", "POST")
UPDATE_WEIGHT_VERSION = Route("/update_weight_version", "POST")
# Neither is harmless twice in SGLang: a second release stashes the released weights' state again; a resume of a tag
# not released (the first succeeded) kills its scheduler.
RELEASE_MEMORY = Route("/release_memory_occupation", "POST", idempotent=False)
RESUME_MEMORY = Route("/resume_memory_occupation", "POST", idempotent=False)
UPDATE_FROM_DISK = Route("/update_weights_from_disk", "POST", idempotent=False)
INIT_GROUP = Route("/init_weights_update_group", "POST", idempotent=False)
BEGIN_UPDATE = Route("/begin_weight_update", "POST", idempotent=False)
END_UPDATE = Route("/end_weight_update", "POST", idempotent=False)
UPDATE_FROM_DISTRIBUTED = Route("/update_weights_from_distributed", "POST", idempotent=False)
UPDATE_FROM_TENSOR = Route("/update_weights_from_tensor", "POST", idempotent=False)
GET_WEIGHTS = Route("/get_weights_by_name", "POST")
WEIGHTS_CHECKER = Route("/weights_checker", "POST")
LOAD_LORA = Route("/load_lora_adapter", "POST", idempotent=False)
LOAD_LORA_TENSORS = Route("/load_lora_adapter_from_tensors", "POST", idempotent=False)
UNLOAD_LORA = Route("/unload_lora_adapter", "POST", idempotent=False)


# ---- encodings -------------------------------------------------------------------------------


def encode_routed_experts(routing: np.ndarray) -> str:
    """SGLang's encoding: the int32 array [positions, num_hidden_layers, topk], raw bytes, base64."""
    return base64.b64encode(np.ascontiguousarray(routing, dtype=np.int32).tobytes()).decode("ascii")


def largest_answer_bytes(req: GenerateReqInput, shape: ModelShape | None) -> int:
    """About the most bytes a /generate answer to ``req`` can take on the wire: every completion at its token cap, each
    position's routing (int32 base64 over every layer), log-prob entry (an input token's or an output token's) and most
    likely tokens' entries, and each output token's kept set. What a client needs to choose where to read an answer
    before it is asked for."""
    params = req.sampling_params
    prompt = len(req.input_ids) if req.input_ids is not None else len(req.text or "")
    top = req.top_logprobs_num if req.return_logprob else 0
    per_token = 64 + 40 * top  # an id, its text, its [log-prob, id, null] entry and its top ones', as JSON
    if req.return_routed_experts and shape is not None:
        per_token += math.ceil(shape.num_layers * shape.topk * 4 * 4 / 3)
    if req.return_sampling_mask:
        kept = (
            min(params.top_k, DEFAULT_SAMPLING_MASK_MAX_TOKENS)
            if params.top_k > 0
            else DEFAULT_SAMPLING_MASK_MAX_TOKENS
        )
        per_token += 24 + 32 * kept  # the token's log-prob; an id (and a log-prob) per kept one
    return params.n * ((prompt + params.max_new_tokens) * per_token + 1024)  # 1 KB: the rest of the meta_info


def decode_routed_experts(
    payload: str, num_layers: int, topk: int, moe_layers: list[int], num_experts: int
) -> np.ndarray:
    """Routing of the MoE layers only, compact: [positions, len(moe_layers), topk] as uint8 when the
    experts fit (<= 256), else int16."""
    flat = np.frombuffer(base64.b64decode(payload), dtype=np.int32)
    if flat.size % (num_layers * topk):
        raise ProtocolError(
            f"routed_experts has {flat.size} ids, not a multiple of num_layers*topk = {num_layers * topk}"
        )
    routing = flat.reshape(-1, num_layers, topk)[:, moe_layers]
    if routing.size and (routing.min() < 0 or routing.max() >= num_experts):
        raise ProtocolError(f"routed_experts has expert ids outside [0, {num_experts}) in MoE layers")
    return routing.astype(np.uint8 if num_experts <= 256 else np.int16)


def decode_sampling_masks(masks: KeptRows) -> tuple[np.ndarray, np.ndarray]:
    """Kept sets as CSR: ``offsets`` int64 [T+1] and ``ids`` int32 [offsets[-1]]; token t's kept ids
    are ``ids[offsets[t]:offsets[t+1]]``."""
    lengths = np.fromiter((len(m) for m in masks), dtype=np.int64, count=len(masks))
    offsets = np.zeros(len(masks) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.fromiter((t for m in masks for t in m), dtype=np.int32, count=int(offsets[-1]))
    return offsets, ids


def version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """Run-length spans ``{version, start, end}`` (end exclusive) over output token positions."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


# ---- decoded responses --------------------------------------------------------------------------


@dataclass
class Completion:
    """One finished completion, decoded into compact arrays (no per-token Python lists)."""

    rid: str
    prompt_len: int
    output_ids: np.ndarray  # int32 [T]
    finish_reason: dict
    weight_versions: list[dict[str, Any]]  # spans {version, start, end} over output positions
    logprobs: np.ndarray | None = None  # float32 [T], temperature-scaled, before truncation
    routing: np.ndarray | None = None  # uint8/int16 [positions, moe_layers, topk]
    routing_start: int = 0  # position of routing row 0
    cached_tokens: int = 0  # of the prompt, reused from the engine's prefix cache
    mask_offsets: np.ndarray | None = None  # int64 [T+1]
    mask_ids: np.ndarray | None = None  # int32
    sampling_logprobs: np.ndarray | None = None  # float32 [T] ("selected" mode)
    top_ids: np.ndarray | None = None  # int32 [T, k]: each token's most likely tokens (top_logprobs_num), descending
    top_logprobs: np.ndarray | None = None  # float32 [T, k], as ``logprobs``
    # The prompt's tokens after logprob_start_len: the log-prob of each given those before it (float32 [P], never
    # temperature-scaled), and the most likely tokens in its place (top_logprobs_num), as ``top_ids``/``top_logprobs``.
    input_logprobs: np.ndarray | None = None
    input_top_ids: np.ndarray | None = None  # int32 [P, k]
    input_top_logprobs: np.ndarray | None = None  # float32 [P, k]

    def head(self, k: int, finish_reason: dict) -> Completion:
        """This completion as if it had finished (``finish_reason``) after its first ``k`` output tokens: each
        per-token array, the kept sets, the routing rows (which end at the last fed position) and the version spans
        cut there."""
        if not 1 <= k <= len(self.output_ids):
            raise ValueError(f"a completion of {len(self.output_ids)} tokens cannot be cut after {k}")
        offsets = None if self.mask_offsets is None else self.mask_offsets[: k + 1]
        spans = [{**s, "end": min(s["end"], k)} for s in self.weight_versions if s["start"] < k]
        return replace(
            self,
            output_ids=self.output_ids[:k],
            finish_reason=finish_reason,
            weight_versions=spans,
            logprobs=None if self.logprobs is None else self.logprobs[:k],
            routing=None if self.routing is None else self.routing[: self.prompt_len + k - 1 - self.routing_start],
            mask_offsets=offsets,
            mask_ids=None if self.mask_ids is None or offsets is None else self.mask_ids[: offsets[-1]],
            sampling_logprobs=None if self.sampling_logprobs is None else self.sampling_logprobs[:k],
            top_ids=None if self.top_ids is None else self.top_ids[:k],
            top_logprobs=None if self.top_logprobs is None else self.top_logprobs[:k],
        )

    def then(self, more: Completion) -> Completion:
        """This completion continued by ``more``: the completion of a request whose prompt was this one's prompt and
        output, asked for what it returns (routing rows from its last fed position, the same per-token fields), on
        any replica. One completion, as if decoded in one request: per-token arrays, kept sets and routing rows
        joined, the version spans of ``more`` moved past this output (and merged where one version runs on), its
        finish reason (a length counted from this prompt); of the prompt, this one's (cached tokens, prompt
        log-probs)."""
        n = len(self.output_ids)
        if more.prompt_len != self.prompt_len + n:
            raise ValueError(
                f"a continuation's prompt holds {more.prompt_len} tokens, not this completion's {self.prompt_len} of "
                f"prompt and {n} of output"
            )
        if (self.routing is None) != (more.routing is None):
            raise ValueError("a completion with routing rows continues only by one with routing rows")
        if self.routing is not None and more.routing_start != self.routing_start + len(self.routing):
            raise ValueError(
                f"a continuation's routing starts at position {more.routing_start}, not at "
                f"{self.routing_start + len(self.routing)}, the one after this completion's last row"
            )
        spans = [dict(s) for s in self.weight_versions]
        for span in more.weight_versions:
            moved = {**span, "start": span["start"] + n, "end": span["end"] + n}
            if spans and spans[-1]["version"] == moved["version"] and spans[-1]["end"] == moved["start"]:
                spans[-1]["end"] = moved["end"]
            else:
                spans.append(moved)

        def join(a: np.ndarray | None, b: np.ndarray | None, what: str) -> np.ndarray | None:
            if a is None and b is None:
                return None
            if a is None or b is None:
                raise ValueError(f"a completion with{'out' if a is None else ''} {what} continues only alike")
            return np.concatenate([a, b])

        finish_reason = dict(more.finish_reason)
        if isinstance(finish_reason.get("length"), int):
            finish_reason["length"] += n
        offsets = None
        if self.mask_offsets is not None and more.mask_offsets is not None:
            offsets = np.concatenate([self.mask_offsets, more.mask_offsets[1:] + self.mask_offsets[-1]])
        return replace(
            self,
            output_ids=np.concatenate([self.output_ids, more.output_ids]),
            finish_reason=finish_reason,
            weight_versions=spans,
            logprobs=join(self.logprobs, more.logprobs, "log-probs"),
            routing=join(self.routing, more.routing, "routing"),
            mask_offsets=join(self.mask_offsets, more.mask_offsets, "kept sets") if offsets is None else offsets,
            mask_ids=join(self.mask_ids, more.mask_ids, "kept sets"),
            sampling_logprobs=join(self.sampling_logprobs, more.sampling_logprobs, "kept sets' log-probs"),
            top_ids=join(self.top_ids, more.top_ids, "top log-probs"),
            top_logprobs=join(self.top_logprobs, more.top_logprobs, "top log-probs"),
        )


def scored_ids(req: GenerateReqInput) -> list[int] | None:
    """The prompt tokens whose log-probs ``req`` asks for (from logprob_start_len), where its prompt is ids."""
    if req.input_ids is None or not req.return_logprob or req.logprob_start_len < 0:
        return None
    return req.input_ids[req.logprob_start_len :]


def decode_generate(
    response: GenerateResponse,
    shape: ModelShape | None,
    routing_start: int = 0,
    prompt_len: int | None = None,
    scored: list[int] | None = None,
) -> Completion:
    """One completion of a /generate answer; ``prompt_len``: the prompt's length where the request knows it (SGLang
    answers a request aborted in its waiting queue without ``prompt_tokens``); ``scored``: the tokens whose log-probs
    the request asked for (:func:`scored_ids`), which the answer must name."""
    meta = response["meta_info"]
    finish_reason = meta["finish_reason"]
    if finish_reason is None:  # only a streamed chunk of a completion still running has none
        raise BrokenAnswer(f"/generate answered completion {meta['id']!r} unfinished (finish_reason null)")
    prompt_len = meta.get("prompt_tokens", prompt_len)
    if prompt_len is None:
        raise BrokenAnswer(f"/generate answered completion {meta['id']!r} without prompt_tokens")
    completion = Completion(
        rid=meta["id"],
        prompt_len=prompt_len,
        output_ids=np.asarray(response["output_ids"], dtype=np.int32),
        finish_reason=finish_reason,
        weight_versions=meta.get("weight_versions") or [],
        routing_start=routing_start,
        cached_tokens=meta.get("cached_tokens", 0),
    )
    if "output_token_logprobs" in meta:
        logprobs = [lp for lp, _, _ in meta["output_token_logprobs"]]
        if None in logprobs:  # SGLang writes a NaN as null
            raise BrokenAnswer(
                f"/generate answered completion {meta['id']!r} with a log-prob that is not a number (null): the "
                "engine computes NaN (broken or uninitialised weights?)"
            )
        completion.logprobs = np.asarray(logprobs, dtype=np.float32)
    if "routed_experts" in meta:
        if shape is None:
            raise ProtocolError("routed_experts returned but the model shape is unknown")
        completion.routing = decode_routed_experts(
            meta["routed_experts"], shape.num_layers, shape.topk, shape.moe_layers, shape.num_experts
        )
    # One per output token: SGLang 0.5.23 answers a request for none with the next token's, which nothing samples.
    if top := (meta.get("output_top_logprobs") or [])[: len(completion.output_ids)]:
        completion.top_logprobs, completion.top_ids = _top_entries([entry or [] for entry in top])
    if meta.get("input_token_logprobs"):  # empty where the request asked for none
        completion.input_logprobs = _input_logprobs(meta["id"], meta["input_token_logprobs"], scored)
    elif scored is not None and finish_reason.get("type") != "abort":
        raise BrokenAnswer(f"/generate answered completion {meta['id']!r} without the input log-probs asked for")
    if meta.get("input_top_logprobs"):
        first, *top = meta["input_top_logprobs"]
        scored_here = completion.input_logprobs
        if first is not None or None in top or scored_here is None or len(top) != len(scored_here):
            raise BrokenAnswer(
                f"/generate answered completion {meta['id']!r} with input_top_logprobs that are not one entry per "
                "input_token_logprobs entry, null for the first alone"
            )
        completion.input_top_logprobs, completion.input_top_ids = _top_entries(top)
    if "output_token_sampling_mask" in meta:
        completion.mask_offsets, completion.mask_ids = decode_sampling_masks(meta["output_token_sampling_mask"])
        lps = meta.get("output_token_sampling_logprobs")
        if lps is not None and len(lps) and np.ndim(lps[0]) == 0:  # "selected": one log-prob a token
            completion.sampling_logprobs = np.asarray(lps, dtype=np.float32)
    return completion


def _top_entries(top: list[list]) -> tuple[np.ndarray, np.ndarray]:
    """Each token's most likely tokens ``[[log-prob, id, None], ...]`` as log-probs float32 [T, k] and ids int32 [T, k],
    as many for each token (a vocabulary smaller than asked: all of it)."""
    k = min((len(entry) for entry in top), default=0)
    logprobs = np.asarray([[lp for lp, _, _ in e[:k]] for e in top], np.float32).reshape(len(top), k)
    return logprobs, np.asarray([[t for _, t, _ in e[:k]] for e in top], np.int32).reshape(len(top), k)


def _input_logprobs(rid: str, entries: list[list], scored: list[int] | None) -> np.ndarray:
    """``input_token_logprobs`` but the first entry as float32, once they are what SGLang answers: the first null (it
    never computes the log-prob of the token at logprob_start_len), the others numbers, each naming its prompt token."""
    ids = [t for _, t, _ in entries]
    # SGLang 0.5.23 names every id from its vocab_size - 1 on 0 (a clip meant for image tokens' hashes): the
    # vocabulary's last token comes back as 0.
    if scored is not None and (
        len(ids) != len(scored) or any(t not in (s, 0) for t, s in zip(ids, scored, strict=True))
    ):
        raise BrokenAnswer(
            f"/generate answered completion {rid!r} with input_token_logprobs for tokens {ids[:8]}... ({len(ids)}), "
            f"not the prompt's from logprob_start_len {scored[:8]}... ({len(scored)})"
        )
    if entries[0][0] is not None:
        raise BrokenAnswer(
            f"/generate answered completion {rid!r} with a first input_token_logprobs entry that is not null (SGLang "
            "never computes it)"
        )
    logprobs = [lp for lp, _, _ in entries[1:]]
    if None in logprobs:  # SGLang writes a NaN as null
        raise BrokenAnswer(
            f"/generate answered completion {rid!r} with an input log-prob that is not a number (null) after the "
            "first: the engine computes NaN (broken or uninitialised weights?)"
        )
    return np.asarray(logprobs, dtype=np.float32)


def decode_generate_body(
    body: bytes,
    shape: ModelShape | None,
    routing_start: int = 0,
    prompt_len: int | None = None,
    scored: list[int] | None = None,
) -> list[Completion]:
    """A /generate answer's raw body, parsed and decoded (the rest: see :func:`decode_generate`): the part of a
    rollout's cost that grows with its tokens (an 8K-token response of a 48-layer top-8 model is 19 MB of JSON, 75 ms
    to decode), so a client may run it in another process."""
    try:
        out = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # not the exception itself: it holds the whole body
        raise BrokenAnswer(f"/generate answered with {len(body)} bytes that are not JSON: {e}") from None
    answers = out if isinstance(out, list) else [out]
    return [decode_generate(r, shape, routing_start, prompt_len, scored) for r in answers]
