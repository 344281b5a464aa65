"""Delta weight pushes (``sync.delta``): after a step the trainer sends, per Hub tensor, only the elements whose bits
changed since the engines' version, and the engine writes them where a full push would have.

The codec (:func:`encode`, :func:`decode`) runs on both sides. A tensor sent whole keeps its Hub name; one sent as a
delta becomes three tensors named ``f"{name}{SEP}{part}"``:

- ``shape``: int64 ``[ndim]``, the tensor's shape (the engine maps the delta through its loader by shape);
- ``indices``: the changed elements' flat (row-major) positions, ascending, int32 (int64 from ``2**31`` elements on);
  or ``mask``: uint8 ``[ceil(numel / 8)]``, flat element ``i`` at bit ``7 - i % 8`` of byte ``i // 8`` (NumPy's
  ``np.packbits`` in its default ``bitorder="big"``), the padding bits zero;
- ``values``: the changed elements in flat order, in the tensor's dtype.

The engine's side: :func:`apply_to` writes a delta into a view of the tensor as the engine holds it (moerl's embedded
engine); :func:`apply_delta` is SGLang's custom weight loader (``--custom-weight-loader`` :data:`LOAD_FORMAT`, the
same string as the ``load_format`` of ``/update_weights_from_tensor``). SGLang's loaders fuse, stack and shard the Hub
tensors into its own parameters; rather than repeat that mapping per model, :func:`apply_delta` runs the model's own
``load_weights`` once per tensor on a probe, records where each ``copy_`` of it would write (skipping the copies) and
writes a delta's elements along the recorded views. A loader that computes on the values first (a cast, a copy into
contiguous memory, a concatenation) cannot be followed so, and is refused (:class:`DeltaRefused`).

This module is imported inside SGLang's server: stdlib and torch only.
"""

from __future__ import annotations

import base64
import collections
import copyreg
import gc
import io
import pickle
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

LOAD_FORMAT = "moerl.engines.delta.apply_delta"
SEP = "@delta:"  # never in a Hub name, whose parts are identifiers and numbers joined by dots
SHAPE, INDICES, MASK, VALUES = "shape", "indices", "mask", "values"
# Probes of at most this many bytes are loaded together (a single larger tensor alone): a delta bucket can name far
# more tensors than a full one holds.
PROBE_BYTES = 1 << 30

# The integer dtype of each element size: bits compared and written through it (NaN and -0.0 compare by their bits;
# float8 has no index_put_ on every device).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# A mask byte's bits, first element in the high bit (np.packbits's "big" order).
_BIT_WEIGHTS = [128, 64, 32, 16, 8, 4, 2, 1]


@dataclass
class Encoding:
    """What :func:`encode` chose for one tensor."""

    named: list[tuple[str, torch.Tensor]]  # what goes on the wire for it ([]: nothing changed)
    changed: int  # elements whose bits changed (all of them for a tensor new, reshaped or recast)
    numel: int
    sent_bytes: int  # bytes of ``named``
    full_bytes: int  # bytes of the tensor itself


@dataclass
class Delta:
    """The changed elements of a Hub tensor of ``shape``: ``values`` (its dtype) at flat positions ``indices``
    (int64, ascending)."""

    indices: torch.Tensor
    values: torch.Tensor
    shape: torch.Size


class DeltaRefused(RuntimeError):
    """The engine's loader does something to a tensor that a delta cannot follow."""


# ---- the codec -----------------------------------------------------------------------------------


def encode(name: str, previous: torch.Tensor | None, current: torch.Tensor, max_fraction: float = 0.5) -> Encoding:
    """``current`` as the engines holding ``previous`` need it: nothing if no element's bits changed; else the smallest
    of a delta by indices, a delta by mask, and the whole tensor, the whole tensor whenever the smaller delta takes at
    least ``max_fraction`` of its bytes. ``previous`` None, of another shape or dtype, or of a dtype without an integer
    twin: the whole tensor. The wire tensors are on ``current``'s device."""
    current = current.detach()
    numel, itemsize = current.numel(), current.element_size()
    full_bytes = numel * itemsize
    if previous is None or previous.shape != current.shape or previous.dtype != current.dtype or itemsize not in _BITS:
        return Encoding([(name, current)], numel, numel, full_bytes, full_bytes)
    bits = _flat_bits(current)
    differ = _flat_bits(previous.detach().to(current.device)) != bits
    changed = int(differ.sum())
    if changed == 0:
        return Encoding([], 0, numel, 0, full_bytes)
    index_dtype = torch.int32 if numel < 2**31 else torch.int64
    fixed = 8 * current.dim() + changed * itemsize  # the shape and the values
    by_indices = fixed + changed * index_dtype.itemsize
    by_mask = fixed + (numel + 7) // 8
    if min(by_indices, by_mask) >= max_fraction * full_bytes:
        return Encoding([(name, current)], changed, numel, full_bytes, full_bytes)
    positions = differ.nonzero().squeeze(1)
    where = (
        (f"{name}{SEP}{INDICES}", positions.to(index_dtype))
        if by_indices <= by_mask
        else (f"{name}{SEP}{MASK}", _pack(differ))
    )
    named = [
        (f"{name}{SEP}{SHAPE}", torch.tensor(list(current.shape), dtype=torch.int64, device=current.device)),
        where,
        (f"{name}{SEP}{VALUES}", bits[positions].view(current.dtype)),
    ]
    return Encoding(named, changed, numel, sum(t.numel() * t.element_size() for _, t in named), full_bytes)


def decode(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor | Delta]]:
    """The wire tensors of :func:`encode` back to ``(name, whole tensor)`` and ``(name, Delta)``, in the order each
    name first came. A delta's parts incomplete, doubled or inconsistent, or a name sent both ways: ValueError naming
    the tensor."""
    sent: dict[str, torch.Tensor | dict[str, torch.Tensor]] = {}
    for wire_name, tensor in named:
        name, sep, part = wire_name.partition(SEP)
        known = sent.get(name)
        if not sep:
            if known is not None:
                again = "twice" if isinstance(known, torch.Tensor) else "and as a delta"
                raise ValueError(f"{name}: sent whole {again}")
            sent[name] = tensor
            continue
        if isinstance(known, torch.Tensor):
            raise ValueError(f"{name}: sent whole and as a delta")
        if part not in (SHAPE, INDICES, MASK, VALUES):
            raise ValueError(f"{name}: unknown delta part {part!r}")
        if known is None:
            known = sent[name] = {}
        if part in known:
            raise ValueError(f"{name}: its delta's {part} sent twice")
        known[part] = tensor
    return [(name, got if isinstance(got, torch.Tensor) else _delta(name, got)) for name, got in sent.items()]


def _delta(name: str, parts: dict[str, torch.Tensor]) -> Delta:
    if set(parts) not in ({SHAPE, INDICES, VALUES}, {SHAPE, MASK, VALUES}):
        raise ValueError(
            f"{name}: a delta is its shape, its values and either its indices or its mask; got {sorted(parts)}"
        )
    sizes, values = parts[SHAPE], parts[VALUES]
    if sizes.dtype != torch.int64 or sizes.dim() != 1 or bool((sizes < 0).any()):
        raise ValueError(f"{name}: a delta's shape is a 1-D int64 tensor of sizes")
    shape = torch.Size(sizes.tolist())
    if values.dim() != 1:
        raise ValueError(f"{name}: a delta's values are 1-D, not {list(values.shape)}")
    if MASK in parts:
        indices = _unpack(name, parts[MASK], shape.numel())
    else:
        indices = parts[INDICES]
        if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 1:
            raise ValueError(f"{name}: a delta's indices are a 1-D int32 or int64 tensor")
        indices = indices.long()
        if len(indices) and not (int(indices[0]) >= 0 and int(indices[-1]) < shape.numel()):
            raise ValueError(f"{name}: indices outside the {shape.numel()} elements of a {list(shape)} tensor")
        if not bool((indices[1:] > indices[:-1]).all()):
            raise ValueError(f"{name}: a delta's indices are strictly ascending")
    if len(indices) != len(values):
        raise ValueError(f"{name}: {len(indices)} changed elements but {len(values)} values")
    return Delta(indices, values, shape)


def _flat_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(_BITS[tensor.element_size()]).reshape(-1)


def _pack(mask: torch.Tensor) -> torch.Tensor:
    """np.packbits of a flat bool tensor, computed where it lies."""
    padded = torch.zeros((mask.numel() + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[: mask.numel()] = mask
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def _unpack(name: str, mask: torch.Tensor, numel: int) -> torch.Tensor:
    """The flat positions a :func:`_pack` mask of ``numel`` elements sets."""
    if mask.dtype != torch.uint8 or mask.shape != ((numel + 7) // 8,):
        raise ValueError(f"{name}: the mask of {numel} elements is a uint8 tensor of {(numel + 7) // 8} bytes")
    shifts = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8, device=mask.device)
    bits = ((mask.unsqueeze(1) >> shifts) & 1).reshape(-1)
    if bool(bits[numel:].any()):
        raise ValueError(f"{name}: the mask sets bits past the tensor's {numel} elements")
    return bits[:numel].nonzero().squeeze(1)


def apply_to(view: torch.Tensor, delta: Delta) -> None:
    """Write ``delta``'s values at its flat positions of ``view`` (the tensor as the engine holds it: any strides, any
    dtype, the values cast as ``copy_`` would)."""
    if view.shape != delta.shape:
        raise ValueError(f"a delta of a {list(delta.shape)} tensor written into a {list(view.shape)} view")
    if view.dim() == 0:  # a 1-element view of it, which unravel_index can index
        view = view.unsqueeze(0)
    indices = delta.indices.to(view.device)
    _put(view, torch.unravel_index(indices, view.shape), delta.values)


def _put(target: torch.Tensor, index: tuple[torch.Tensor, ...], values: torch.Tensor) -> None:
    values = values.to(target.device).to(target.dtype)  # the cast copy_ makes
    bits = _BITS[target.element_size()]
    with torch.no_grad():
        target.view(bits).index_put_(index, values.view(bits))


def inline_payload(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """``named`` as an entry of ``/update_weights_from_tensor``'s ``serialized_named_tensors`` whose bytes travel in
    the request: a base64 pickle that SGLang's restricted unpickler opens (``MultiprocessingSerializer.deserialize``).
    Each tensor's bytes are pickled as a uint8 storage rebuilt under its dtype (``torch._utils._rebuild_tensor_v3``):
    torch pickles a float8 tensor's storage untyped, which that unpickler cannot load."""
    buffer = io.BytesIO()
    _InlinePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump([(name, tensor) for name, tensor in named])
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _reduce_inline(tensor: torch.Tensor):
    tensor = tensor.detach().cpu()
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone(memory_format=torch.contiguous_format)  # pickle sends a view's whole storage
    storage = torch.storage.TypedStorage(wrap_storage=tensor.untyped_storage(), dtype=torch.uint8, _internal=True)
    args: tuple = (storage, 0, tensor.shape, tensor.stride(), False, collections.OrderedDict(), tensor.dtype)
    return torch._utils._rebuild_tensor_v3, args


class _InlinePickler(pickle.Pickler):
    dispatch_table = {**copyreg.dispatch_table, torch.Tensor: _reduce_inline, torch.nn.Parameter: _reduce_inline}


# ---- SGLang's loader -------------------------------------------------------------------------------


def apply_delta(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader for :func:`encode`'s wire tensors: whole tensors through ``model.load_weights``,
    deltas written where ``load_weights`` would have written their elements (bitwise as a full push would). Every
    delta's tensor is mapped before anything is written. SGLang 0.5.23 calls it as ``fn(model, named_tensors)`` and
    its scheduler dies on what it raises: a refusal (:class:`DeltaRefused`) or a malformed payload (ValueError) takes
    the server down."""
    decoded = decode(named_tensors)
    deltas = [(name, d) for name, d in decoded if isinstance(d, Delta) and len(d.indices)]
    targets = _Targets.of(model)
    writes = targets.copies_of(model, [(name, d.shape, d.values.dtype, d.values.device) for name, d in deltas])
    whole = [(name, t) for name, t in decoded if isinstance(t, torch.Tensor)]
    if whole:
        _load_weights(model, whole)
    tensors = targets.tensors(model)
    for (_, delta), copies in zip(deltas, writes, strict=True):
        for copy in copies:
            storage = tensors[copy.target].untyped_storage()
            flat = torch.empty(0, dtype=copy.dtype, device=storage.device).set_(storage)
            positions, values = copy.map(delta.indices.to(storage.device), delta.values)
            _put(flat, (positions,), values)


def _load_weights(model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's models' own loader (not a method nn.Module declares)."""
    cast(Callable[[list[tuple[str, torch.Tensor]]], object], model.load_weights)(named)


@dataclass(frozen=True)
class _Strided:
    """A view of a storage, in elements of its dtype."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Strided:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset()))

    def broadcast_to(self, sizes: tuple[int, ...]) -> _Strided:
        """This view expanded to ``sizes``, as copy_ broadcasts its source."""
        own = list(zip(self.sizes, self.strides, strict=True))
        own = [(1, 0)] * (len(sizes) - len(own)) + own[max(0, len(own) - len(sizes)) :]
        strides = tuple(0 if mine == 1 else stride for (mine, stride) in own)
        return _Strided(sizes, strides, self.offset)

    def nested(self) -> bool:
        """Whether, taken largest stride first, each dimension's stride exceeds the span of those after it: an element
        is then reached by one index, which :meth:`_Copy.map` finds by division. Dimensions of size 1 or stride 0
        aside."""
        span = 0
        for size, stride in sorted(
            ((size, stride) for size, stride in zip(self.sizes, self.strides, strict=True) if size > 1 and stride),
            key=lambda pair: pair[1],
        ):
            if stride <= span:
                return False
            span += (size - 1) * stride
        return True


@dataclass(frozen=True)
class _Copy:
    """One ``copy_`` a loader made of a probe: the probe's elements at ``src`` (a view of the contiguous probe, whose
    storage offsets are flat positions; broadcast to ``dst``'s sizes) into ``dst`` of the storage of the model's tensor
    ``target`` viewed as ``dtype``; that storage was at ``data_ptr`` when recorded."""

    src: _Strided
    dst: _Strided
    target: str
    data_ptr: int
    dtype: torch.dtype

    def map(self, indices: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``dst`` positions of the flat probe positions ``indices`` that this copy covers (a TP rank's slice:
        maybe none), each with its value; an element broadcast along a dimension goes to each position along it."""
        values = values.to(indices.device)
        src, dst = self.src, self.dst
        rest, covered = indices - src.offset, indices >= src.offset
        positions = torch.full_like(indices, dst.offset)
        strided = [d for d, n in enumerate(src.sizes) if n > 1 and src.strides[d]]
        for d in sorted(strided, key=lambda d: -src.strides[d]):
            step = torch.div(rest, src.strides[d], rounding_mode="floor")
            rest = rest - step * src.strides[d]
            covered &= step < src.sizes[d]
            positions += step * dst.strides[d]
        covered &= rest == 0
        positions, values = positions[covered], values[covered]
        for d, n in enumerate(src.sizes):
            if n > 1 and not src.strides[d]:
                along = torch.arange(n, device=indices.device) * dst.strides[d]
                positions = (positions.unsqueeze(1) + along).reshape(-1)
                values = values.repeat_interleave(n)
        return positions, values


_Key = tuple[str, torch.Size, torch.dtype]
_StorageKey = tuple[torch.device, int]


@dataclass(frozen=True)
class _RawCopy:
    """A copy as recorded, its destination known by its storage."""

    src: _Strided
    dst: _Strided
    storage: _StorageKey
    dtype: torch.dtype


class _Targets:
    """A model's recorded copies per Hub tensor (name, shape, dtype): view descriptors, not positions."""

    _of: weakref.WeakKeyDictionary[torch.nn.Module, _Targets] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.copies: dict[_Key, list[_Copy]] = {}

    @classmethod
    def of(cls, model: torch.nn.Module) -> _Targets:
        if model not in cls._of:
            cls._of[model] = cls()
        return cls._of[model]

    @staticmethod
    def tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers by name, tied ones under each name."""
        found = dict(model.named_buffers(remove_duplicate=False))
        found.update(model.named_parameters(remove_duplicate=False))
        return {name: tensor.data for name, tensor in found.items()}

    def copies_of(
        self, model: torch.nn.Module, wanted: list[tuple[str, torch.Size, torch.dtype, torch.device]]
    ) -> list[list[_Copy]]:
        """The copies of each wanted tensor, probing those not recorded yet or recorded into a storage since replaced
        (SGLang may swap weights' storage around an update), at most :data:`PROBE_BYTES` of probes at a time."""
        tensors = self.tensors(model)

        def recorded(key: _Key) -> bool:
            copies = self.copies.get(key)
            return copies is not None and all(
                c.target in tensors and tensors[c.target].untyped_storage().data_ptr() == c.data_ptr for c in copies
            )

        batch: list[tuple[_Key, torch.device]] = []
        size = 0
        for name, shape, dtype, device in wanted:
            if recorded(key := (name, shape, dtype)):
                continue
            nbytes = shape.numel() * dtype.itemsize
            if batch and size + nbytes > PROBE_BYTES:
                self.probe(model, batch)
                batch, size = [], 0
            batch.append((key, device))
            size += nbytes
        if batch:
            self.probe(model, batch)
        return [self.copies[(name, shape, dtype)] for name, shape, dtype, _ in wanted]

    def probe(self, model: torch.nn.Module, keys: list[tuple[_Key, torch.device]]) -> None:
        """Run ``model.load_weights`` on an uninitialised probe of each tensor, its copies recorded and not made."""
        probes = [(name, torch.empty(shape, dtype=dtype, device=device)) for (name, shape, dtype), device in keys]
        recorder = _Recorder({_storage_key(probe): (name, probe.dtype) for name, probe in probes if probe.numel()})
        alive = [weakref.ref(probe) for _, probe in probes]
        with torch.no_grad(), recorder:
            _load_weights(model, probes)
        del probes
        if any(ref() is not None for ref in alive):
            gc.collect()  # a reference cycle the loader left, or a tensor it kept
        kept = [name for ((name, _, _), _), ref in zip(keys, alive, strict=True) if ref() is not None]
        if kept:
            raise DeltaRefused(
                f"{kept[0]}: the engine's loader keeps the tensor to combine it with others later, so a delta of it "
                "cannot be written alone; set sync.delta=false"
            )
        owners: dict[_StorageKey, str] = {}
        for target, tensor in self.tensors(model).items():
            owners.setdefault(_storage_key(tensor), target)
        for key, _ in keys:
            self.copies[key] = [_resolved(key[0], raw, owners) for raw in recorder.copies.get(key[0], [])]


def _resolved(name: str, raw: _RawCopy, owners: dict[_StorageKey, str]) -> _Copy:
    target = owners.get(raw.storage)
    if target is None:
        raise DeltaRefused(
            f"{name}: the engine's loader writes it into a tensor that is not a parameter or buffer of the model; "
            "set sync.delta=false"
        )
    return _Copy(raw.src, raw.dst, target, raw.storage[1], raw.dtype)


def _storage_key(tensor: torch.Tensor) -> _StorageKey:
    return tensor.device, tensor.untyped_storage().data_ptr()


class _Recorder(TorchDispatchMode):
    """Within it, a ``copy_`` from a probe (``probes``: storage -> (name, dtype)) is recorded and not made; any other
    in-place write is not made either (a full push made it already, and a probe must leave the model as it was); any
    other use of a probe's values is refused."""

    def __init__(self, probes: dict[_StorageKey, tuple[str, torch.dtype]]):
        super().__init__()
        self.probes = probes
        self.copies: dict[str, list[_RawCopy]] = {}

    def probe_of(self, tensor: torch.Tensor) -> tuple[str, torch.dtype] | None:
        if tensor.numel() == 0:  # empty tensors may share data_ptr 0
            return None
        return self.probes.get(_storage_key(tensor))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        used = [p[0] for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and (p := self.probe_of(t))]
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            probe = self.probe_of(src)
            if probe is not None and self.probe_of(dst) is None:
                self.record(probe, dst, src)
                return dst
        if func._schema.is_mutable:
            if used or not func._schema.name.endswith("_"):
                raise DeltaRefused(_refusal(used[0] if used else "a tensor", f"{func} writes"))
            return args[0]  # an in-place write, not made
        if used and not func.is_view:
            raise DeltaRefused(_refusal(used[0], str(func)))
        return func(*args, **kwargs)

    def record(self, probe: tuple[str, torch.dtype], dst: torch.Tensor, src: torch.Tensor) -> None:
        name, dtype = probe
        view = _Strided.of(src).broadcast_to(tuple(dst.shape))
        if src.dtype != dtype:
            raise DeltaRefused(_refusal(name, f"a copy of it viewed as {src.dtype}"))
        if not view.nested():
            raise DeltaRefused(_refusal(name, f"a copy of an overlapping view of it, {view}"))
        self.copies.setdefault(name, []).append(_RawCopy(view, _Strided.of(dst), _storage_key(dst), dst.dtype))


def _refusal(name: str, what: str) -> str:
    return (
        f"{name}: the engine's loader computes on the tensor's values ({what}) instead of copying views of it into "
        "its parameters, so a delta cannot be mapped onto them; set sync.delta=false"
    )
