"""Model families, one module each beside its Hugging Face mapping."""

from __future__ import annotations

from moerl.errors import ConfigError
from moerl.models import qwen2_moe, qwen3_moe
from moerl.models.family import ModelFamily, ModelShape, TensorRule

FAMILIES: dict[str, ModelFamily] = {f.architecture: f for f in (qwen3_moe.FAMILY, qwen2_moe.FAMILY)}


def family_for(cfg: dict) -> ModelFamily:
    """The family of a HF ``config.json`` (as a dict), chosen by its ``architectures`` entry."""
    archs = cfg.get("architectures") or []
    if not archs:
        by_type = [f for f in FAMILIES.values() if f.model_type == cfg.get("model_type")]
        if by_type:
            return by_type[0]
        raise ConfigError("config.json has neither 'architectures' nor a known 'model_type'")
    if len(archs) != 1 or archs[0] not in FAMILIES:
        raise ConfigError(f"architectures={archs}: moerl supports {sorted(FAMILIES)}")
    return FAMILIES[archs[0]]


def model_shape(raw: dict) -> ModelShape:
    """The routing shape of the model of a HF ``config.json`` (as a dict)."""
    family = family_for(raw)
    return family.model_shape(family.normalize(raw))


def is_classifier(architectures: list[str]) -> bool:
    """Whether a model of these architectures scores sequences rather than generating (SGLang's reading)."""
    return any(a.endswith(("ForSequenceClassification", "ForRewardModel")) for a in architectures)


__all__ = ["FAMILIES", "ModelFamily", "ModelShape", "TensorRule", "family_for", "is_classifier", "model_shape"]
