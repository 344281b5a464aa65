"""Tensors handed to an engine on the trainer's own machine without their bytes crossing the request: SGLang's
``/update_weights_from_tensor`` payload, for colocated training.

A payload is a pickle (torch's ``ForkingPickler``, base64) whose tensors are handles to memory the engine maps: CUDA
IPC on a GPU, shared memory on the CPU (``torch.multiprocessing``'s ``file_system`` strategy, which unrelated processes
can open). With ``load_format="flattened_bucket"`` it holds one uint8 tensor and, for each tensor in it, its name,
shape, dtype and byte span, as attributes of a ``types.SimpleNamespace``: SGLang 0.5.23 reads those attributes only,
and its restricted unpickler admits that class, where moerl could not pickle SGLang's own ``FlattenedTensorMetadata``
without importing SGLang. A CUDA tensor's device is written as its GPU's UUID (as SGLang's patched reductions write
it): the engine sees the GPU under another index when CUDA_VISIBLE_DEVICES differs.

The engine's side (:func:`load_payload`) unpickles with an allow-list: tensors, storages, dtypes, sizes and the
namespace; any other global is refused, since a pickle can otherwise run any code.
"""

from __future__ import annotations

import base64
import binascii
import collections
import contextlib
import io
import os
import pickle
import threading
import types
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as torch_mp
from torch.multiprocessing import reductions

from moerl.engines.protocol import ProtocolError

# The position of the storage's device among rebuild_cuda_tensor's arguments (torch's reduce_tensor; SGLang patches the
# same one).
_CUDA_DEVICE_ARG = 6
_sharing = threading.Lock()


# ---- the trainer's side ------------------------------------------------------------------------


def flattened_bucket(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """``named`` as SGLang's flattened bucket: their bytes back to back in one uint8 tensor (on their device, allocated
    where IPC can share it: :func:`shareable_allocations`) and each one's span."""
    if not named:
        raise ValueError("a bucket holds at least one tensor")
    metadata, start = [], 0
    for name, tensor in named:
        size = tensor.numel() * tensor.element_size()
        metadata.append(
            types.SimpleNamespace(
                name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=start, end_idx=start + size, numel=size
            )
        )
        start += size
    device = named[0][1].device
    with shareable_allocations(device):
        flat = torch.empty(start, dtype=torch.uint8, device=device)
    for (_, tensor), meta in zip(named, metadata, strict=True):
        flat[meta.start_idx : meta.end_idx].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return {"flattened_tensor": flat, "metadata": metadata}


@contextlib.contextmanager
def shareable_allocations(device: torch.device) -> Iterator[None]:
    """CUDA memory allocated within is in plain segments: CUDA IPC cannot share expandable segments' memory (the
    failure NeMo-RL #3782 reports), which ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` makes the default."""
    expandable = "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    if device.type != "cuda" or not expandable:
        yield
        return
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def serialize(payload: Any) -> str:
    """``payload`` (tensors in lists, tuples, dicts, namespaces) as a base64 pickle of handles to its tensors' memory.
    Each call makes handles of its own: SGLang's TP ranks each read their own entry, and CUDA IPC counts references
    per pickle. CPU tensors are moved into shared memory."""
    buffer = io.BytesIO()
    with _sharing:  # torch reads the strategy when it reduces a storage
        before = torch_mp.get_sharing_strategy()
        torch_mp.set_sharing_strategy("file_system")
        try:
            _HandlePickler(buffer).dump(payload)
        finally:
            torch_mp.set_sharing_strategy(before)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _reduce_tensor(tensor: torch.Tensor):
    rebuild, args = reductions.reduce_tensor(tensor.detach())
    if rebuild is reductions.rebuild_cuda_tensor:
        device = args[_CUDA_DEVICE_ARG]
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        args = (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1 :])
    return rebuild, args


class _HandlePickler(ForkingPickler):
    """torch's pickler of handles (``import torch.multiprocessing`` registers its reductions), CUDA devices written as
    UUIDs."""

    _extra_reducers = {
        **ForkingPickler._extra_reducers,  # type: ignore[attr-defined]
        torch.Tensor: _reduce_tensor,
        torch.nn.Parameter: _reduce_tensor,
    }


# ---- the engine's side -------------------------------------------------------------------------


def _rebuild_cuda_tensor(*args):
    """torch's rebuild of a CUDA IPC handle, its device given as an index or as its GPU's UUID."""
    device = args[_CUDA_DEVICE_ARG]
    if isinstance(device, str):
        found = [i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == device]
        if not found:
            raise ProtocolError(f"a tensor lives on GPU {device}, which this engine does not see")
        args = (*args[:_CUDA_DEVICE_ARG], found[0], *args[_CUDA_DEVICE_ARG + 1 :])
    return reductions.rebuild_cuda_tensor(*args)


def _allowed() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Tensor"): torch.Tensor,
        ("torch", "Size"): torch.Size,
        ("torch", "UntypedStorage"): torch.UntypedStorage,
        ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
        # a CUDA handle's storage class: torch's reduction passes its tensor's typed storage's type
        ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
        ("types", "SimpleNamespace"): types.SimpleNamespace,
        # SGLang's own bucket metadata (a client that imports SGLang sends it): a dataclass of the same attributes.
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): types.SimpleNamespace,
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
        # a tensor whose bytes travel in the payload (moerl.engines.delta.inline_payload): its storage torch.save'd,
        # opened here as weights only
        ("torch._utils", "_rebuild_tensor_v3"): torch._utils._rebuild_tensor_v3,
        ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
    }
    for name in ("rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_filename", "rebuild_storage_empty"):
        allowed["torch.multiprocessing.reductions", name] = getattr(reductions, name)
    for name in dir(torch):
        if isinstance(getattr(torch, name), torch.dtype):
            allowed["torch", name] = getattr(torch, name)
    return allowed


def _storage_from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


class _Unpickler(pickle.Unpickler):
    ALLOWED = _allowed()

    def find_class(self, module: str, name: str) -> Any:
        found = self.ALLOWED.get((module, name))
        if name == "rebuild_storage_fd":
            raise pickle.UnpicklingError(
                "CPU tensors shared by file descriptor cannot be opened by another process: pickle them under "
                "torch.multiprocessing.set_sharing_strategy('file_system')"
            )
        if found is None:
            raise pickle.UnpicklingError(
                f"{module}.{name} is not allowed (a payload holds tensors, their storages, dtypes, sizes and "
                "types.SimpleNamespace only)"
            )
        return found


def load_payload(entry: str, load_format: str | None, field: str = "serialized_named_tensors[0]") -> list:
    """The ``(name, tensor)`` pairs of one payload entry, its structure checked; :class:`ProtocolError` naming
    ``field`` for anything else. The tensors map the sender's memory: copy them before the sender frees it (it waits
    for the answer)."""
    try:
        raw = base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(f"{field}: not base64") from None
    try:
        payload = _Unpickler(io.BytesIO(raw)).load()
    except ProtocolError as e:
        raise ProtocolError(f"{field}: {e}") from None
    except Exception as e:  # noqa: BLE001 - whatever a bad pickle or a stale handle raises is the payload's fault
        raise ProtocolError(f"{field}: not a tensor payload ({type(e).__name__}: {e})") from None
    if load_format == "flattened_bucket":
        return _bucket_tensors(payload, field)
    if not isinstance(payload, list) or not all(
        isinstance(pair, (tuple, list))
        and len(pair) == 2
        and isinstance(pair[0], str)
        and isinstance(pair[1], torch.Tensor)
        for pair in payload
    ):
        raise ProtocolError(f"{field}: not a list of (name, tensor) pairs")
    return [tuple(pair) for pair in payload]


def _bucket_tensors(payload: Any, field: str) -> list[tuple[str, torch.Tensor]]:
    if not (
        isinstance(payload, dict)
        and set(payload) == {"flattened_tensor", "metadata"}
        and isinstance(flat := payload["flattened_tensor"], torch.Tensor)
        and flat.dtype == torch.uint8
        and flat.dim() == 1
        and isinstance(payload["metadata"], list)
    ):
        raise ProtocolError(
            f"{field}: a flattened bucket is {{'flattened_tensor': a 1-D uint8 tensor, 'metadata': a list}}"
        )
    named = []
    for i, meta in enumerate(payload["metadata"]):
        where = f"{field}: metadata[{i}]"
        try:
            name, shape, dtype = meta.name, meta.shape, meta.dtype
            start, end = meta.start_idx, meta.end_idx
        except AttributeError as e:
            raise ProtocolError(f"{where}: {e}") from None
        if not (
            isinstance(name, str)
            and isinstance(shape, torch.Size)
            and isinstance(dtype, torch.dtype)
            and type(start) is int
            and type(end) is int
        ):
            raise ProtocolError(f"{where}: name, shape, dtype, start_idx and end_idx must be str, Size, dtype, ints")
        size = shape.numel() * dtype.itemsize
        if not (0 <= start and end == start + size <= flat.numel() and start % dtype.itemsize == 0):
            raise ProtocolError(
                f"{where} ({name}): bytes [{start}, {end}) do not hold a {list(shape)} {dtype} tensor inside the "
                f"bucket's {flat.numel()} bytes"
            )
        named.append((name, flat[start:end].view(dtype).reshape(shape)))
    return named
