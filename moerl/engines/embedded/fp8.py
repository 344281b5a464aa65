"""FP8 rollouts on the embedded engine: SGLang's block-wise FP8 serving emulated on the CPU (the arithmetic is
:mod:`moerl.fp8`'s).

An engine whose model directory is an FP8 checkpoint (config.json's ``quantization_config`` is
:data:`moerl.fp8.QUANTIZATION_CONFIG`; :func:`moerl.checkpoint.hf.save_fp8` writes one) holds, for each quantized Hub
tensor, the float8_e4m3fn weight and the fp32 scales it was given, never quantizing again. The transformers model
computes with ``dequantize(q, scales)`` in the engine's dtype, kept in the parameter and recomputed when a write changes
either half. Each quantized linear's input is quantized as SGLang's per-token-group FP8 GEMM sees it
(:func:`moerl.fp8.quantize_activations`): forward pre-hooks on the attention projections and the dense and shared
MLPs' projections; the fused experts run a loop of their own that quantizes each routed expert's gate/up input and its
down input. The router gate, norms, embeddings and lm_head compute unquantized. So the CPU path shows the mismatch FP8
rollouts bring against the trainer's unquantized forward: router inputs move and experts flip, which R3 replays.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from moerl.checkpoint.hf import CheckpointError, HFReader, check_hf_tensors, fp8_names, read_config
from moerl.engines.embedded.lora import Adapter, AdapterConfig, AdapterSet, _FusedExperts
from moerl.engines.embedded.runner import add_target, checked, hub_tensor_view
from moerl.errors import LoRAError
from moerl.fp8 import FP8, SCALE_SUFFIX, dequantize, is_quantized, quantize_activations, scale_shape
from moerl.models import ModelFamily, family_for

PUSH_FP8 = "the trainer must push FP8 (engines.quantization=fp8)"


class FP8Model:
    """A transformers model served in FP8: the quantized Hub tensors' weights and scales as given, the model's
    parameters computing with their dequantized values, its quantized linears' inputs quantized on the fly."""

    def __init__(self, model: PreTrainedModel, family: ModelFamily, cfg: dict):
        """``model`` (of ``family``, its normalised config ``cfg``) made to compute in FP8; its quantized weights are
        zero until written (:meth:`targets`, then :meth:`dequantize_written`)."""
        self.model, self.family = model, family
        params = dict(model.named_parameters())
        self.quantized = {name for name in family.hub_shapes(cfg) if is_quantized(name)}
        # By transformers parameter: the FP8 weight, of the parameter's shape, and its scales, indexed as the parameter
        # is by transformers_slot (a fused expert's [gate; up] halves: [experts, 2, ...]).
        self.q: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}
        for name in sorted(self.quantized):
            param_name, index = family.transformers_slot(name)
            if param_name in self.q:
                continue
            param, view = params[param_name], hub_tensor_view(family, params, name)
            assert view is not None, "the family's own Hub names are the model's"
            lead = (param.shape[0], 2) if len(index) == 2 else tuple(param.shape[: len(index)])
            self.q[param_name] = torch.zeros(param.shape, dtype=FP8, device=param.device)
            self.scales[param_name] = torch.ones(
                *lead, *scale_shape(tuple(view.shape)), dtype=torch.float32, device=param.device
            )
        quantize_inputs(self.model, self.q)

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> FP8Model:
        """The FP8 checkpoint ``model_dir`` on ``device``, computing in ``dtype``: its weights and scales held as the
        directory has them."""
        raw = read_config(model_dir)
        family = family_for(raw)
        cfg = family.normalize(raw)
        reader = HFReader(model_dir)
        check_hf_tensors(reader, family, cfg)
        config = AutoConfig.from_pretrained(str(model_dir))
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the emulation's: transformers' own FP8 layers need a GPU
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if (Path(model_dir) / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(str(model_dir))
        fp8 = cls(model, family, cfg)
        hub_names = list(family.hub_shapes(cfg))
        unloaded = set(dict(model.named_parameters())) - {family.transformers_slot(n)[0] for n in hub_names}
        if unloaded:
            raise CheckpointError(f"{model_dir}: the model's parameters {sorted(unloaded)[:3]} have no Hub tensor")
        with torch.no_grad():
            for name in fp8_names(hub_names):  # one tensor at a time
                for dst, src in fp8.targets([(name, reader.get(name))]):
                    dst.copy_(src)
        fp8.dequantize_written(hub_names)
        return fp8

    # ---- weights ------------------------------------------------------------------------------
    def q_view(self, name: str) -> torch.Tensor | None:
        """The FP8 weight of the quantized Hub tensor ``name`` (None: not one the model has)."""
        return hub_tensor_view(self.family, self.q, name) if name in self.quantized else None

    def scale_view(self, name: str) -> torch.Tensor | None:
        """The scales of the quantized Hub tensor ``name`` (None: not one the model has)."""
        if name not in self.quantized:
            return None
        param_name, index = self.family.transformers_slot(name)
        scales = self.scales[param_name]
        return None if index and not index[0] < scales.shape[0] else scales[index]

    def targets(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) for each Hub-named tensor, all checked before anything is written: an FP8 weight or
        its fp32 ``_scale_inv`` replaces that half of a quantized tensor, any other tensor a weight served unquantized.
        Once written, :meth:`dequantize_written` makes the model compute with them."""
        params = dict(self.model.named_parameters())
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        problems: list[str] = []
        for name, tensor in named:
            base = name.removesuffix(SCALE_SUFFIX)
            if base != name and base in self.quantized:
                dst, want = self.scale_view(base), torch.float32
            elif name in self.quantized:
                dst, want = self.q_view(name), FP8
            else:
                dst, want = hub_tensor_view(self.family, params, name), None
            if dst is None:
                problems.append(f"{name}: not a weight of the served model")
            elif want is FP8 and tensor.dtype != FP8:
                problems.append(
                    f"{name}: {str(tensor.dtype).removeprefix('torch.')} for a weight this engine serves in FP8 "
                    f"(float8_e4m3fn and fp32 {name}{SCALE_SUFFIX}): {PUSH_FP8}"
                )
            elif want is torch.float32 and tensor.dtype != torch.float32:
                problems.append(f"{name}: FP8 scales are float32, not {str(tensor.dtype).removeprefix('torch.')}")
            elif want is None and tensor.dtype == FP8:
                problems.append(f"{name}: float8_e4m3fn for a weight this engine serves unquantized")
            else:
                add_target(name, dst, tensor, pairs, problems)
        return checked(pairs, problems)

    @torch.no_grad()
    def dequantize_written(self, names: Iterable[str]) -> None:
        """Recompute the weight the model computes with for each quantized tensor of which ``names`` (Hub names, and
        scale names) wrote a half."""
        params = dict(self.model.named_parameters())
        for base in {name.removesuffix(SCALE_SUFFIX) for name in names} & self.quantized:
            weight, q, scales = hub_tensor_view(self.family, params, base), self.q_view(base), self.scale_view(base)
            assert weight is not None and q is not None and scales is not None, "a quantized tensor of the model"
            weight.copy_(dequantize(q, scales, weight.dtype))

    def values(self, name: str, truncate_size: int) -> list | None:
        """The first ``truncate_size`` rows of the FP8 weight ``name`` as floats (what SGLang returns for an FP8
        parameter), or of the scales ``<name>_scale_inv``; None where ``name`` is neither."""
        base = name.removesuffix(SCALE_SUFFIX)
        held = self.q_view(name) if base == name else self.scale_view(base)
        return None if held is None else held[:truncate_size].float().cpu().tolist()

    def hashed_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What the engine's checksum covers, by name: the FP8 weights and their scales (``<parameter>_scale_inv``) in
        place of the quantized parameters, the other parameters as they are."""
        for name, param in self.model.named_parameters():
            if name in self.q:
                yield name, self.q[name]
                yield name + SCALE_SUFFIX, self.scales[name]
            else:
                yield name, param


def quantize_inputs(model: torch.nn.Module, quantized: Collection[str]) -> None:
    """Make ``model`` compute as an FP8 engine does with its FP8 weights ``quantized`` (names of its parameters, which
    hold their dequantized values): the input of every linear whose weight is FP8 quantized on the fly, by a pre-hook on
    a linear module, by a loop of its own for fused experts. Installed once; it reads the parameters at each call, so
    they may be written, or materialised from the meta device, later."""
    hooked = set()
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and f"{path}.weight" in quantized:
            module.register_forward_pre_hook(_quantized_input)
            hooked.add(f"{path}.weight")
        elif f"{path}.gate_up_proj" in quantized and f"{path}.down_proj" in quantized:
            module.forward = _experts_forward(cast(_FusedExperts, module))
            hooked |= {f"{path}.gate_up_proj", f"{path}.down_proj"}
    if unhooked := sorted(set(quantized) - hooked):
        raise NotImplementedError(f"FP8 emulation: {unhooked[:3]} are neither linear layers nor fused experts")


def _quantized_input(module: torch.nn.Module, args: tuple) -> tuple:
    return (quantize_activations(args[0]), *args[1:])


def _experts_forward(experts: _FusedExperts):
    """transformers' eager expert loop with each routed expert's inputs quantized: the tokens' hidden states before
    gate/up, the activated product before down (SGLang's fused MoE quantizes both per token group)."""

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        x = quantize_activations(hidden_states)  # per token: quantizing every token once is quantizing each expert's
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            tokens, slot = torch.where(top_k_index == expert)
            gate, up = F.linear(x[tokens], experts.gate_up_proj[expert]).chunk(2, dim=-1)
            h = quantize_activations(experts.act_fn(gate) * up)
            y = F.linear(h, experts.down_proj[expert])
            out.index_add_(0, tokens, (y * top_k_weights[tokens, slot, None]).to(out.dtype))
        return out

    return forward


class FP8Adapters(AdapterSet):
    """An FP8 engine's adapters: none. SGLang's LoRA over block-FP8 experts is not what the trainer's adapters are
    trained against, so every load is refused."""

    def from_dir(self, name: str, path: str | Path) -> Adapter:
        raise self._refused(name)

    def from_base64(self, name: str, config: dict, payload: str) -> Adapter:
        raise self._refused(name)

    def from_tensors(self, name: str, config: AdapterConfig, tensors: dict[str, torch.Tensor]) -> Adapter:
        raise self._refused(name)

    @staticmethod
    def _refused(name: str) -> LoRAError:
        return LoRAError(
            f"adapter {name!r} not loaded: this engine serves an FP8 checkpoint, and LoRA adapters are not served "
            "over FP8 weights (serve the unquantized model: engines.quantization=none)"
        )
