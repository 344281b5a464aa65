"""The orchestrator tests' models and overrides."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A random tiny Qwen3-MoE, one per module."""
    from moerl.models.tiny import save_tiny_hf

    return save_tiny_hf("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("random") / "model")


@pytest.fixture(scope="module")
def long_tailed(model) -> list[str]:
    """Overrides for a random tiny model with frequent stop characters: responses run tens of tokens
    (long-tailed, capped at 48), as a real model's vary in length."""
    from moerl.models.tiny import tiny_tokenizer

    stops = ",".join(str(tiny_tokenizer().convert_tokens_to_ids(c)) for c in "eat ")
    return [f"model.path={model}", "rollout.max_new_tokens=48", f"rollout.stop_token_ids=[{stops}]"]


@pytest.fixture(scope="module")
def engine_bound(model) -> list[str]:
    """Overrides for the random tiny model on an engine that decodes one response at a time, each 48 tokens long, so it
    is still generating when each weight update comes: a step's 32 responses take it several times as long as the
    trainer's step and update (96 tokens each did too: twice the time for no more margin that matters). At a full
    batch of shorter responses the engine could have a step's groups back before the update, and now and then no
    update met any."""
    return [
        f"model.path={model}",
        "rollout.max_new_tokens=48",
        "rollout.stop_token_ids=[]",
        "engines.extra_args=[--max-running-requests,1]",
    ]
