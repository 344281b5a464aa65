"""Build the megatron-core GPT model of a Hugging Face MoE config for this rank's pipeline stage."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.moe.router_replay import RouterReplay

from moerl.layout import Layout
from moerl.models import family_for


def build_model(cfg: dict, layout: Layout, dtype: torch.dtype = torch.float32, transformer_engine: bool | None = None,
                **config_overrides) -> GPTModel:
    """The rank's GPTModel (its PP stage, its TP/EP shards), routing replay enabled.

    ``transformer_engine=False`` builds megatron-core's local layers even where Transformer Engine is
    usable (LoRA adapts those only).

    ``parallel_state`` must be initialised for ``layout`` (see :func:`moerl.megatron.parallel.init_distributed`).
    """
    family = family_for(cfg)
    if transformer_engine is False:
        config_overrides.setdefault("moe_grouped_gemm", False)  # grouped experts are Transformer Engine's
    config = family.transformer_config(cfg, layout, dtype, **config_overrides)
    # RouterReplay keeps a class-level list of every router ever built; a second model in the same
    # process would otherwise receive the first one's replay targets.
    RouterReplay.clear_global_router_replay_instances()
    model = GPTModel(
        config=config,
        transformer_layer_spec=family.layer_spec(config, transformer_engine=transformer_engine),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        **family.gpt_model_kwargs(cfg),
    )
    if torch.cuda.is_available():
        model.cuda()
    return model
