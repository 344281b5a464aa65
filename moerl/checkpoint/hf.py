"""Hugging Face checkpoint directories: lazy tensor reads and sharded safetensors writes.

Reads open each safetensors file memory-mapped and copy out one tensor at a time, so a converter that
walks a model layer by layer holds about one layer in memory, whatever the model size.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moerl.errors import MoerlError
from moerl.models import ModelFamily

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


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


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
        return _SAFETENSORS_DTYPES[self._handle(name).get_slice(name).get_dtype()]

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


def check_hf_tensors(reader: HFReader, family: ModelFamily, cfg: dict) -> torch.dtype:
    """Every tensor the model (of ``family``, its normalised config ``cfg``) needs is
    present with the right shape, and none would be dropped.

    Reads only safetensors headers. Returns the checkpoint dtype (one for all tensors)."""
    expected = family.hub_shapes(cfg)
    present = reader.names()
    problems = []
    missing = sorted(set(expected) - present)
    if missing:
        problems.append(f"{len(missing)} tensors missing, e.g. {missing[:3]}")
    extra = present - set(expected)
    if cfg.get("tie_word_embeddings"):
        extra.discard("lm_head.weight")  # some writers save the tied copy too
    if extra:
        problems.append(f"{len(extra)} tensors the model does not use, e.g. {sorted(extra)[:3]}")
    wrong = [
        f"{n}: {reader.shape(n)} != expected {tuple(s)}"
        for n, s in expected.items()
        if n in present and reader.shape(n) != tuple(s)
    ]
    if wrong:
        problems.append(f"{len(wrong)} tensors with wrong shapes, e.g. {wrong[:3]}")
    if problems:
        raise CheckpointError(f"{reader.directory}: " + "; ".join(problems))
    dtypes = {reader.dtype(n) for n in expected}
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
