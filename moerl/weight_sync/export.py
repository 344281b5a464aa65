"""The trainer's weights under the Hub names the engines load, one layer at a time.

Each weight layer (the non-layer tensors, then each decoder layer) is gathered whole on global rank 0 over
the groups that shard it (:class:`~moerl.megatron.weights.Gather`) and split into its Hub tensors by
the model family's mapping, so peak memory is one layer, not the model. Collective over the world:
every rank iterates.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from moerl.fp8 import quantize_named
from moerl.megatron.weights import Gather
from moerl.models import family_for
from moerl.models.family import in_layer


def hf_named_tensors(gather: Gather, hf_config: dict, quantization: str = "none") -> Iterator[tuple[str, torch.Tensor]]:
    """``(hub_name, tensor)`` for every tensor of the HF checkpoint, in the model dtype, on rank 0's device; on
    every other rank nothing (but iterate it to the end there too: the gathers are collective). With a
    ``per_sender`` gather: on each rank that sends, its own share (a stage's dense tensors, an EP rank's experts).
    ``quantization`` fp8: as FP8 engines hold them (:func:`moerl.fp8.quantize_named`)."""
    for layer in hf_layers(gather, hf_config, quantization):
        yield from layer


def hf_layers(
    gather: Gather, hf_config: dict, quantization: str = "none", non_layer_first: bool = False
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """:func:`hf_named_tensors` a weight layer at a time: the same number of layers on every rank, each empty where the
    rank holds none of it, so that ranks can act together between them. Each decoder layer, then the non-layer
    tensors (their TP gathers, the embedding pair's, the largest, would hold back a push's first broadcast);
    ``non_layer_first``: those first, in a forward's order."""
    family = family_for(hf_config)
    cfg = family.normalize(hf_config)
    layers = family.weight_layers(cfg)
    for prefix, rules in layers if non_layer_first else layers[1:] + layers[:1]:
        full = gather.gather(functools.partial(in_layer, prefix=prefix))
        named: list[tuple[str, torch.Tensor]] = []
        if full is not None:
            for rule in rules:
                # A sender holds its stage's layers only, and of their experts only its own; the non-layer tensors are
                # split between the first stage and the last.
                if gather.per_sender and rule.mcore not in full:
                    continue
                named += zip(rule.hf, family.to_hf(rule, full.pop(rule.mcore), cfg), strict=True)  # one per Hub name
        del full
        if quantization == "fp8":
            named = _quantized(named)
        yield named
        del named  # before the next layer is gathered: one held at a time, not two


def _quantized(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``named`` as FP8 engines hold them, each tensor let go once quantized: the layer is held once, not twice."""
    out: list[tuple[str, torch.Tensor]] = []
    named.reverse()
    while named:
        out += quantize_named([named.pop()])
    return out
