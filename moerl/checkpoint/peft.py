"""Megatron LoRA adapters <-> the Hugging Face PEFT format (``adapter_config.json`` +
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` and SGLang load.

The adapters come keyed by full (TP1/EP1/PP1) megatron names, ``<module>.lora_A`` / ``<module>.lora_B``.
A fused megatron layer maps to several Hub modules through the family's rule for its weight: the
update ``B @ A`` has the weight's layout, so B's rows split exactly as the weight's rows do (q/k/v
from the grouped qkv layout, gate/up from the GLU) and each part keeps the shared A. Experts are
written per expert (``mlp.experts.<i>.gate_proj``), as SGLang's MoE LoRA takes them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from moerl.megatron.lora import LoRAConfig

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def lora_modules(lora: dict[str, torch.Tensor]) -> list[str]:
    return sorted({name.rsplit(".", 1)[0] for name in lora})


def peft_tensors(family, cfg: dict, lora: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT-named tensors of the adapters ``lora`` (full megatron names)."""
    rules = {rule.mcore: rule for rule in family.all_rules(cfg)}
    out: dict[str, torch.Tensor] = {}
    for module in lora_modules(lora):
        rule = rules[f"{module}.weight"]
        a = lora[f"{module}.lora_A"]
        for hub_weight, b in zip(rule.hf, family.to_hf(rule, lora[f"{module}.lora_B"], cfg)):
            hub_module = PEFT_PREFIX + hub_weight.removesuffix(".weight")
            out[f"{hub_module}.lora_A.weight"] = a.clone()  # safetensors stores no shared tensors
            out[f"{hub_module}.lora_B.weight"] = b.contiguous()
    return out


def adapter_config(lora_cfg: LoRAConfig, tensors: dict[str, torch.Tensor], base_model: str | None = None) -> dict:
    targets = sorted({key.split(".lora_")[0].rsplit(".", 1)[-1] for key in tensors})
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha,
        "lora_dropout": lora_cfg.dropout, "target_modules": targets, "bias": "none", "use_rslora": False,
        "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": base_model,
    }


def write_adapter_files(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1))
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def save_adapter(out_dir: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write (or replace) a PEFT adapter directory; it appears only when complete."""
    out = Path(out_dir)
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write_adapter_files(staging, config, tensors)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def merge_into(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """The full megatron weight with its adapter's update folded in (computed in fp32)."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)
