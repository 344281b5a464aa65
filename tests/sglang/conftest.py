"""The sglang tier: SGLang 0.5.23 servers themselves, on this machine's CPU (tools/install.sh sglang installs them).
Each module marks its tests ``sglang`` and ``e2e`` and uses the ``sglang_python`` fixture: skipped without SGLang,
failed where MOERL_REQUIRE_SGLANG is set (CI)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moerl.engines.pool import EnginePool, EnginePoolConfig


@pytest.fixture(scope="package")
def model(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE that SGLang serves faithfully: every layer sparse, embeddings untied."""
    from moerl.models.tiny import ALL_SPARSE, save_tiny_hf

    return save_tiny_hf("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("sglang") / "model", **ALL_SPARSE)


def started(server: str, model: Path, log_dir: Path, python: str | None = None) -> EnginePool:
    """One replica of ``server`` serving ``model`` in float32, as the job's pool starts it."""
    pool = EnginePool(
        EnginePoolConfig(model_path=str(model), server=server, base_port=0, dtype="float32", log_dir=str(log_dir)),
        python=python,
    )
    pool.start(timeout_s=300)
    return pool


@pytest.fixture(scope="package")
def sglang_url(sglang_python, model, tmp_path_factory):
    """An SGLang server of :func:`model`, shared by the tests that leave it as they found it."""
    pool = started("sglang", model, tmp_path_factory.mktemp("sglang-logs"), sglang_python)
    try:
        yield pool.urls[0]
    finally:
        pool.stop()


@pytest.fixture(scope="package")
def embedded_url(model, tmp_path_factory):
    pool = started("embedded", model, tmp_path_factory.mktemp("embedded-logs"))
    try:
        yield pool.urls[0]
    finally:
        pool.stop()
