"""Start a real ``moerl serve`` process on loopback for the engine tests (the job's own engine pool)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from moerl.engines.sglang import SGLangConfig, SGLangPool


@contextmanager
def running_server(model_dir: Path, log_dir: Path, *extra: str):
    """One embedded engine serving ``model_dir`` in float32 (``extra``: more ``moerl serve`` flags, which win)."""
    pool = SGLangPool(SGLangConfig(model_path=str(model_dir), server="embedded", base_port=0, dtype="float32",
                                   log_dir=str(log_dir), extra_args=list(extra)))
    with pool:
        yield pool.urls[0]
