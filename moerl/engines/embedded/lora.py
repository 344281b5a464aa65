"""LoRA adapters in the embedded engine: PEFT-format adapters (per-expert keys ``...mlp.experts.<i>.<proj>``
as SGLang's triton_v2 backend takes them), applied unmerged.

The base weights are never written: each adapted linear layer adds ``scale * B(A(x))`` to its output,
computed in fp32 from factors kept on the model's device, and each adapted MoE layer runs its experts
with their own updates. So the served base stays exactly what the trainer sent (``/get_weights_by_name``
reads it), updates too small for a bf16 weight are not rounded away, and a weight update never has to
undo an adapter. A running batch shares one adapter (or none), chosen by name before each forward.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors.torch import load, load_file

from moerl.checkpoint.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, EXPERT_MODULE, PEFT_PREFIX
from moerl.engines.embedded.runner import hub_tensor_view
from moerl.engines.protocol import describe
from moerl.errors import LoRAError
from moerl.models import ModelFamily

_KEY = re.compile(rf"^(?:{re.escape(PEFT_PREFIX)})?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")
Factors = tuple[torch.Tensor, torch.Tensor]  # A [r, in], B [out, r]: fp32 on the model's device


@dataclass
class Adapter:
    name: str
    scale: float
    linear: dict[str, Factors]  # module path (Hub name) -> factors
    experts: dict[str, dict[int, dict[str, Factors]]]  # experts module path -> expert -> gate/up/down_proj -> factors


class _FusedExperts(Protocol):
    """What the adapted forward reads of a transformers fused-experts module (torch types a module's attributes only as
    tensors or modules)."""

    gate_up_proj: torch.nn.Parameter  # [experts, 2 * intermediate, hidden]
    down_proj: torch.nn.Parameter  # [experts, hidden, intermediate]

    def act_fn(self, x: torch.Tensor, /) -> torch.Tensor: ...


def _delta(x: torch.Tensor, factors: Factors, scale: float) -> torch.Tensor:
    a, b = factors
    return (scale * F.linear(F.linear(x.float(), a), b)).to(x.dtype)


class AdapterSet:
    """The adapters loaded into one model, and which one its forwards use now."""

    def __init__(self, model: torch.nn.Module, family: ModelFamily):
        self.model = model
        self.family = family
        self.params = dict(model.named_parameters())
        self.device = next(model.parameters()).device
        self.adapters: dict[str, Adapter] = {}
        self.unloaded: set[str] = set()  # loaded once, no longer: not what a restarted engine, which never had it, says
        self.active: Adapter | None = None
        for path, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(self._linear_hook(path))
            elif isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter) and isinstance(
                getattr(module, "down_proj", None), torch.nn.Parameter
            ):
                # Both checked just above: it is a fused-experts module.
                module.forward = self._experts_forward(path, cast(_FusedExperts, module), module.forward)

    # ---- the forward pass ---------------------------------------------------------------------
    def _linear_hook(self, path: str):
        def hook(module, args, output):
            active = self.active
            factors = active.linear.get(path) if active is not None else None
            if active is None or factors is None:
                return None
            return output + _delta(args[0], factors, active.scale).to(output.dtype)

        return hook

    def _experts_forward(self, path: str, experts: _FusedExperts, plain):
        """transformers' eager expert loop with each expert's update added, where the active adapter has one."""

        def forward(
            hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
        ) -> torch.Tensor:
            active = self.active
            adapted = active.experts.get(path) if active is not None else None
            if active is None or not adapted:
                return plain(hidden_states, top_k_index, top_k_weights)
            scale = active.scale
            out = torch.zeros_like(hidden_states)
            for expert in top_k_index.unique().tolist():
                tokens, slot = torch.where(top_k_index == expert)
                x = hidden_states[tokens]
                gate, up = F.linear(x, experts.gate_up_proj[expert]).chunk(2, dim=-1)
                own = adapted.get(expert, {})
                if "gate_proj" in own:
                    gate = gate + _delta(x, own["gate_proj"], scale)
                if "up_proj" in own:
                    up = up + _delta(x, own["up_proj"], scale)
                h = experts.act_fn(gate) * up
                y = F.linear(h, experts.down_proj[expert])
                if "down_proj" in own:
                    y = y + _delta(h, own["down_proj"], scale)
                out.index_add_(0, tokens, (y * top_k_weights[tokens, slot, None]).to(out.dtype))
            return out

        return forward

    # ---- loading --------------------------------------------------------------------------------
    def from_dir(self, name: str, path: str | Path) -> Adapter:
        path = Path(path)
        config_file, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
        if not config_file.is_file() or not weights.is_file():
            raise LoRAError(f"{path}: expected {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} (PEFT format)")
        try:
            config = json.loads(config_file.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise LoRAError(f"{config_file}: not valid JSON ({e})") from None
        try:
            tensors = load_file(str(weights))
        except OSError:
            raise  # the path's own failure, which the caller names
        except Exception as e:  # noqa: BLE001 - a damaged file: safetensors raises its own types, and Python's for some
            raise LoRAError(f"{weights}: not a readable safetensors file ({e})") from None
        return self.from_tensors(name, AdapterConfig.of(str(config_file), config), tensors)

    def from_base64(self, name: str, config: dict, payload: str) -> Adapter:
        try:
            tensors = load(base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError) as e:
            raise LoRAError(
                f"adapter {name!r}: serialized_named_tensors[0] is not base64 of a safetensors file ({e})"
            ) from None
        except Exception as e:  # noqa: BLE001 - a damaged payload: safetensors raises its own types, and KeyError
            raise LoRAError(
                f"adapter {name!r}: serialized_named_tensors[0] is not a readable safetensors payload ({e})"
            ) from None
        return self.from_tensors(name, AdapterConfig.of(f"adapter {name!r}: config_dict", config), tensors)

    def from_tensors(self, name: str, config: AdapterConfig, tensors: dict[str, torch.Tensor]) -> Adapter:
        """An adapter of PEFT tensors, checked against its config and the served model before anything is kept."""
        rank, scale = config.r, config.scale
        if config.target_parameters:
            raise LoRAError(
                f"adapter {name!r} is in transformers 5's layout (target_parameters: fused experts), which PEFT "
                "loads; moerl serve and SGLang take one module per expert: export it with --adapter-format sglang"
            )
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            match = _KEY.match(key)
            if not match:
                raise LoRAError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight")
            pairs.setdefault(match.group(1), {})[match.group(2)] = tensor
        if not pairs:
            raise LoRAError(f"adapter {name!r} has no tensors")
        problems = []
        targets = config.target_modules
        adapter = Adapter(name, scale, {}, {})
        for module, ab in sorted(pairs.items()):
            a, b = ab.get("A"), ab.get("B")
            if a is None or b is None:
                problems.append(f"{module}: needs both lora_A and lora_B")
                continue
            if isinstance(targets, list) and module.rsplit(".", 1)[-1] not in targets:
                problems.append(f"{module}: not among its config's target_modules {targets}")
            if not (a.is_floating_point() and b.is_floating_point()):
                problems.append(f"{module}: factors must be floating point, got {a.dtype} and {b.dtype}")
                continue
            weight = hub_tensor_view(self.family, self.params, module + ".weight")
            if weight is None or weight.dim() != 2:
                problems.append(f"{module}: not a linear layer of the served model")
                continue
            out_features, in_features = weight.shape
            if a.shape != (rank, in_features) or b.shape != (out_features, rank):
                problems.append(
                    f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} should be "
                    f"({rank}, {in_features}) and ({out_features}, {rank}) for r={rank}"
                )
                continue
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                problems.append(f"{module}: factors hold NaN or infinite values")
                continue
            factors = (a.to(self.device, torch.float32), b.to(self.device, torch.float32))
            expert = EXPERT_MODULE.match(module)
            if expert:
                adapter.experts.setdefault(expert.group(1), {}).setdefault(int(expert.group(2)), {})[
                    expert.group(3)
                ] = factors
            else:
                adapter.linear[module] = factors
        if problems:
            raise LoRAError(
                f"adapter {name!r} does not fit the served model or its own config: " + "; ".join(problems[:5])
            )
        return adapter

    def add(self, adapter: Adapter) -> None:
        if adapter.name in self.adapters:
            raise LoRAError(f"adapter {adapter.name!r} is already loaded; unload it first")
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise LoRAError(f"adapter {name!r} is not loaded")
        if self.active is not None and self.active.name == name:
            self.active = None
        del self.adapters[name]
        self.unloaded.add(name)

    def activate(self, name: str | None) -> None:
        if name is not None and name not in self.adapters:
            raise LoRAError(f"adapter {name!r} is not loaded")
        self.active = None if name is None else self.adapters[name]


class AdapterConfig(BaseModel):
    """The fields of a PEFT ``adapter_config.json`` the engine reads (the others are passed over)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    r: int = Field(gt=0)
    lora_alpha: float
    use_rslora: bool = False
    target_modules: list[str] | str | None = None  # a string is PEFT's regular expression: not checked here
    target_parameters: list[str] | None = None
    fan_in_fan_out: bool = False
    bias: str = "none"
    use_dora: bool = False
    modules_to_save: list[str] | None = None

    @classmethod
    def of(cls, source: str, config: Any) -> AdapterConfig:
        """``config`` checked: any malformed one is a :class:`LoRAError` naming ``source`` (its file, or the request's
        field)."""
        if not isinstance(config, dict):
            raise LoRAError(f"{source}: must be a JSON object, got {type(config).__name__}")
        try:
            checked = cls.model_validate(config)
        except ValidationError as e:
            raise LoRAError(f"{source}: {describe(e)}") from None
        unsupported = {
            key: value
            for key, plain in (("fan_in_fan_out", False), ("bias", "none"), ("use_dora", False))
            if (value := getattr(checked, key)) != plain
        }
        if checked.modules_to_save:
            unsupported["modules_to_save"] = checked.modules_to_save
        if unsupported:
            raise LoRAError(f"{source}: unsupported settings {unsupported} (plain LoRA only)")
        return checked

    @property
    def scale(self) -> float:
        return self.lora_alpha / math.sqrt(self.r) if self.use_rslora else self.lora_alpha / self.r
