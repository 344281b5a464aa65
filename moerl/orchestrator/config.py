"""The main job's config: typed omegaconf sections, read from YAML plus ``key=value`` overrides.

Unknown keys, wrong types and impossible combinations fail at load time with the key named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from moerl.megatron.lora import LoRAConfig
from moerl.tasks import TaskConfig
from moerl.trainer.config import TrainerConfig

MODES = ("sync", "periodic", "async")
PARTIAL = ("in_place", "retry")


class ConfigError(ValueError):
    """A config the job cannot run with; the message names the key and what to do."""


@dataclass
class RunSection:
    dir: str = "runs/qwen_moe_grpo"
    mode: str = "async"  # sync (generate, train, sync) | periodic (on-policy, overlapped) | async (bounded staleness)
    steps: int = 40  # optimizer steps (policy versions) to reach
    save_every: int = 0  # trainer checkpoint every N steps (0: only the last step)
    resume: bool = False  # continue from the newest checkpoint under dir
    cache_dir: str = "~/.cache/moerl"  # the tiny demo model and converted checkpoints, made once
    progress: bool = True  # a progress bar on stderr (rank 0)
    trainer_ranks: int = 0  # torchrun ranks of the trainer (0: trainer.tp * pp * ep); the rest of the node's GPUs serve


@dataclass
class ModelSection:
    path: str | None = None  # HF model directory; null: the tiny warmed-up Qwen3-MoE of the CPU demo
    mcore: str | None = None  # its converted Megatron checkpoint; null: converted once into the cache


@dataclass
class EngineSection:
    server: str = "auto"  # auto (sglang with CUDA, else embedded) | sglang | embedded
    urls: list[str] = field(default_factory=list)  # engines already running (multi-node); empty: start them here
    replicas: int = 1
    gpus_per_replica: int = 1
    dtype: str = "auto"  # auto: bfloat16 with CUDA, float32 without
    mem_fraction_static: float = 0.7
    extra_args: list[str] = field(default_factory=list)
    start_timeout_s: float = 900.0


@dataclass
class RolloutSection:
    groups_per_step: int = 8  # prompts (GRPO groups) per optimizer step
    samples_per_prompt: int = 8  # group size n
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_k: int = 16  # a finite top_k: the sampling mask needs one (SGLang refuses top_k=-1 with masks)
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)  # stop tokens besides the tokenizer's end token
    max_staleness: int = 1  # async: groups whose oldest token is more versions old than this are dropped
    max_outstanding_groups: int | None = None  # async depth bound (in flight + buffered); default groups_per_step * max(1, max_staleness)
    partial: str = "in_place"  # rollouts in flight at a weight update: in_place (continue, per-token versions) | retry (abort, regenerate)
    seed: int = 0

    @property
    def outstanding(self) -> int:
        # Generation runs ahead of training by this many groups: one batch per version of staleness
        # allowed. A deeper queue only fills with groups that are dropped as stale when their turn comes.
        return self.max_outstanding_groups or self.groups_per_step * max(1, self.max_staleness)


@dataclass
class SyncSection:
    method: str = "broadcast"  # broadcast (NCCL/gloo group with the engines) | disk (safetensors + update_weights_from_disk)
    bucket_mb: int = 512
    verify: bool = False  # after each update, compare the engines' copy of every tensor (first rows) with the trainer's
    verify_rows: int = 4


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    engines: EngineSection = field(default_factory=EngineSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    sync: SyncSection = field(default_factory=SyncSection)
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # per-expert adapters; enabled: base frozen, adapters synced alone


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """The YAML file (if any) and ``section.key=value`` overrides on the typed schema."""
    try:
        merged = OmegaConf.structured(RunConfig)
        if path is not None:
            if not Path(path).is_file():
                raise ConfigError(f"config file {path} does not exist")
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"override {bad[0]!r} is not key=value (e.g. trainer.steps=20 run.dir=/tmp/r)")
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        cfg: RunConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"config{' ' + key if key else ''}: {str(e).splitlines()[0]}") from None
    except ValueError as e:  # a section's own check (__post_init__)
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"config: {e}") from None
    check(cfg)
    return cfg


def served_by(engines: EngineSection) -> str:
    """The engine server the job starts: ``engines.server``, with auto meaning SGLang where CUDA is."""
    if engines.server != "auto":
        return engines.server
    import torch

    return "sglang" if torch.cuda.is_available() else "embedded"


def check(cfg: RunConfig) -> None:
    r = cfg.rollout
    problems = []
    if cfg.run.mode not in MODES:
        problems.append(f"run.mode={cfg.run.mode!r}: expected one of {', '.join(MODES)}")
    if r.partial not in PARTIAL:
        problems.append(f"rollout.partial={r.partial!r}: expected one of {', '.join(PARTIAL)}")
    if r.groups_per_step < 1 or r.samples_per_prompt < 2:
        problems.append("rollout.groups_per_step must be >= 1 and samples_per_prompt >= 2 (GRPO compares within a group)")
    if r.max_staleness < 0:
        problems.append("rollout.max_staleness must be >= 0")
    if r.outstanding < r.groups_per_step:
        problems.append(f"rollout.max_outstanding_groups={r.max_outstanding_groups} is below groups_per_step={r.groups_per_step}: a step could never fill")
    if cfg.trainer.replay.sampling_mask and not 1 < r.top_k:
        problems.append(f"trainer.replay.sampling_mask needs a finite rollout.top_k > 1 (got {r.top_k})")
    if cfg.engines.server not in ("auto", "sglang", "embedded"):
        problems.append(f"engines.server={cfg.engines.server!r}: expected auto, sglang or embedded")
    if cfg.sync.method not in ("broadcast", "disk"):
        problems.append(f"sync.method={cfg.sync.method!r}: expected broadcast or disk")
    if cfg.lora.enabled and cfg.sync.method == "broadcast" and served_by(cfg.engines) == "sglang":
        problems.append("lora.enabled with SGLang engines needs sync.method=disk: SGLang takes adapter tensors only from "
                        "processes on its own machine, so adapters reach it as PEFT directories")
    if cfg.lora.enabled and cfg.sync.verify:
        problems.append("sync.verify reads the engines' weights back, which a LoRA run never changes: set sync.verify=false")
    if cfg.run.steps < 1:
        problems.append("run.steps must be >= 1")
    if problems:
        raise ConfigError("; ".join(problems))


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
