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


# The sequence classifiers and reward models SGLang 0.5.23 serves at /classify: a fixed list (is_generation_model in
# its configs/model_config.py), not every *ForSequenceClassification. Text embedding models on that list are left out.
CLASSIFIERS = frozenset(
    {
        "LlamaForSequenceClassification",
        "LlamaForSequenceClassificationWithNormal_Weights",
        "InternLM2ForRewardModel",
        "Qwen2ForRewardModel",
        "Qwen3ForRewardModel",
        "Qwen2ForSequenceClassification",
        "Qwen3ForSequenceClassification",
        "BertForSequenceClassification",
        "XLMRobertaForSequenceClassification",
        "Gemma2ForSequenceClassification",
    }
)


def is_classifier(architectures: list[str]) -> bool:
    """Whether a model of these architectures scores sequences rather than generating, as SGLang reads it."""
    return any(a in CLASSIFIERS for a in architectures)


def unserved_classifier(architectures: list[str]) -> str | None:
    """Why a model of these architectures, a sequence classifier by its name, cannot be a reward model (None: it can,
    or it is no classifier): SGLang serves only those of :data:`CLASSIFIERS`, and starts any other as a generative
    model."""
    named = [a for a in architectures if a.endswith(("ForSequenceClassification", "ForRewardModel"))]
    if not named or is_classifier(architectures):
        return None
    served = ", ".join(sorted(CLASSIFIERS))
    return f"{named[0]} is not among the sequence classifiers SGLang serves at /classify ({served})"


def is_process_reward_model(architectures: list[str]) -> bool:
    """Whether a model of these architectures is a process reward model: transformers' own token classifier
    (``*ForTokenClassification``, 1 or 2 labels), scoring each step of a response at its step separator. moerl's
    embedded engine serves it at ``/step_scores``; SGLang cannot (:data:`SGLANG_PRM_GAP`)."""
    return any(a.endswith("ForTokenClassification") for a in architectures)


# Why a process reward model is not served on SGLang, in one line for config's refusal to quote.
SGLANG_PRM_GAP = (
    "SGLang 0.5.23 serves no per-token head: its reward models pool one score per sequence (last, CLS or mean token); "
    "a process reward model is served by moerl's embedded engine (reward.process.engines.server=embedded)"
)


__all__ = [
    "CLASSIFIERS",
    "FAMILIES",
    "SGLANG_PRM_GAP",
    "ModelFamily",
    "ModelShape",
    "TensorRule",
    "family_for",
    "is_classifier",
    "is_process_reward_model",
    "model_shape",
    "unserved_classifier",
]
