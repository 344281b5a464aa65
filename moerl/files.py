"""Directories that appear whole or not at all."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
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


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """``target``, made by ``build(staging)`` into a staging directory renamed to it: a crash never leaves a half
    directory. Processes that want the same ``target`` at once (runs sharing a cache) take turns on a lock beside it:
    one builds, the others find it made."""
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(f".{target.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        if not (target / ".complete").is_file():
            with staged_dir(target) as staging:
                build(staging)
                (staging / ".complete").write_text("")
    return target
