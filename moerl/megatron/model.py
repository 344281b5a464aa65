"""Build the megatron-core GPT model of a Hugging Face MoE config for this rank's pipeline stage."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.router_replay import RouterReplay

from moerl.layout import Layout
from moerl.megatron.attention import SegmentAttention
from moerl.models import family_for, qwen_moe


def uses_transformer_engine(transformer_engine: bool | None) -> bool:
    """Whether :func:`build_model` builds Transformer Engine's layers, as the family's layer spec decides: where TE is
    usable, unless refused (``False``)."""
    return transformer_engine is not False and qwen_moe.te_usable()


def transformer_engine_fusions(ddp_main_grads: bool) -> dict[str, bool]:
    """The fusions megatron-core leaves off, on for a model Transformer Engine builds. RoPE's and the MoE
    permutation's: megatron-core's config refuses them where TE lacks the kernels (before TE 2.1), and the permutation
    only moves tokens by the routing map the router hands over, after replay has set its top-k. Gradient accumulation
    fused into the weight-gradient GEMMs: for a model megatron-core's DistributedDataParallel gives main_grad buffers
    to accumulate into (``ddp_main_grads``), and where Apex's kernel is installed, since the output layer is
    megatron-core's own linear layer under every spec and refuses the switch without it."""
    return {
        "apply_rope_fusion": True,
        "moe_permute_fusion": True,
        "gradient_accumulation_fusion": ddp_main_grads and tp_layers._grad_accum_fusion_available,
    }


def model_config(
    cfg: dict,
    layout: Layout,
    dtype: torch.dtype = torch.float32,
    transformer_engine: bool | None = None,
    ddp_main_grads: bool = False,
    **config_overrides,
) -> TransformerConfig:
    """The TransformerConfig :func:`build_model` builds with; ``config_overrides`` win over everything."""
    if uses_transformer_engine(transformer_engine):
        config_overrides = {**transformer_engine_fusions(ddp_main_grads), **config_overrides}
    else:
        config_overrides.setdefault("moe_grouped_gemm", False)  # grouped experts are Transformer Engine's
    return family_for(cfg).transformer_config(cfg, layout, dtype, **config_overrides)


def build_model(
    cfg: dict,
    layout: Layout,
    dtype: torch.dtype = torch.float32,
    transformer_engine: bool | None = None,
    ddp_main_grads: bool = False,
    **config_overrides,
) -> GPTModel:
    """The rank's GPTModel (its PP stage, its TP/EP shards), routing replay enabled.

    ``transformer_engine=False`` builds megatron-core's local layers even where Transformer Engine is
    usable (LoRA adapts those only). ``ddp_main_grads``: the caller wraps the model in megatron-core's
    DistributedDataParallel (see :func:`transformer_engine_fusions`).

    ``parallel_state`` must be initialised for ``layout`` (see :func:`moerl.megatron.parallel.init_distributed`).
    """
    family = family_for(cfg)
    config = model_config(cfg, layout, dtype, transformer_engine, ddp_main_grads, **config_overrides)
    # RouterReplay keeps a class-level list of every router ever built; a second model in the same
    # process would otherwise receive the first one's replay targets.
    RouterReplay.clear_global_router_replay_instances()
    spec = family.layer_spec(config, transformer_engine=transformer_engine)
    if not uses_transformer_engine(transformer_engine):
        for layer in spec.layer_specs:  # a packed row's segment table as well as megatron-core's masks
            layer.submodules.self_attention.submodules.core_attention = SegmentAttention
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **family.gpt_model_kwargs(cfg),
    )
    if torch.cuda.is_available():
        model.cuda()
    return model
