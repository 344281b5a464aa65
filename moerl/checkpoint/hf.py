"""Hugging Face checkpoint directories: lazy tensor reads and sharded safetensors writes.

Reads open each safetensors file memory-mapped and copy out one tensor at a time, so a converter that
walks a model layer by layer holds about one layer in memory, whatever the model size. A directory may be a block-wise
FP8 checkpoint (:data:`moerl.fp8.QUANTIZATION_CONFIG` in its config; :func:`save_fp8` writes one): each quantized Hub
tensor is then float8_e4m3fn beside its fp32 ``<name>_scale_inv``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moerl import fp8
from moerl.errors import MoerlError
from moerl.files import staged_dir
from moerl.models import ModelFamily, family_for

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files that travel with the weights: what transformers and SGLang need to load and tokenize.
CARRIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
}


class CheckpointError(MoerlError):
    """A checkpoint directory that is missing files or tensors, or holds tensors of the wrong shape."""


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json (is this a Hugging Face model directory?)")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return config


class HFReader:
    """Tensor names, shapes and lazy reads of a HF directory (one file, or shards with an index)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / INDEX_NAME
        if index.is_file():
            weight_map = _weight_map(index)
        elif (self.directory / SINGLE_NAME).is_file():
            weight_map = None
        else:
            raise CheckpointError(f"{directory}: neither {SINGLE_NAME} nor {INDEX_NAME} found")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_NAME]
        missing = [f for f in files if not (self.directory / f).is_file()]
        if missing:
            raise CheckpointError(f"{directory}: shard files listed in the index are missing: {missing}")
        self.file_of: dict[str, str] = {}
        for f in files:
            with _open(self.directory / f) as handle:
                for name in handle.keys():
                    self.file_of[name] = f
        if weight_map:
            absent = sorted(n for n, f in weight_map.items() if self.file_of.get(n) != f)
            if absent:
                raise CheckpointError(f"{directory}: tensors listed in the index are not in their shard: {absent[:5]}")
        # One shard is mapped at a time: pages read through a mapping stay in this process's
        # resident set until it is unmapped, so keeping every shard open would make a streaming
        # conversion look (and, under memory limits, count) as large as the whole model.
        self._open_file: str | None = None
        self._open_handle = None

    def _handle(self, name: str):
        if name not in self.file_of:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is missing")
        file = self.file_of[name]
        if file != self._open_file:
            self._open_handle = None
            self._open_handle = _open(self.directory / file)
            self._open_file = file
        return self._open_handle

    def names(self) -> set[str]:
        return set(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        stored = self._handle(name).get_slice(name).get_dtype()
        if stored not in _SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{self.directory}: tensor {name} is {stored}; moerl reads {', '.join(_SAFETENSORS_DTYPES)}"
            )
        return _SAFETENSORS_DTYPES[stored]

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handle(name).get_tensor(name)
        except Exception as e:  # noqa: BLE001 - a file damaged past its header fails in safetensors' own ways
            raise CheckpointError(
                f"{self.directory / self.file_of[name]}: tensor {name} cannot be read ({e})"
            ) from None


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index (a JSON object with a weight_map): {e!r}") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
    odd = sorted({v for v in weight_map.values() if not v or "/" in v or "\0" in v or v in (".", "..")})
    if odd:
        raise CheckpointError(f"{index}: shards must be plain file names beside the index, got {odd[:3]}")
    return weight_map


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors fails in its own ways on a damaged or foreign file
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def fp8_checkpoint(cfg: dict) -> bool:
    """Whether the config (a ``config.json`` as a dict) is of a block-wise FP8 checkpoint: a ``quantization_config`` of
    :data:`moerl.fp8.QUANTIZATION_CONFIG`'s kind (False: none). Any other quantization is refused: moerl serves and
    writes that one alone."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return False
    wanted = fp8.QUANTIZATION_CONFIG
    if not (
        isinstance(qc, dict)
        and qc.get("quant_method") == wanted["quant_method"]
        and list(qc.get("weight_block_size") or []) == wanted["weight_block_size"]
        and qc.get("activation_scheme", wanted["activation_scheme"]) == wanted["activation_scheme"]
        and qc.get("fmt", wanted["fmt"]) == wanted["fmt"]
    ):
        raise CheckpointError(
            f"quantization_config {qc} is not supported: moerl serves only block-wise FP8 checkpoints, whose "
            f"quantization_config is {wanted} (write one with moerl.checkpoint.hf.save_fp8)"
        )
    return True


def fp8_names(names: list[str]) -> list[str]:
    """Hub tensor ``names`` as an FP8 checkpoint holds them: each quantized one followed by its scales."""
    return [n for name in names for n in ((name, fp8.scale_name(name)) if fp8.is_quantized(name) else (name,))]


def check_hf_tensors(reader: HFReader, family: ModelFamily, cfg: dict) -> torch.dtype:
    """Every tensor the model (of ``family``, its normalised config ``cfg``) needs is
    present with the right shape, and none would be dropped. Where ``cfg`` says FP8 (:func:`fp8_checkpoint`), each
    quantized tensor is float8_e4m3fn beside its fp32 scales.

    Reads only safetensors headers. Returns the checkpoint dtype (one for all tensors; of an FP8 checkpoint, of those
    not quantized)."""
    quantized = fp8_checkpoint(cfg)
    expected = family.hub_shapes(cfg)
    scales = (
        {fp8.scale_name(n): fp8.scale_shape(s) for n, s in expected.items() if fp8.is_quantized(n)} if quantized else {}
    )
    present = reader.names()
    problems = []
    missing = sorted(set(expected) - present)
    if missing:
        problems.append(f"{len(missing)} tensors missing, e.g. {missing[:3]}")
    missing_scales = sorted(set(scales) - present)
    if missing_scales:
        problems.append(
            f"{len(missing_scales)} FP8 scales missing, e.g. {missing_scales[:3]}"
            + (
                ""
                if len(missing_scales) < len(scales)
                else " (none at all: not an FP8 checkpoint; save_fp8 writes one)"
            )
        )
    extra = present - set(expected) - set(scales)
    if cfg.get("tie_word_embeddings"):
        extra.discard("lm_head.weight")  # some writers save the tied copy too
    if extra:
        hint = ""
        if not quantized and any(n.endswith(fp8.SCALE_SUFFIX) for n in extra):
            hint = " (FP8 scales: an FP8 checkpoint, for a model whose config has no quantization_config)"
        problems.append(f"{len(extra)} tensors the model does not use, e.g. {sorted(extra)[:3]}{hint}")
    wrong = [
        f"{n}: {reader.shape(n)} != expected {tuple(s)}"
        for n, s in (expected | scales).items()
        if n in present and reader.shape(n) != tuple(s)
    ]
    if wrong:
        problems.append(f"{len(wrong)} tensors with wrong shapes, e.g. {wrong[:3]}")
    if problems:
        raise CheckpointError(f"{reader.directory}: " + "; ".join(problems))
    if quantized:
        not_fp8 = [f"{n} ({reader.dtype(n)})" for n in expected if fp8.is_quantized(n) and reader.dtype(n) != fp8.FP8]
        not_fp32 = [f"{n} ({reader.dtype(n)})" for n in scales if reader.dtype(n) != torch.float32]
        wrong_dtypes = [f"{len(not_fp8)} quantized tensors are not FP8, e.g. {', '.join(not_fp8[:3])}"] * bool(not_fp8)
        wrong_dtypes += [f"{len(not_fp32)} scales are not float32, e.g. {', '.join(not_fp32[:3])}"] * bool(not_fp32)
        if wrong_dtypes:
            raise CheckpointError(
                f"{reader.directory}: an FP8 checkpoint holds each quantized tensor in float8_e4m3fn and its scales in "
                "float32; " + "; ".join(wrong_dtypes)
            )
    dtypes = {reader.dtype(n) for n in expected if not (quantized and fp8.is_quantized(n))}
    if fp8.FP8 in dtypes:
        raise CheckpointError(
            f"{reader.directory}: holds float8_e4m3fn tensors, yet "
            + (
                "only the decoder layers' linear projections are quantized in an FP8 checkpoint"
                if quantized
                else "its config.json has no quantization_config (an FP8 checkpoint names it)"
            )
        )
    if len(dtypes) != 1:
        raise CheckpointError(
            f"{reader.directory}: tensors of mixed dtypes {sorted(map(str, dtypes))}; the Megatron model has one "
            "parameter dtype"
        )
    return dtypes.pop()


class HFWriter:
    """Writes tensors into size-bounded safetensors shards plus the index transformers reads."""

    def __init__(self, directory: str | Path, max_shard_bytes: int = 2 * 1024**3):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        save_file(self._pending, str(self.directory / f"shard-{len(self._shards)}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        if self._pending:
            self._flush()
        n = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.directory / f"shard-{i}.tmp").rename(self.directory / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def copy_carried_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy config, tokenizer and generation files that exist in ``src``; returns their names."""
    copied = []
    for name in CARRIED_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def save_fp8(src: str | Path, dst: str | Path, max_shard_bytes: int = 2 * 1024**3) -> Path:
    """The HF model directory ``src`` as a block-wise FP8 checkpoint in the new directory ``dst``, which SGLang (and the
    embedded engine) serve in FP8: each quantized Hub tensor (:func:`moerl.fp8.is_quantized`) as
    :func:`moerl.fp8.quantize` makes it, float8_e4m3fn and its fp32 ``<name>_scale_inv``; the others as they are;
    config.json with :data:`moerl.fp8.QUANTIZATION_CONFIG`; the tokenizer and generation files copied. Streams one
    tensor at a time, and appears whole or not at all."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise CheckpointError(f"output directory {dst} already exists; choose a new path or remove it")
    raw = read_config(src)
    if fp8_checkpoint(raw):
        raise CheckpointError(f"{src} is an FP8 checkpoint already (its config.json has a quantization_config)")
    family = family_for(raw)
    cfg = family.normalize(raw)
    reader = HFReader(src)
    check_hf_tensors(reader, family, cfg)
    with staged_dir(dst) as staging:
        writer = HFWriter(staging, max_shard_bytes)
        for name in family.hub_shapes(cfg):
            tensor = reader.get(name)
            if fp8.is_quantized(name):
                q, scale = fp8.quantize(tensor)
                writer.add(name, q)
                writer.add(fp8.scale_name(name), scale)
            else:
                writer.add(name, tensor)
        writer.close()
        copy_carried_files(src, staging)
        (staging / "config.json").write_text(
            json.dumps(raw | {"quantization_config": dict(fp8.QUANTIZATION_CONFIG)}, indent=2) + "\n"
        )
    return dst
