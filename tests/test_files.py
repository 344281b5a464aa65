"""Directories that appear whole or not at all (:mod:`moerl.files`)."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from moerl.files import build_once


def _build_slowly(target: str, log: str, started: multiprocessing.synchronize.Event) -> None:
    def build(staging: Path) -> None:
        started.set()
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # the other process asks for it meanwhile (its asking waits for it either way)
        (staging / "weights").write_text("made")

    build_once(Path(target), build)


def test_a_directory_wanted_by_two_processes_at_once_is_built_once_and_a_failed_build_leaves_nothing(tmp_path):
    target, log = tmp_path / "cache" / "model", tmp_path / "builds.log"
    ctx = multiprocessing.get_context("spawn")
    started, unwatched = ctx.Event(), ctx.Event()
    first = ctx.Process(target=_build_slowly, args=(str(target), str(log), started))
    first.start()
    assert started.wait(60)
    second = ctx.Process(target=_build_slowly, args=(str(target), str(log), unwatched))
    second.start()
    for p in (first, second):
        p.join(60)
        assert p.exitcode == 0
    assert len(log.read_text().split()) == 1 and (target / "weights").read_text() == "made"

    other = tmp_path / "cache" / "other"

    def fails(staging: Path) -> None:
        (staging / "half").write_text("")
        raise RuntimeError("out of disk")

    with pytest.raises(RuntimeError, match="out of disk"):
        build_once(other, fails)
    assert not other.exists() and [p.name for p in other.parent.iterdir() if "other" in p.name] == [".other.lock"]
    assert (build_once(other, lambda staging: (staging / "w").write_text("")) / "w").exists()
