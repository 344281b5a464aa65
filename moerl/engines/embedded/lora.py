"""LoRA adapters in the embedded engine: PEFT-format adapters (per-expert keys
``...mlp.experts.<i>.<proj>`` as SGLang's triton_v2 backend takes them), applied by merging.

A running batch shares one adapter (or none). Switching merges ``scale * B @ A`` into the touched
weights after restoring their saved base values, so unloading gives back the base model bit for bit.
Adapters are kept as their A/B factors (adapter-sized) and each update is formed when merged, so
loading one costs what its bytes cost, not a model-sized set of deltas.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load, load_file

from moerl.engines.embedded.runner import hub_tensor_targets, hub_tensor_view
from moerl.errors import LoRAError

_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


@dataclass
class Adapter:
    name: str
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # Hub weight name -> (A [r, in], B [out, r])
    scale: float

    def shapes(self) -> list[tuple[str, torch.Tensor]]:
        """(Hub name, a meta tensor of the update's shape) per adapted weight."""
        return [(k, torch.empty(b.shape[0], a.shape[1], device="meta")) for k, (a, b) in self.factors.items()]


def adapter_from_tensors(name: str, config: dict, tensors: dict[str, torch.Tensor]) -> Adapter:
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r <= 0 or not isinstance(alpha, (int, float)):
        raise LoRAError(f"adapter {name!r}: config needs a positive integer r and a numeric lora_alpha")
    scale = alpha / r**0.5 if config.get("use_rslora") else alpha / r
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if not match:
            raise LoRAError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight")
        pairs.setdefault(match.group(1) + ".weight", {})[match.group(2)] = tensor
    incomplete = sorted(k for k, ab in pairs.items() if set(ab) != {"A", "B"})
    if incomplete:
        raise LoRAError(f"adapter {name!r}: modules without both lora_A and lora_B: {incomplete[:5]}")
    if not pairs:
        raise LoRAError(f"adapter {name!r} has no tensors")
    bad = sorted(k for k, ab in pairs.items() if ab["A"].dim() != 2 or ab["B"].dim() != 2 or ab["A"].shape[0] != ab["B"].shape[1])
    if bad:
        raise LoRAError(f"adapter {name!r}: lora_A [r, in] and lora_B [out, r] disagree in shape for {bad[:5]}")
    return Adapter(name, {k: (ab["A"], ab["B"]) for k, ab in pairs.items()}, scale)


def adapter_from_dir(name: str, path: str | Path) -> Adapter:
    path = Path(path)
    config_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise LoRAError(f"{path}: expected adapter_config.json and adapter_model.safetensors (PEFT format)")
    return adapter_from_tensors(name, json.loads(config_file.read_text()), load_file(str(weights)))


def adapter_from_bytes(name: str, config: dict, payload: bytes) -> Adapter:
    return adapter_from_tensors(name, config, load(payload))


class AdapterSet:
    """Loaded adapters and which one is merged into the model now."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.adapters: dict[str, Adapter] = {}
        self.active: str | None = None
        self._base: list[tuple[torch.Tensor, torch.Tensor]] = []  # (view into the model, saved base values)

    def add(self, adapter: Adapter) -> None:
        if adapter.name in self.adapters:
            raise LoRAError(f"adapter {adapter.name!r} is already loaded; unload it first")
        try:
            hub_tensor_targets(self.model, adapter.shapes())  # names and shapes fit the model
        except ValueError as e:
            raise LoRAError(f"adapter {adapter.name!r} does not fit the served model: {e}") from None
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise LoRAError(f"adapter {name!r} is not loaded")
        if self.active == name:
            self.activate(None)
        del self.adapters[name]

    @torch.no_grad()
    def activate(self, name: str | None) -> None:
        if name == self.active:
            return
        if name is not None and name not in self.adapters:
            raise LoRAError(f"adapter {name!r} is not loaded")
        for view, base in self._base:
            view.copy_(base)
        self._base = []
        if name is not None:
            adapter = self.adapters[name]
            params = dict(self.model.named_parameters())
            for hub_name, (a, b) in adapter.factors.items():
                view = hub_tensor_view(params, hub_name)
                self._base.append((view, view.clone()))
                view.add_((adapter.scale * (b.float() @ a.float())).to(view.dtype))
        self.active = name
