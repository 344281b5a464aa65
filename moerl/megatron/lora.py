"""Per-expert LoRA on a megatron-core model: every targeted linear layer (attention's linear_qkv and
linear_proj; each local expert's, each shared expert's and each dense MLP's linear_fc1 and linear_fc2)
gets its own A/B pair, and the base weights are frozen.

megatron-core has no LoRA of its own, so the adapters are attached here, to megatron's own
``ColumnParallelLinear`` / ``RowParallelLinear`` modules (the local layer spec), as two parameters
``lora_A`` [r, in] and ``lora_B`` [out, r] and a forward hook that adds ``scale * B(A(x))`` to the
module's output. Each adapter is split across tensor-parallel ranks the way its base weight is: a
column-parallel layer splits B by output rows (A whole on every rank), a row-parallel layer splits A
by input columns (B whole). The hook reproduces the base layer's communication exactly (sequence-
parallel gather / reduce-scatter, or expert-parallel partial sums left to the token dispatcher), and
wraps the whole-on-every-rank factor in a copy whose backward all-reduces its gradient wherever that
factor saw only part of the tokens or of the output, so every rank keeps an identical copy.

Initialisation depends only on the seed and the parameter's global name (layer, expert), never on
the layout: the same run at EP1, EP2 or TP2+EP2 starts from the same adapters.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from moerl.errors import LoRAError
from moerl.megatron.lora_config import LoRAConfig
from moerl.megatron.weights import global_name


def add_lora(model: torch.nn.Module, cfg: LoRAConfig) -> list[str]:
    """Freeze ``model`` and attach adapters to every targeted linear layer; their module paths.

    Call after the base weights are loaded (a base checkpoint has no adapter tensors)."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapted, refused = [], []
    for path, module in model.named_modules():
        if not path or not cfg.targets_module(path) or not hasattr(module, "weight"):
            continue
        if type(module) not in (tp_layers.ColumnParallelLinear, tp_layers.RowParallelLinear):
            refused.append(f"{path} ({type(module).__name__})")
            continue
        _attach(model, path, module, cfg)
        adapted.append(path)
    if refused:
        raise LoRAError(
            "LoRA adapts megatron-core's local-spec linear layers only; these are not: "
            + ", ".join(refused[:4])
            + "; narrow lora.targets (Transformer Engine's fused layers are not supported yet)"
        )
    if not adapted:
        raise LoRAError(f"lora.targets={list(cfg.targets)} match no linear layer of the model")
    return adapted


def _attach(model, path: str, module, cfg: LoRAConfig) -> None:
    column = isinstance(module, tp_layers.ColumnParallelLinear)
    group = module.tp_group
    size, rank = group.size(), group.rank()
    weight = module.weight
    if not column and not module.input_is_parallel:
        raise LoRAError(f"{path}: a row-parallel layer with input_is_parallel=False is not supported")
    if module.is_expert and size > 1 and size != parallel_state.get_tensor_model_parallel_world_size():
        raise LoRAError(
            f"{path}: expert tensor parallelism {size} differs from tensor parallelism; use etp=1 or etp=tp"
        )
    out_local, in_local = weight.shape
    out_full, in_full = (out_local * size, in_local) if column else (out_local, in_local * size)
    name = global_name(model, f"{path}.lora_A")
    a_full = _init_a(cfg.seed, name, cfg.rank, in_full, weight)
    a = a_full if column else a_full.chunk(size, dim=1)[rank]
    b = torch.zeros(out_local if column else out_full, cfg.rank, dtype=weight.dtype, device=weight.device)
    for param_name, tensor in (("lora_A", a), ("lora_B", b)):
        param = torch.nn.Parameter(tensor.contiguous(), requires_grad=True)
        split = (param_name == "lora_B") == column  # the factor split like the base weight
        # Split factors, and every factor of an expert that is whole on its single rank, are this
        # rank's own (megatron marks expert weights the same way): counted once by grad norms.
        if split or (module.is_expert and size == 1):
            tp_layers.set_tensor_model_parallel_attributes(param, True, 0 if column else 1, 1)
        # Expert weights are reduced over the expert-data-parallel group, not the dense one.
        param.allreduce = getattr(weight, "allreduce", True)  # type: ignore[attr-defined]  # megatron's own mark, not in torch's stubs
        module.register_parameter(param_name, param)
    module.lora_scale, module.lora_dropout, module.lora_column = cfg.scale, cfg.dropout, column
    module.register_forward_hook(_add_adapter_output)
    axis_map = {"weight": 0, "bias": 0, "lora_B": 0} if column else {"weight": 1, "lora_A": 1}
    glu = column and path.endswith("linear_fc1") and model.config.gated_linear_unit
    module.sharded_state_dict = _sharded_state_dict_with(module, axis_map, glu)


def _init_a(seed: int, name: str, rank: int, in_features: int, like: torch.Tensor) -> torch.Tensor:
    if like.device.type == "meta":
        return torch.empty(rank, in_features, dtype=like.dtype, device="meta")
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)), as PEFT initialises lora_A
    a = torch.rand(rank, in_features, generator=generator, dtype=torch.float64) * (2 * bound) - bound
    return a.to(dtype=like.dtype, device=like.device)


def _whole_factor(factor: torch.Tensor, module) -> torch.Tensor:
    """A factor kept whole on every rank of the layer's group, used on partial data there: its gradient
    is all-reduced so the copies stay equal."""
    return copy_to_tensor_model_parallel_region(factor, group=module.tp_group) if module.tp_group.size() > 1 else factor


def _add_adapter_output(module, args, output):
    x = args[0]
    out, bias = output
    group = module.tp_group
    a, b = module.lora_A, module.lora_B
    if module.lora_column:
        # The base layer's whole input: gathered over the sequence under SP, the tokens it was given
        # otherwise (the input's gradient then needs summing over the ranks, as the base layer's does).
        if module.explicit_expert_comm:
            full = x
        elif module.sequence_parallel:
            full = gather_from_sequence_parallel_region(x, group=group)
        else:
            full = copy_to_tensor_model_parallel_region(x, group=group) if group.size() > 1 else x
        if module.lora_dropout and module.training:
            full = F.dropout(full, module.lora_dropout)
        # Each rank's B rows see only their part of the output: A's gradient is a sum over ranks.
        delta = F.linear(F.linear(full, _whole_factor(a, module)), b)
    else:
        if module.lora_dropout and module.training:
            x = F.dropout(x, module.lora_dropout)
        h = F.linear(x, a)  # this rank's input columns: a partial sum of the rank-r activations
        if module.explicit_expert_comm:  # the base output is a partial sum too; the dispatcher reduces both
            delta = F.linear(h, _whole_factor(b, module))
        elif module.sequence_parallel:  # each rank keeps its sequence chunk: B's gradient is a sum over ranks
            delta = F.linear(reduce_scatter_to_sequence_parallel_region(h, group=group), _whole_factor(b, module))
        else:
            delta = F.linear(reduce_from_tensor_model_parallel_region(h, group=group) if group.size() > 1 else h, b)
    return out + module.lora_scale * delta.to(out.dtype), bias


def _sharded_state_dict_with(module, axis_map: dict, glu: bool):
    """The layer's checkpoint entries with each adapter factor split along the axis its base weight is:
    megatron's own method treats every tensor but the weight and bias as whole on every rank. A gated
    MLP's B rows are [gate; up] per rank, stored as two tensors as megatron stores the weight, so a
    checkpoint reloads at another tensor-parallel size."""

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        sharded = make_sharded_tensors_for_checkpoint(
            module.state_dict(prefix="", keep_vars=True),
            prefix,
            axis_map,
            sharded_offsets,
            tp_group=module.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )
        if glu:
            key = f"{prefix}lora_B"
            sharded[key] = apply_swiglu_sharded_factory(
                sharded[key], sharded_offsets, metadata.get("singleton_local_shards", False)
            )
        return sharded

    return sharded_state_dict
