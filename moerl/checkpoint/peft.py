"""Megatron LoRA adapters -> Hugging Face PEFT adapter directories (``adapter_config.json`` +
``adapter_model.safetensors``), in the layout each consumer loads whole.

The adapters come keyed by full (TP1/EP1/PP1) megatron names, ``<module>.lora_A`` / ``<module>.lora_B``.
A fused megatron layer maps to several Hub modules through the family's rule for its weight: the
update ``B @ A`` has the weight's layout, so B's rows split exactly as the weight's rows do (q/k/v
from the grouped qkv layout, gate/up from the GLU) and each part keeps the shared A.

Two consumers want two layouts:

- ``sglang``: every expert its own modules (``mlp.experts.<i>.gate_proj``), as SGLang's MoE LoRA and
  ``moerl serve`` take them. PEFT over transformers 5 loads parts of this layout into nothing, without a
  word (:func:`peft_would_drop` names them; the converter warns).
- ``peft``: transformers 5's own layout, which PEFT loads whole: attention by module, the fused experts
  and the dense / shared MLP weights as ``target_parameters`` (PEFT's ``ParamWrapper``: per layer, the
  experts' A factors stacked expert-major ``[r * E, in]`` and B factors expert-minor ``[out, r * E]``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moerl.files import staged_dir
from moerl.megatron.lora_config import LoRAConfig
from moerl.models import ModelFamily

FORMATS = ("peft", "sglang")
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
EXPERT_MODULE = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")
_MLP_LEAVES = ("gate_proj", "up_proj", "down_proj")
# transformers 5's fused expert parameters, in the order the experts module defines them: PEFT wraps them in
# that order, each wrapper around the one before, so all but the last adapted one sit under ".base_layer".
_FUSED = (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",)))


@dataclass
class AdapterFiles:
    """What an adapter directory holds."""

    config: dict
    tensors: dict[str, torch.Tensor]


def hub_factors(
    family: ModelFamily, cfg: dict, lora: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Hub module name -> its (A [r, in], B [out, r]), one per Hub module (experts and gate/up apart)."""
    rules = {rule.mcore: rule for rule in family.all_rules(cfg)}
    out = {}
    for module in sorted({name.rsplit(".", 1)[0] for name in lora}):
        rule = rules[f"{module}.weight"]
        a = lora[f"{module}.lora_A"]
        for hub_weight, b in zip(rule.hf, family.to_hf(rule, lora[f"{module}.lora_B"], cfg), strict=True):
            out[hub_weight.removesuffix(".weight")] = (a, b.contiguous())
    return out


def hub_target_modules(family: ModelFamily, cfg: dict, lora_cfg: LoRAConfig) -> list[str]:
    """The Hub module names (last part) that ``lora_cfg``'s adapters of this model take, as the sglang format's
    ``target_modules`` names them: an SGLang server must serve at least these to load the adapters
    (:func:`moerl.engines.sglang.lora_target_modules` adds what SGLang itself needs, and not ``all``, which would give
    lm_head and embed_tokens LoRA buffers too)."""
    return sorted(
        {
            hub.removesuffix(".weight").rsplit(".", 1)[-1]
            for rule in family.all_rules(cfg)
            if lora_cfg.adapts(rule.mcore)
            for hub in rule.hf
        }
    )


def export_adapter(
    family: ModelFamily,
    cfg: dict,
    lora: dict[str, torch.Tensor],
    lora_cfg: LoRAConfig,
    fmt: str,
    base_model: str | None,
) -> AdapterFiles:
    """The adapters ``lora`` (full megatron names) as the files of format ``fmt`` (one of :data:`FORMATS`)."""
    factors = hub_factors(family, cfg, lora)
    if fmt == "sglang":
        tensors = _per_module(factors)
        extra = {"target_modules": sorted({m.rsplit(".", 1)[-1] for m in factors})}
    elif fmt == "peft":
        plain = {m: f for m, f in factors.items() if not EXPERT_MODULE.match(m)}
        tensors = {**_per_module(plain), **_fused_experts(factors, cfg["num_experts"])}
        params = [m for m in plain if m.rsplit(".", 1)[-1] in _MLP_LEAVES]
        extra = {
            "target_modules": sorted({m.rsplit(".", 1)[-1] for m in plain if m not in params}),
            "target_parameters": sorted(
                {_parameter_suffix(m) for m in params} | {f"mlp.experts.{fused}" for fused in _adapted_fused(factors)}
            ),
        }
    else:
        raise ValueError(f"adapter format {fmt!r}: expected one of {', '.join(FORMATS)}")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora_cfg.rank,
        "lora_alpha": lora_cfg.alpha,
        # Dropout is a training matter; PEFT's parameter wrappers refuse any other value at load.
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
        **extra,
    }
    return AdapterFiles(config, tensors)


def _per_module(factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out = {}
    for module, (a, b) in factors.items():
        out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.clone()  # safetensors stores no shared tensors
        out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b
    return out


def _parameter_suffix(module: str) -> str:
    """``mlp.gate_proj.weight`` / ``shared_expert.gate_proj.weight``: a suffix that names this kind of weight alone."""
    parent, leaf = module.rsplit(".", 2)[-2:]
    return f"{parent}.{leaf}.weight"


def _adapted_fused(factors) -> list[str]:
    leaves = {m.group(3) for m in map(EXPERT_MODULE.match, factors) if m}
    return [fused for fused, parts in _FUSED if leaves & set(parts)]


def _fused_experts(factors, num_experts: int) -> dict[str, torch.Tensor]:
    per_layer: dict[str, dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = {}
    for module, f in factors.items():
        if m := EXPERT_MODULE.match(module):
            per_layer.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = f
    adapted = _adapted_fused(factors)
    out = {}
    for experts_module, experts in per_layer.items():
        for i, fused in enumerate(adapted):
            parts = dict(_FUSED)[fused]
            pairs = [_expert_pair(experts.get(e, {}), parts) for e in range(num_experts)]
            like = next(p for p in pairs if p is not None)
            pairs = [p or (torch.zeros_like(like[0]), torch.zeros_like(like[1])) for p in pairs]
            path = f"{PEFT_PREFIX}{experts_module}" + ".base_layer" * (len(adapted) - 1 - i)
            out[f"{path}.lora_A.weight"] = torch.cat([a for a, _ in pairs])  # [r * E, in], expert-major
            # [out, r * E], expert-minor
            out[f"{path}.lora_B.weight"] = torch.stack([b for _, b in pairs], dim=-1).flatten(1)
    return out


def _expert_pair(own: dict, parts: tuple[str, ...]):
    """One expert's (A, B) of a fused parameter: gate and up share A (megatron's fc1), B rows stack [gate; up]."""
    if not any(p in own for p in parts):
        return None
    missing = [p for p in parts if p not in own]
    if missing:
        raise ValueError(
            f"expert adapters for {missing} are missing beside {[p for p in parts if p in own]}: they are one fused "
            "weight"
        )
    a = own[parts[0]][0]
    return a, torch.cat([own[p][1] for p in parts])


# Model types whose gate_proj / up_proj / down_proj targets PEFT (0.19 to 0.21 at least, over transformers 5) rewrites
# to the fused expert parameters: transformers maps qwen3_moe to qwen2_moe's conversion pattern, and not qwen2_moe
# itself, whose targets PEFT keeps as module names that no fused expert matches.
_PEFT_REWRITES_MLP_TARGETS = {"qwen3_moe"}


def peft_would_drop(files: AdapterFiles, model_type: str) -> list[str]:
    """Modules of an ``sglang``-format adapter that PEFT over transformers 5 loads into nothing: where it rewrites
    gate_proj / up_proj / down_proj targets to the fused experts (Qwen3-MoE), a dense MLP's and a shared expert's
    adapters; where it does not (Qwen2-MoE), every expert's, since no fused expert is named gate_proj."""
    modules = {key.removeprefix(PEFT_PREFIX).split(".lora_")[0] for key in files.tensors}
    mlp = [m for m in modules if m.rsplit(".", 1)[-1] in _MLP_LEAVES]
    rewrites = model_type in _PEFT_REWRITES_MLP_TARGETS
    return sorted(m for m in mlp if bool(EXPERT_MODULE.match(m)) != rewrites)


def check_adapter(directory: str | Path, expected: AdapterFiles) -> list[str]:
    """Where the adapter directory differs from ``expected``: missing or extra tensors, other values, another config."""
    directory = Path(directory)
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text())
        tensors = load_file(str(directory / ADAPTER_WEIGHTS))
    except (OSError, ValueError) as e:
        return [f"{directory}: not a readable adapter directory ({e})"]
    problems = []
    missing, extra = sorted(expected.tensors.keys() - tensors.keys()), sorted(tensors.keys() - expected.tensors.keys())
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing, e.g. {missing[:3]}")
    if extra:
        problems.append(f"{len(extra)} tensor(s) the checkpoint did not train, e.g. {extra[:3]}")
    differ = [k for k in expected.tensors.keys() & tensors.keys() if not torch.equal(tensors[k], expected.tensors[k])]
    if differ:
        problems.append(f"{len(differ)} tensor(s) with other values, e.g. {sorted(differ)[:3]}")
    changed = sorted(k for k in expected.config if config.get(k) != expected.config[k])
    if changed:
        problems.append(f"adapter_config.json differs in {changed}")
    return problems


def write_adapter_files(directory: Path, files: AdapterFiles) -> None:
    (directory / ADAPTER_CONFIG).write_text(json.dumps(files.config, indent=1))
    save_file(
        {k: t.contiguous() for k, t in files.tensors.items()},
        str(directory / ADAPTER_WEIGHTS),
        metadata={"format": "pt"},
    )


def save_adapter(out_dir: str | Path, files: AdapterFiles) -> Path:
    """Write (or replace) an adapter directory; it appears only when complete."""
    with staged_dir(out_dir) as staging:
        write_adapter_files(staging, files)
    return Path(out_dir)


def merge_into(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """The full megatron weight with its adapter's update folded in (computed in fp32)."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)
