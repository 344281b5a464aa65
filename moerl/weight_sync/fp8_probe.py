"""What ``sync.verify`` checks FP8 engines against: the log-probs of the probe that an FP8 engine computes from exactly
the tensors a push sends it, not the trainer's unquantized ones (which differ from any FP8 engine's by its rounding).

The policy's Hub tensors are gathered whole on global rank 0 a weight layer at a time, in the order a forward needs
them (the non-layer tensors, then each decoder layer), and quantized as a push quantizes them
(:func:`moerl.weight_sync.export.hf_layers`). Rank 0 runs the probe through transformers' own model of the
architecture, built on the meta device: before each decoder layer runs, that layer alone is materialised, given its
tensors (the FP8 ones dequantized, in the engines' dtype) and the embedded engine's FP8 forward
(:func:`moerl.engines.embedded.fp8.quantize_inputs`: each quantized linear's input quantized per token group); after it
ran it goes back to the meta device. So rank 0 holds the embedding, the final norm and lm_head, and one decoder layer
(gathered, then in the engines' dtype) at a time; the other ranks take part in the gathers only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from moerl.engines.embedded.fp8 import quantize_inputs
from moerl.engines.embedded.runner import hub_tensor_view
from moerl.fp8 import SCALE_SUFFIX, dequantize, is_quantized
from moerl.megatron.parallel import collective_device, lead_agrees
from moerl.megatron.weights import Gather
from moerl.models import ModelFamily, family_for
from moerl.weight_sync.export import hf_layers

Named = list[tuple[str, torch.Tensor]]


def fp8_probe_logprobs(
    gather: Gather, hf_config: dict, ids: list[int], engine_dtype: Callable[[], torch.dtype]
) -> np.ndarray:
    """Collective over the trainer's ranks: an FP8 engine's log-probs of ``ids[1:]`` given the tokens before them (as
    :func:`~moerl.weight_sync.base.probe_logprobs` defines them, fp32), computed on global rank 0 from the weights
    ``gather`` collects quantized as a push sends them, in ``engine_dtype()`` (called on rank 0: the dtype the engines
    compute in), on rank 0's device. The same array on every rank; where rank 0 fails, every rank raises."""
    assert not gather.per_sender, "the reference is computed on rank 0: a whole gather"
    layers = hf_layers(gather, hf_config, "fp8", non_layer_first=True)
    ours: np.ndarray | None = None
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            ours = fp8_logprobs(hf_config, ids, engine_dtype(), collective_device(), layers).numpy()
        except Exception as e:  # noqa: BLE001 - told to every rank once the gathers are done
            error = e
    for _ in layers:  # what rank 0 left of the gathers, and all of them on the other ranks: they are collective
        pass
    lead_agrees(error, "the FP8 reference of sync.verify's probe")
    held = [ours]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(held, 0)  # PROBE_TOKENS floats
    assert held[0] is not None
    return held[0]


def fp8_logprobs(
    hf_config: dict, ids: list[int], dtype: torch.dtype, device: torch.device | str, layers: Iterator[Named]
) -> torch.Tensor:
    """The log-probs (fp32, on the CPU) of ``ids[1:]`` given the tokens before them, as an FP8 engine computing in
    ``dtype`` on ``device`` serves the model of ``hf_config`` given ``layers``: its Hub tensors as a push sends them
    (FP8 weights with their ``_scale_inv``, the rest as they are), one list per weight layer in
    :meth:`~moerl.models.family.ModelFamily.weight_layers`'s order, read as the forward reaches each (every one of them,
    where it succeeds)."""
    device = torch.device(device)
    family = family_for(hf_config)
    model, layers_path = _meta_model(hf_config, family, dtype, device)
    decoder_layers = model.get_decoder().layers

    def outside_layers(path: str) -> bool:
        return not (path == layers_path or path.startswith(layers_path + "."))

    # The non-layer modules for the whole forward: the embedding, the final norm, lm_head (tied or not).
    out_embeddings = model.get_output_embeddings()
    tied = out_embeddings is not None and out_embeddings.weight is model.get_input_embeddings().weight
    for path, module in model.named_modules():
        if outside_layers(path) and next(module.parameters(recurse=False), None) is not None:
            module.to_empty(device=device, recurse=False)
    if tied:
        out_embeddings.weight = model.get_input_embeddings().weight
    held = {name: p for name, p in model.named_parameters() if outside_layers(name)}
    _load(family, held, next(layers), "the non-layer tensors")

    def materialised(i: int):
        def hook(layer: torch.nn.Module, args: tuple) -> None:
            layer.to_empty(device=device)
            prefix = f"{layers_path}.{i}."
            _load(family, {prefix + n: p for n, p in layer.named_parameters()}, next(layers), f"decoder layer {i}")

        return hook

    def released(layer: torch.nn.Module, args: tuple, output) -> None:
        layer.to_empty(device="meta")

    for i, layer in enumerate(decoder_layers):
        layer.register_forward_pre_hook(materialised(i))
        layer.register_forward_hook(released)
    tokens = torch.tensor([ids], device=device)
    with torch.no_grad():
        logits = model(input_ids=tokens, use_cache=False).logits
    if next(layers, None) is not None:
        raise RuntimeError(f"the weights have more layers than the model's {len(decoder_layers)} decoder layers")
    return torch.log_softmax(logits[0, :-1].float(), -1).gather(1, tokens[0, 1:, None])[:, 0].cpu()


def _meta_model(
    hf_config: dict, family: ModelFamily, dtype: torch.dtype, device: torch.device
) -> tuple[PreTrainedModel, str]:
    """transformers' model of ``hf_config`` in ``dtype`` on the meta device, computing as an FP8 engine does (the
    embedded engine's hooks), its rotary embedding on ``device``; and the path of its decoder layers."""
    raw = {k: v for k, v in hf_config.items() if k != "quantization_config"}  # as the embedded FP8 engine drops it
    config = CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    cfg = family.normalize(hf_config)
    quantize_inputs(model, {family.transformers_slot(n)[0] for n in family.hub_shapes(cfg) if is_quantized(n)})
    decoder = model.get_decoder()
    paths = {id(module): path for path, module in model.named_modules()}
    layers_path, rotary_path = paths[id(decoder.layers)], paths[id(decoder.rotary_emb)]
    if unknown := [n for n, _ in model.named_buffers() if not n.startswith(rotary_path + ".")]:
        raise NotImplementedError(f"the FP8 probe reference: buffers {unknown[:3]} outside the rotary embedding")
    # Made again where it computes (its buffers are computed at construction), each buffer in the dtype the model's has.
    with torch.device(device):
        rotary = type(decoder.rotary_emb)(model.config)
    meta_buffers = dict(decoder.rotary_emb.named_buffers())
    for name, buffer in rotary.named_buffers():
        assert buffer.dtype == meta_buffers[name].dtype, f"the rotary embedding's {name} is in the model's dtype"
    decoder.rotary_emb = rotary
    return model, layers_path


@torch.no_grad()
def _load(family: ModelFamily, params: Mapping[str, torch.Tensor], named: Named, what: str) -> None:
    """Write the Hub tensors ``named`` (an FP8 weight followed by its scales, the rest as they are) into ``params``
    (transformers names): each FP8 one dequantized in the parameter's dtype, as the embedded FP8 engine holds it. Every
    element of ``params`` must be written, each once."""
    pending: dict[str, torch.Tensor] = {}
    written = 0
    for name, tensor in named:
        base = name.removesuffix(SCALE_SUFFIX)
        if base == name and is_quantized(name):
            pending[name] = tensor  # its scales follow
            continue
        dst = hub_tensor_view(family, params, base)
        if dst is None:
            raise RuntimeError(f"the FP8 probe reference: {name} is not a weight of {what}")
        value = dequantize(pending.pop(base), tensor, dst.dtype) if base != name else tensor
        if tuple(value.shape) != tuple(dst.shape):
            raise RuntimeError(f"the FP8 probe reference: {name} {tuple(value.shape)} != {tuple(dst.shape)} in {what}")
        dst.copy_(value)
        written += dst.numel()
    expected = sum(p.numel() for p in params.values())
    if pending or written != expected:
        raise RuntimeError(
            f"the FP8 probe reference: {what} got {written} of its {expected} weights' elements"
            + (f", and FP8 weights without scales: {sorted(pending)[:3]}" if pending else "")
        )
