"""Whole (unsharded, global-name) parameters or gradients of a sharded Megatron model, gathered toward global rank 0.

Undoes every split a layout makes: TP shards along each parameter's ``partition_dim``, a routed expert's
along its layer's (GLU ``linear_fc1`` shards are [gate_r; up_r] each), expert-parallel local expert indices, and
pipeline-stage local layer numbers. The result is keyed like a TP1/EP1/PP1 model, which is what
the HF mapping rules speak.

Each tensor travels only toward the rank that needs it, on its device, as a tensor (nothing is
pickled): a TP-sharded parameter is gathered over its TP (or expert-TP) group into that group's first
rank, an expert's weights over the expert-parallel group into its first rank, and only the first
data-parallel replica takes part (the others hold copies). The first rank of each pipeline stage then
holds its stage's tensors whole and sends them to global rank 0 point to point. So rank 0 takes in at
most the model once, every other rank at most its own group's share, most ranks nothing.

With ``per_sender`` nothing goes to rank 0, and experts are not gathered over the expert-parallel group:
each tensor stays whole where its TP (or expert-TP) gather ends: a stage's dense tensors on the ranks of
its first TP group that send (spread by bytes), and each expert-parallel rank's own experts on its
expert-TP group's first rank (:func:`sends_weights`), each of which sends them to the engines itself.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from moerl.megatron.parallel import collective_device

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
# Transformer Engine's TEGroupedMLP names local expert i "experts.linear_fc1.weight{i}".
_GROUPED_EXPERT = re.compile(r"\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
# Transformer Engine fuses the attention's input norm into linear_qkv, and a dense layer's pre-MLP norm
# into linear_fc1: their weights carry the local spec's names in the global model.
_TE_FUSED_NORMS = (
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
)
# The dim a routed expert's expert-TP shards split (whichever of its weight, bias and LoRA factors is split), by its
# layer: column-parallel linear_fc1, row-parallel linear_fc2. The local spec's SequentialMLP marks partition_dim so;
# Transformer Engine's spec does not: under expert TP or EP, TEGroupedLinear splits the experts itself and builds TE's
# layer with parallel_mode=None, which marks every weight partition_dim=0, linear_fc2's [hidden, ffn/etp] included.
_EXPERT_LINEAR = re.compile(r"\.local_experts\.\d+\.(linear_fc[12])\.")
_EXPERT_SPLIT_DIM = {"linear_fc1": 0, "linear_fc2": 1}
# What a pipeline stage's first rank yields, in its order: (global name, whole shape, dtype) of each tensor.
_Manifest: TypeAlias = list[tuple[str, tuple[int, ...], torch.dtype]]


def global_name(model, name: str) -> str:
    """``name`` of this rank's parameter as a TP1/EP1/PP1 model calls it (global layer and expert numbers)."""
    match = _LAYER.match(name)
    if match:
        layer = model.decoder.layers[int(match.group(1))].layer_number - 1
        name = f"decoder.layers.{layer}." + name[match.end() :]
    name = _GROUPED_EXPERT.sub(r".experts.local_experts.\3.\1.\2", name)
    for fused, plain in _TE_FUSED_NORMS:
        if name.endswith(fused):
            name = name[: -len(fused)] + plain
    match = _EXPERT.search(name)
    if match:
        num_local = model.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
        expert = parallel_state.get_expert_model_parallel_rank() * num_local + int(match.group(1))
        name = name[: match.start()] + f".local_experts.{expert}." + name[match.end() :]
    return name


@dataclass
class _Entry:
    """One local parameter this rank takes part in gathering."""

    param: torch.nn.Parameter
    names: list[str]  # the global names it yields at its stage's first rank: one, or one per expert-parallel rank
    shape: tuple[int, ...]  # whole (TP-gathered) shape
    group: dist.ProcessGroup | None  # the TP or expert-TP group that shards it (None: not sharded, or a group of one)
    dim: int | None  # the dim its shards split (None: not sharded)
    ep_group: dist.ProcessGroup | None  # routed experts under expert parallelism: the group gathered over next
    glu: bool  # a GLU linear_fc1 (or its LoRA B): each TP shard is [gate_r; up_r]
    dst: int = 0  # the rank in ``group`` it is gathered into


def stage_lead() -> bool:
    """Whether this rank is its pipeline stage's first in every group (TP, DP, EP, expert-TP, expert-DP): the
    rank where :class:`Gather` assembles the stage."""
    ps = parallel_state
    return (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
        and ps.get_expert_model_parallel_rank() == 0
        and ps.get_expert_tensor_parallel_rank() == 0
        and ps.get_expert_data_parallel_rank() == 0
    )


def sends_weights() -> bool:
    """Whether a ``per_sender`` :class:`Gather` leaves whole tensors on this rank: its stage's first rank, and
    under expert parallelism the first expert-TP rank of each expert-parallel rank (first expert-DP replica)."""
    ps = parallel_state
    return stage_lead() or (
        ps.get_expert_model_parallel_world_size() > 1
        and ps.get_expert_tensor_parallel_rank() == 0
        and ps.get_expert_data_parallel_rank() == 0
    )


class Gather:
    """Collects a sharded model's parameters (or gradients) whole on global rank 0, layer by layer; or, with
    ``per_sender``, on the ranks that send them (:func:`sends_weights`), each its own share.

    Built once per model on every rank (collective: each pipeline stage's first rank tells rank 0 the
    names, shapes and dtypes it holds); :meth:`gather` is collective too. ``select(global_name)``
    fixes the parameters it can ever return; :attr:`received` counts the bytes this rank's collectives
    took in, for tests and benchmarks.
    """

    def __init__(
        self, model, grads: bool = False, select: Callable[[str], bool] | None = None, per_sender: bool = False
    ):
        self.grads, self.per_sender = grads, per_sender
        self.received = 0
        ps = parallel_state
        glu_names = ("linear_fc1.weight", "linear_fc1.lora_B")  # a LoRA B splits like its weight
        ep = ps.get_expert_model_parallel_world_size()
        num_local = (model.config.num_moe_experts or ep) // ep
        dense_copy = ps.get_data_parallel_rank() == 0
        expert_copy = ps.get_expert_data_parallel_rank() == 0
        self._entries: list[_Entry] = []
        for name, param in model.named_parameters():
            # A last pipeline stage keeps its own copy of tied embeddings (kept equal, and its
            # gradient summed with the first stage's, by megatron); the first stage's is the one.
            if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
                continue
            full = global_name(model, name)
            if select is not None and not select(full):
                continue
            expert = ".experts." in full
            if not (expert_copy if expert else dense_copy):
                continue
            group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
            size = dist.get_world_size(group)
            sharded = getattr(param, "tensor_model_parallel", False) and size > 1
            if not sharded and size > 1 and dist.get_rank(group) != 0:
                continue  # a replicated copy: the group's first rank has it
            shape = list(param.shape)
            dim = _split_dim(full, param) if sharded else None
            if dim is not None:
                shape[dim] *= size
            names = [full]
            gathers_experts = expert and ep > 1 and not per_sender
            if gathers_experts:
                expert_number = _EXPERT.search(full)
                assert expert_number is not None, f"{full}: an expert's global name has its expert number"
                local = int(expert_number.group(1)) % num_local
                names = [_EXPERT.sub(f".local_experts.{j * num_local + local}.", full, count=1) for j in range(ep)]
            self._entries.append(
                _Entry(
                    param,
                    names,
                    tuple(shape),
                    group if sharded else None,
                    dim,
                    ps.get_expert_model_parallel_group() if gathers_experts else None,
                    glu=model.config.gated_linear_unit and full.endswith(glu_names),
                )
            )
        self.lead = stage_lead()
        self.sends = sends_weights() if per_sender else dist.get_rank() == 0  # where gather() returns tensors
        if per_sender:
            self._spread_over_senders()
            return  # each sender keeps its own share: rank 0 receives nothing, needs no manifest
        # What each stage's first rank yields, in its order: rank 0 receives the later stages' by it.
        manifest: _Manifest | None = (
            [(n, e.shape, self._tensor(e.param).dtype) for e in self._entries for n in e.names] if self.lead else None
        )
        # Each rank's (pipeline stage, manifest), on rank 0; gather_object replaces every placeholder.
        everyone: list[tuple[int, _Manifest | None]] | None = (
            [(-1, None)] * dist.get_world_size() if dist.get_rank() == 0 else None
        )
        # once per model: names and shapes, no tensor
        dist.gather_object((ps.get_pipeline_model_parallel_rank(), manifest), everyone, dst=0)
        self._senders: list[tuple[int, _Manifest]] = []  # (rank, manifest) of each stage's first rank
        problem = None
        if everyone is not None:  # global rank 0
            for stage in range(ps.get_pipeline_model_parallel_world_size()):
                leads = [(rank, m) for rank, (s, m) in enumerate(everyone) if s == stage and m is not None]
                if len(leads) != 1 or (stage == 0 and leads[0][0] != 0):
                    problem = (
                        f"pipeline stage {stage}: ranks {[r for r, _ in leads]} are first in all their groups; "
                        "the export needs exactly one, and global rank 0 for stage 0"
                    )
                    break
                self._senders.append(leads[0])
        ok = torch.tensor([problem is None], dtype=torch.int32, device=collective_device())
        dist.broadcast(ok, 0)  # every rank fails together, none waits in a gather for a rank that gave up
        if not ok.item():
            raise RuntimeError(
                problem or "the weight gather's layout check failed on global rank 0 (its error says why)"
            )

    def _spread_over_senders(self) -> None:
        """Gathers each TP-sharded dense tensor into the sender of its TP group that has the fewest bytes to send so
        far, so that no sender sends the whole stage's dense tensors while its TP peers that send experts wait
        for it (at TP2xEP2 the stage's first rank sent 0.72 of the model, its peer 0.28). Collective over the
        TP group of the first data-parallel replica, once per model: each member's flag and byte count."""
        ps = parallel_state
        if ps.get_tensor_model_parallel_world_size() == 1 or ps.get_data_parallel_rank() != 0:
            return

        def spread(entry: _Entry) -> bool:
            return entry.group is not None and ".experts." not in entry.names[0]

        dense = [e for e in self._entries if spread(e)]
        fixed = sum(
            _nbytes(e.shape, self._tensor(e.param).dtype) * len(e.names)
            for e in self._entries
            if not spread(e) and (e.group is None or dist.get_rank(e.group) == 0)
        )
        # Each member's (whether it sends, bytes it sends); all_gather_object replaces every placeholder.
        members: list[tuple[bool, int]] = [(False, 0)] * ps.get_tensor_model_parallel_world_size()
        dist.all_gather_object(members, (self.sends, fixed), group=ps.get_tensor_model_parallel_group())
        load = {i: nbytes for i, (sends, nbytes) in enumerate(members) if sends}
        for entry in dense:  # the same entries, in the same order, on every member
            entry.dst = min(load, key=lambda i: (load[i], i))
            load[entry.dst] += _nbytes(entry.shape, self._tensor(entry.param).dtype)

    def _tensor(self, param: torch.nn.Parameter) -> torch.Tensor:
        if not self.grads:
            return param.data
        grad = getattr(param, "main_grad", None)
        if grad is None:
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
        return grad

    def gather(self, select: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor] | None:
        """The selected tensors whole, on rank 0's device (None on every other rank); ``per_sender``: on each rank
        that :attr:`sends`, its share of them (None on the others). Collective: call on all ranks."""

        def wanted(name: str) -> bool:
            return select is None or select(name)

        mine: list[tuple[str, torch.Tensor]] = []
        # each group's members gather alike; every side then keeps the names ``select`` takes
        for entry in self._entries:
            if any(wanted(name) for name in entry.names):
                mine += [(name, tensor) for name, tensor in self._gather_entry(entry) if wanted(name)]
        if self.per_sender:
            return dict(mine) if self.sends else None
        if dist.get_rank() != 0:
            for _, tensor in mine:  # only a stage's first rank holds any
                dist.send(tensor.contiguous(), 0)
            return None
        full = dict(mine)
        device = collective_device()
        for rank, manifest in self._senders[1:]:
            for name, shape, dtype in manifest:
                if wanted(name):
                    tensor = torch.empty(shape, dtype=dtype, device=device)
                    dist.recv(tensor, rank)
                    self.received += tensor.numel() * tensor.element_size()
                    full[name] = tensor
        return full

    def _gather_entry(self, entry: _Entry) -> list[tuple[str, torch.Tensor]]:
        """This entry whole on the rank its gathers end on (its stage's first, or with ``per_sender`` a sender of its TP
        group); nothing on the others."""
        tensor = self._tensor(entry.param).detach()
        if entry.group is not None:
            dim = entry.dim
            assert dim is not None, "a sharded entry has its split dim"
            whole = None
            # the shards are consecutive rows of the whole: received in place, not joined
            if dim == 0 and not entry.glu:
                whole = torch.empty(entry.shape, dtype=tensor.dtype, device=tensor.device)
            parts = self._gather_into(tensor, entry.group, entry.dst, whole)
            if parts is None:
                return []
            if whole is not None:
                tensor = whole
            elif entry.glu:  # each shard is [gate_r; up_r]: the whole is [gate; up]
                halves = [s.chunk(2, dim=dim) for s in parts]
                tensor = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
            else:
                tensor = torch.cat(parts, dim=dim)
        if entry.ep_group is None:
            return [(entry.names[0], tensor)]
        parts = self._gather_into(tensor, entry.ep_group)
        return [] if parts is None else list(zip(entry.names, parts, strict=True))  # a name per expert-parallel rank

    def _gather_into(
        self, tensor: torch.Tensor, group, dst: int = 0, whole: torch.Tensor | None = None
    ) -> list[torch.Tensor] | None:
        """Every member's ``tensor`` (same shape on all), on the group's rank ``dst`` (into the consecutive rows of
        ``whole`` when given); None on the others."""
        tensor = tensor.contiguous()
        target = dist.get_global_rank(group, dst)
        if dist.get_rank() != target:
            dist.gather(tensor, None, dst=target, group=group)
            return None
        size = dist.get_world_size(group)
        parts = list(whole.chunk(size)) if whole is not None else [torch.empty_like(tensor) for _ in range(size)]
        dist.gather(tensor, parts, dst=target, group=group)
        self.received += tensor.numel() * tensor.element_size() * (size - 1)
        return parts


def _split_dim(full: str, param: torch.nn.Parameter) -> int:
    """The dim the TP (or expert-TP) shards of ``param``, named ``full`` globally, split."""
    expert = _EXPERT_LINEAR.search(full)
    return _EXPERT_SPLIT_DIM[expert.group(1)] if expert else param.partition_dim  # type: ignore[attr-defined]  # megatron's own mark, not in torch's stubs


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize
