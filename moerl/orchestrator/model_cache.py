"""The model a run trains, made once and cached under ``run.cache_dir``: the CPU demo's tiny warmed-up model, and each
HF model's Megatron checkpoint, converted once per model (keyed by its path, config and files)."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
from pathlib import Path

from moerl.env import child_env, die_with_parent
from moerl.errors import ConfigError
from moerl.files import build_once
from moerl.orchestrator.config import RunConfig, Scorer
from moerl.orchestrator.preflight import check_tokenizers, model_dir, simulation_profile
from moerl.plugins import import_object
from moerl.tasks import DEMO, DEMO_MODELS, DEMO_SCORERS

log = logging.getLogger("moerl.train")


def _demo_model(cache: Path, name: str, builder: str) -> Path:
    """The HF directory of the demo model ``name``, made by ``builder`` once into ``cache``."""
    save = import_object(builder, "task.name")

    def build(staging: Path) -> None:
        log.info("creating the tiny demo model (once) in %s", cache / name)
        save(staging / "model")  # a subdirectory: the build marker stays out of the HF directory

    return build_once(cache / name / "hf", build) / "model"


def prepare_scorer_model(cfg: RunConfig, scorer: Scorer) -> Path:
    """A scorer's HF directory (its ``model``; ``demo``: the task's tiny one, made once). A teacher's tokenizer is the
    student's (:func:`~moerl.orchestrator.preflight.check_tokenizers`), checked here, before its engines start, where
    both models exist: the preflight checks it earlier only where both are given (a demo is made after it)."""
    if scorer.model == DEMO:
        demos = DEMO_SCORERS[scorer.key].models  # the preflight checked that the task has one
        model = _demo_model(Path(cfg.run.cache_dir).expanduser(), *demos[cfg.task.name])
    else:
        model = Path(scorer.model)
    if scorer.key == "teacher":
        check_tokenizers(policy_hf(cfg), model)
    return model


def policy_hf(cfg: RunConfig) -> Path:
    """The HF directory of the model to train (the demo's: made once)."""
    given = model_dir(cfg, simulation_profile(cfg))
    if given is None:
        return _demo_model(Path(cfg.run.cache_dir).expanduser(), *DEMO_MODELS[cfg.task.name])
    return Path(given)


def prepare_model(cfg: RunConfig) -> tuple[Path, Path | None]:
    """(HF directory, Megatron checkpoint) of the model to train, made once and cached; a simulation has no
    checkpoint."""
    cache = Path(cfg.run.cache_dir).expanduser()
    hf = policy_hf(cfg)
    if cfg.simulation.profile is not None:
        return hf, None
    if cfg.model.mcore:
        mcore = Path(cfg.model.mcore)
        if not mcore.is_dir():
            raise ConfigError(
                f"model.mcore={mcore} does not exist; leave it null to convert model.path once into run.cache_dir"
            )
        return hf, mcore

    def convert(staging: Path) -> None:
        log.info("converting %s to the Megatron layout (tools/convert_ckpt.py hf-to-mcore)", hf)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "moerl.cli",
                "convert-ckpt",
                "hf-to-mcore",
                "--hf",
                str(hf),
                "--out",
                str(staging / "ckpt"),
            ],
            check=True,
            env=child_env(),
            preexec_fn=die_with_parent,
        )

    return hf, build_once(cache / "mcore" / _fingerprint(hf), convert) / "ckpt"


def _fingerprint(hf: Path) -> str:
    """A key of the HF directory ``hf``: its path, config and weight files' names, sizes and times."""
    fingerprint = hashlib.sha1(str(hf.resolve()).encode() + (hf / "config.json").read_bytes()).hexdigest()[:12]
    for f in sorted(hf.glob("*.safetensors")):
        fingerprint = hashlib.sha1(
            (fingerprint + f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}").encode()
        ).hexdigest()[:12]
    return fingerprint


def engine_model(cfg: RunConfig, hf: Path) -> Path:
    """The HF directory the policy's engines start from: ``hf``, or with ``engines.quantization=fp8`` its FP8 copy
    (:func:`~moerl.checkpoint.hf.save_fp8`), made once into ``run.cache_dir``."""
    if cfg.engines.quantization == "none":
        return hf
    from moerl.checkpoint.hf import save_fp8

    def quantize(staging: Path) -> None:
        log.info("writing an FP8 copy of %s for the engines (once)", hf)
        save_fp8(hf, staging / "model")

    return build_once(Path(cfg.run.cache_dir).expanduser() / "fp8" / _fingerprint(hf), quantize) / "model"
