"""Full (unsharded, global-name) views of a sharded Megatron model's parameters or gradients.

Undoes every split a layout makes: TP shards along each parameter's ``partition_dim`` (GLU
``linear_fc1`` shards are [gate_r; up_r] each), expert-parallel local expert indices, and
pipeline-stage local layer numbers. The result is keyed like a TP1/EP1/PP1 model, which is what
the HF mapping rules speak.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
# Transformer Engine's TEGroupedMLP names local expert i "experts.linear_fc1.weight{i}".
_GROUPED_EXPERT = re.compile(r"\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
# Transformer Engine fuses the attention's input norm into linear_qkv, and a dense layer's pre-MLP norm
# into linear_fc1: their weights carry the local spec's names in the global model.
_TE_FUSED_NORMS = ((".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
                   (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"))


def global_name(model, name: str) -> str:
    """``name`` of this rank's parameter as a TP1/EP1/PP1 model calls it (global layer and expert numbers)."""
    match = _LAYER.match(name)
    if match:
        layer = model.decoder.layers[int(match.group(1))].layer_number - 1
        name = f"decoder.layers.{layer}." + name[match.end():]
    name = _GROUPED_EXPERT.sub(r".experts.local_experts.\3.\1.\2", name)
    for fused, plain in _TE_FUSED_NORMS:
        if name.endswith(fused):
            name = name[: -len(fused)] + plain
    match = _EXPERT.search(name)
    if match:
        num_local = model.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
        expert = parallel_state.get_expert_model_parallel_rank() * num_local + int(match.group(1))
        name = name[: match.start()] + f".local_experts.{expert}." + name[match.end():]
    return name


def _gather_tp(param: torch.nn.Parameter, tensor: torch.Tensor, name: str, glu: bool) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return tensor
    expert = ".experts." in name
    group = (
        parallel_state.get_expert_tensor_parallel_group() if expert else parallel_state.get_tensor_model_parallel_group()
    )
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    dim = param.partition_dim
    if glu and name.endswith(("linear_fc1.weight", "linear_fc1.lora_B")):  # a LoRA B splits like its weight
        halves = [s.chunk(2, dim=dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(shards, dim=dim)


def full_tensors(model, grads: bool = False, select: Callable[[str], bool] | None = None,
                 keep_dtype: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) of the whole model, full size, on every rank, on the CPU.

    ``select(global_name)`` limits it to some parameters (e.g. one layer at a time); tensors are
    fp32 unless ``keep_dtype``. Collective over the world: call on all ranks. It moves tensors
    through ``all_gather_object``, which suits verification and small models.
    """
    glu = model.config.gated_linear_unit
    local: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        # A last pipeline stage keeps its own copy of tied embeddings (kept equal, and its
        # gradient summed with the first stage's, by megatron); the first stage's is the one.
        if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
            continue
        full_name = global_name(model, name)
        if select is not None and not select(full_name):
            continue
        tensor = param.data
        if grads:
            tensor = getattr(param, "main_grad", None)
            if tensor is None:
                tensor = param.grad if param.grad is not None else torch.zeros_like(param)
        tensor = tensor.detach() if keep_dtype else tensor.detach().float()
        local[full_name] = _gather_tp(param, tensor, full_name, glu).cpu()
    gathered: list[dict] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    full: dict[str, torch.Tensor] = {}
    for part in gathered:
        for name, tensor in part.items():
            full.setdefault(name, tensor)
    return full
