"""What moerl needs to know of SGLang itself: whether an installed (or running) release speaks the API moerl's wire
contract is written against, and which modules a LoRA server must serve. Starting servers is
:mod:`moerl.engines.pool`'s."""

from __future__ import annotations

from pathlib import Path

from moerl.engines.protocol import SGLANG_VERSION


def sglang_problem(installed: str | None = None) -> str | None:
    """Why SGLang servers cannot be used here (None: they can): not installed, or older than the release
    whose API moerl speaks (weight-update sessions, sampling masks, triton_v2 LoRA). ``installed``: a
    version reported by a running server instead of this machine's package."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import InvalidVersion, Version

    if installed is None:
        try:
            installed = version("sglang")
        except PackageNotFoundError:
            return f"sglang is not installed (bash tools/install.sh sglang installs {SGLANG_VERSION})"
    try:
        too_old = Version(installed) < Version(SGLANG_VERSION)
    except InvalidVersion:
        return f"sglang version {installed!r} is not a version number"
    return f"sglang {installed} is older than {SGLANG_VERSION}, whose HTTP API moerl speaks" if too_old else None


def lora_target_modules(model_path: str | Path, targets: list[str]) -> list[str]:
    """A LoRA server's ``--lora-target-modules``: the Hub modules adapters of megatron ``targets`` (``lora.targets``)
    take in the model at ``model_path``, and the experts' always."""
    from moerl.checkpoint.hf import read_config
    from moerl.checkpoint.peft import hub_target_modules
    from moerl.megatron.lora_config import LoRAConfig
    from moerl.models import family_for

    raw = read_config(model_path)
    family = family_for(raw)
    modules = hub_target_modules(family, family.normalize(raw), LoRAConfig(targets=list(targets)))
    if not modules:
        raise ValueError(f"lora.targets={list(targets)} match no linear layer of {model_path}")
    # The LoRA MoE runner (lora_triton) refuses to start unless the routed experts take LoRA, which SGLang gives them
    # only when both gate_up_proj and down_proj are targets. An adapter may adapt fewer modules than its server serves.
    return sorted(set(modules) | {"gate_proj", "up_proj", "down_proj"})
