"""Directories that appear whole or not at all."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_dir(out: str | Path) -> Iterator[Path]:
    """A fresh staging directory beside ``out``, renamed to ``out`` (replacing it) when the block completes and
    removed when it fails: readers, and a run that crashed mid-write, never see a half-written ``out``."""
    out = Path(out)
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
