"""The engine wire contract: SGLang 0.5.23's HTTP API, the subset RL uses, in one module.

The embedded engine parses requests with it and builds responses with it; the client builds
requests with it and decodes responses with it. Field names, defaults and encodings are SGLang's
(``sglang.srt.managers.io_struct.GenerateReqInput``, ``sglang.srt.sampling.sampling_params``).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from moerl.errors import MoerlError


class ProtocolError(MoerlError):
    """A request the engine refuses (HTTP 400); the message says which field and why."""


# ---- /generate request ------------------------------------------------------------------------

SAMPLING_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "max_new_tokens": 128,
    "stop_token_ids": None,
    "ignore_eos": False,
    "n": 1,
    "sampling_seed": None,
}

GENERATE_DEFAULTS: dict[str, Any] = {
    "text": None,
    "input_ids": None,
    "sampling_params": None,
    "rid": None,
    "return_logprob": False,
    "logprob_start_len": -1,
    "return_routed_experts": False,
    "routed_experts_start_len": 0,
    "return_sampling_mask": False,
    "sampling_logprobs_mode": "selected",
    "lora_path": None,
    "stream": False,
}

SAMPLING_LOGPROBS_MODES = ("selected", "support")
DEFAULT_SAMPLING_MASK_MAX_TOKENS = 4096  # SGLang's --sampling-mask-max-tokens default


@dataclass
class GenerateRequest:
    """One validated /generate body (a single prompt; ``n`` completions of it)."""

    input_ids: list[int] | None
    text: str | None
    sampling: dict[str, Any]
    rid: str | None
    return_logprob: bool
    logprob_start_len: int
    return_routed_experts: bool
    routed_experts_start_len: int
    return_sampling_mask: bool
    sampling_logprobs_mode: str
    lora_path: str | None
    stream: bool


def _check_type(name: str, value: Any, kinds: tuple[type, ...]) -> None:
    if isinstance(value, bool) and bool not in kinds:
        raise ProtocolError(f"{name} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
    if not isinstance(value, kinds):
        raise ProtocolError(f"{name} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")


def parse_generate(body: Any, vocab_size: int, mask_max_tokens: int = DEFAULT_SAMPLING_MASK_MAX_TOKENS) -> GenerateRequest:
    """Validate a /generate JSON body. Raises :class:`ProtocolError` naming the first problem."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    unknown = sorted(set(body) - set(GENERATE_DEFAULTS))
    if unknown:
        raise ProtocolError(f"unknown or unsupported field(s): {', '.join(unknown)}")
    b = {**GENERATE_DEFAULTS, **{k: v for k, v in body.items() if v is not None}}
    if (b["text"] is None) == (b["input_ids"] is None):
        raise ProtocolError("give exactly one of text and input_ids")
    if b["input_ids"] is not None:
        ids = b["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ProtocolError("input_ids must be a list of token ids (one prompt per request)")
        if not ids:
            raise ProtocolError("input_ids is empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ProtocolError(f"input_ids has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    else:
        _check_type("text", b["text"], (str,))
        if not b["text"]:
            raise ProtocolError("text is empty")
    for name in ("return_logprob", "return_routed_experts", "return_sampling_mask", "stream"):
        _check_type(name, b[name], (bool,))
    for name in ("logprob_start_len", "routed_experts_start_len"):
        _check_type(name, b[name], (int,))
    if b["rid"] is not None:
        _check_type("rid", b["rid"], (str,))
    if b["lora_path"] is not None:
        _check_type("lora_path", b["lora_path"], (str,))
    if b["sampling_logprobs_mode"] not in SAMPLING_LOGPROBS_MODES:
        raise ProtocolError(f"sampling_logprobs_mode must be one of {SAMPLING_LOGPROBS_MODES}, got {b['sampling_logprobs_mode']!r}")
    if b["routed_experts_start_len"] < 0:
        raise ProtocolError("routed_experts_start_len must be >= 0")
    sampling = _parse_sampling(b["sampling_params"] or {})
    if b["return_sampling_mask"] and not 1 <= sampling["top_k"] <= mask_max_tokens:
        raise ProtocolError(
            f"return_sampling_mask needs a finite top_k in [1, {mask_max_tokens}] (--sampling-mask-max-tokens), "
            f"got top_k={sampling['top_k']}"
        )
    return GenerateRequest(
        input_ids=b["input_ids"], text=b["text"], sampling=sampling, rid=b["rid"],
        return_logprob=b["return_logprob"], logprob_start_len=b["logprob_start_len"],
        return_routed_experts=b["return_routed_experts"], routed_experts_start_len=b["routed_experts_start_len"],
        return_sampling_mask=b["return_sampling_mask"], sampling_logprobs_mode=b["sampling_logprobs_mode"],
        lora_path=b["lora_path"], stream=b["stream"],
    )


def _parse_sampling(params: Any) -> dict[str, Any]:
    if not isinstance(params, dict):
        raise ProtocolError("sampling_params must be a JSON object")
    unknown = sorted(set(params) - set(SAMPLING_DEFAULTS))
    if unknown:
        raise ProtocolError(f"unknown or unsupported sampling_params: {', '.join(unknown)}")
    s = {**SAMPLING_DEFAULTS, **{k: v for k, v in params.items() if v is not None}}
    for name in ("temperature", "top_p", "min_p"):
        _check_type(f"sampling_params.{name}", s[name], (int, float))
    for name in ("top_k", "max_new_tokens", "n"):
        _check_type(f"sampling_params.{name}", s[name], (int,))
    _check_type("sampling_params.ignore_eos", s["ignore_eos"], (bool,))
    if s["temperature"] < 0:
        raise ProtocolError(f"sampling_params.temperature must be >= 0, got {s['temperature']}")
    if not 0 < s["top_p"] <= 1:
        raise ProtocolError(f"sampling_params.top_p must be in (0, 1], got {s['top_p']}")
    if not 0 <= s["min_p"] <= 1:
        raise ProtocolError(f"sampling_params.min_p must be in [0, 1], got {s['min_p']}")
    if s["top_k"] == 0 or s["top_k"] < -1:
        raise ProtocolError(f"sampling_params.top_k must be -1 (no limit) or >= 1, got {s['top_k']}")
    if s["max_new_tokens"] < 0:
        raise ProtocolError(f"sampling_params.max_new_tokens must be >= 0, got {s['max_new_tokens']}")
    if s["n"] < 1:
        raise ProtocolError(f"sampling_params.n must be >= 1, got {s['n']}")
    stop = s["stop_token_ids"] or []
    if not isinstance(stop, list) or not all(isinstance(t, int) for t in stop):
        raise ProtocolError("sampling_params.stop_token_ids must be a list of token ids")
    s["stop_token_ids"] = stop
    if s["sampling_seed"] is not None:
        _check_type("sampling_params.sampling_seed", s["sampling_seed"], (int,))
    return s


# ---- encodings -------------------------------------------------------------------------------


def encode_routed_experts(routing: np.ndarray) -> str:
    """SGLang's encoding: the int32 array [positions, num_hidden_layers, topk], raw bytes, base64."""
    return base64.b64encode(np.ascontiguousarray(routing, dtype=np.int32).tobytes()).decode("ascii")


def decode_routed_experts(payload: str, num_layers: int, topk: int, moe_layers: list[int], num_experts: int) -> np.ndarray:
    """Routing of the MoE layers only, compact: [positions, len(moe_layers), topk] as uint8 when the
    experts fit (<= 256), else int16."""
    flat = np.frombuffer(base64.b64decode(payload), dtype=np.int32)
    if flat.size % (num_layers * topk):
        raise ProtocolError(f"routed_experts has {flat.size} ids, not a multiple of num_layers*topk = {num_layers * topk}")
    routing = flat.reshape(-1, num_layers, topk)[:, moe_layers]
    if routing.size and (routing.min() < 0 or routing.max() >= num_experts):
        raise ProtocolError(f"routed_experts has expert ids outside [0, {num_experts}) in MoE layers")
    return routing.astype(np.uint8 if num_experts <= 256 else np.int16)


def encode_sampling_masks(kept: list[np.ndarray]) -> list[list[int]]:
    return [k.tolist() for k in kept]


def decode_sampling_masks(masks: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
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
    mask_offsets: np.ndarray | None = None  # int64 [T+1]
    mask_ids: np.ndarray | None = None  # int32
    sampling_logprobs: np.ndarray | None = None  # float32 [T] ("selected" mode)

    @property
    def aborted(self) -> bool:
        return self.finish_reason.get("type") == "abort"

    def kept_ids(self, t: int) -> np.ndarray:
        return self.mask_ids[self.mask_offsets[t] : self.mask_offsets[t + 1]]


@dataclass(frozen=True)
class ModelShape:
    """What decoding routing needs to know about the served model (from /model_info)."""

    num_layers: int
    topk: int
    moe_layers: list[int]
    num_experts: int

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "ModelShape":
        from moerl.models import family_for

        family = family_for(config)
        cfg = family.normalize(config)
        pattern = family.moe_layer_pattern(cfg)
        return cls(cfg["num_hidden_layers"], cfg["num_experts_per_tok"], [i for i, moe in enumerate(pattern) if moe], cfg["num_experts"])


def decode_generate(response: dict[str, Any], shape: ModelShape | None, routing_start: int = 0) -> Completion:
    meta = response["meta_info"]
    completion = Completion(
        rid=meta["id"],
        prompt_len=meta["prompt_tokens"],
        output_ids=np.asarray(response["output_ids"], dtype=np.int32),
        finish_reason=meta["finish_reason"],
        weight_versions=meta.get("weight_versions") or [],
        routing_start=routing_start,
    )
    if "output_token_logprobs" in meta:
        completion.logprobs = np.fromiter((lp for lp, _, _ in meta["output_token_logprobs"]), dtype=np.float32)
    if "routed_experts" in meta:
        if shape is None:
            raise ProtocolError("routed_experts returned but the model shape is unknown")
        completion.routing = decode_routed_experts(meta["routed_experts"], shape.num_layers, shape.topk, shape.moe_layers, shape.num_experts)
    if "output_token_sampling_mask" in meta:
        completion.mask_offsets, completion.mask_ids = decode_sampling_masks(meta["output_token_sampling_mask"])
        lps = meta.get("output_token_sampling_logprobs")
        if lps and not isinstance(lps[0], list):
            completion.sampling_logprobs = np.asarray(lps, dtype=np.float32)
    return completion


# ---- weight broadcast payloads ------------------------------------------------------------------

TORCH_DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int8", "uint8")


def bucket_layout(dtypes: list[str], shapes: list[list[int]]) -> list[tuple[int, int]]:
    """Byte ``(start, end)`` of each tensor in a ``flattened_bucket`` broadcast: the tensors' raw
    bytes back to back in request order, each starting at a multiple of its element size (SGLang
    refuses unaligned buckets; order tensors by element size, largest first, to keep them aligned)."""
    import torch

    spans, offset = [], 0
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes, strict=True)):
        if dtype not in TORCH_DTYPES:
            raise ProtocolError(f"dtypes[{i}]={dtype!r} is not one of {TORCH_DTYPES}")
        if any(d < 0 for d in shape):
            raise ProtocolError(f"shapes[{i}]={shape} has a negative dimension")
        itemsize = getattr(torch, dtype).itemsize
        if offset % itemsize:
            raise ProtocolError(f"tensor {i} ({dtype}) would start at byte {offset}, not a multiple of {itemsize}")
        size = itemsize * int(np.prod(shape, dtype=np.int64))
        spans.append((offset, offset + size))
        offset += size
    return spans


def flatten_bucket(named: list[tuple[str, Any]]):
    """Sender side: ``(uint8 tensor, names, dtypes, shapes)`` for one flattened_bucket broadcast."""
    import torch

    named = sorted(named, key=lambda nt: -nt[1].element_size())
    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in named])
    return flat, [n for n, _ in named], [str(t.dtype).removeprefix("torch.") for _, t in named], [list(t.shape) for _, t in named]


def unflatten_bucket(flat, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[tuple[str, Any]]:
    import torch

    return [
        (name, flat[start:end].view(getattr(torch, dtype)).reshape(shape))
        for name, dtype, shape, (start, end) in zip(names, dtypes, shapes, bucket_layout(dtypes, shapes))
    ]
