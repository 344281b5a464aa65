"""What a model family is to the rest of moerl: the one interface the converter, weight export, the adapter
formats, the trainer and the embedded engine use, and the plain types it speaks in.

A family (one module each, beside its Hugging Face mapping: :mod:`moerl.models.qwen3_moe`,
:mod:`moerl.models.qwen2_moe`) describes its HF <-> Megatron mapping declaratively, as a list of
:class:`TensorRule` per tensor; every reader walks those rules in whichever direction it needs, so
nothing outside the family knows a Hub name. :func:`moerl.models.family_for` picks the family of a
``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moerl.layout import Layout


@dataclass(frozen=True)
class TensorRule:
    """One megatron parameter (full, unsharded name) and the Hub tensors that form it.

    kind: ``copy`` (one tensor), ``concat`` (Hub tensors stacked along dim 0: [gate; up]) or
    ``qkv`` (q, k, v interleaved per query group, megatron's fused layout).
    """

    mcore: str
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    kind: str = "copy"


@dataclass(frozen=True)
class ModelShape:
    """What decoding an engine's routing needs to know about the served model."""

    num_layers: int
    topk: int
    moe_layers: list[int]  # the layers that route, ascending
    num_experts: int


class ModelFamily(Protocol):
    """A family of HF architectures that moerl trains, converts and serves. Methods taking ``cfg`` take the
    family's normalised config (:meth:`normalize`)."""

    architecture: str  # the ``architectures`` entry of its config.json
    model_type: str

    # ---- config ---------------------------------------------------------------------------
    def normalize(self, raw: dict) -> dict:
        """A ``config.json`` (as a dict) under the key names everything else reads."""

    def check(self, cfg: dict) -> None:
        """Raise :class:`~moerl.errors.ConfigError` naming every problem the Megatron model cannot reproduce."""

    def check_layout(self, cfg: dict, layout: Layout) -> None:
        """Raise :class:`~moerl.layout.LayoutError` naming every way ``layout`` does not fit the model."""

    def moe_layer_pattern(self, cfg: dict) -> list[int]:
        """1 for a MoE layer, 0 for a dense one, as transformers decides."""

    def model_shape(self, cfg: dict) -> ModelShape: ...

    def head_dim(self, cfg: dict) -> int: ...

    # ---- megatron-core ----------------------------------------------------------------------
    def transformer_config(self, cfg: dict, layout: Layout, dtype: torch.dtype, **overrides) -> Any: ...

    def layer_spec(
        self,
        config: Any,
        vp_stage: int | None = None,
        pp_rank: int | None = None,
        transformer_engine: bool | None = None,
    ) -> Any: ...

    def gpt_model_kwargs(self, cfg: dict) -> dict: ...

    # ---- HF mapping ------------------------------------------------------------------------
    def global_rules(self, cfg: dict) -> list[TensorRule]:
        """The tensors outside the decoder layers: the embedding, the final norm and the output layer (unless tied)."""

    def layer_rules(self, cfg: dict, i: int) -> list[TensorRule]:
        """The tensors of decoder layer ``i``."""

    def weight_layers(self, cfg: dict) -> list[tuple[str, list[TensorRule]]]:
        """``(state-dict prefix, rules)`` per weight layer: the non-layer tensors (prefix ``""``), then each decoder
        layer."""

    def all_rules(self, cfg: dict) -> list[TensorRule]: ...

    def hub_shapes(self, cfg: dict) -> dict[str, tuple[int, ...]]:
        """Every Hub tensor's name and shape."""

    def hub_numel(self, cfg: dict) -> int:
        """Elements of the whole HF checkpoint, from the shapes alone."""

    def to_mcore(self, rule: TensorRule, tensors: list[torch.Tensor], cfg: dict) -> torch.Tensor:
        """Fuse one rule's Hub tensors into its full megatron parameter."""

    def to_hf(self, rule: TensorRule, tensor: torch.Tensor, cfg: dict) -> list[torch.Tensor]:
        """Split one full megatron parameter into its rule's Hub tensors."""

    def transformers_slot(self, hub_name: str) -> tuple[str, tuple]:
        """Where a Hub tensor lives in transformers 5's model of the family: ``(parameter name, index)``."""


def in_layer(mcore_name: str, prefix: str) -> bool:
    """Whether a megatron state-dict name belongs to the weight layer of :meth:`ModelFamily.weight_layers` with
    ``prefix``."""
    return mcore_name.startswith(prefix) if prefix else not mcore_name.startswith("decoder.layers.")
