"""Typed config sections of the trainer (omegaconf structured configs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moerl.choices import check_choices
from moerl.errors import ConfigError
from moerl.trainer.objectives import LossConfig

RoutingMode = Literal["off", "R2", "R3"]  # R2: replay the old-policy forward's routing; R3: the rollout's
MicroBatchFormat = Literal["padded", "packed"]
TrainerDtype = Literal["auto", "bfloat16", "float32"]  # auto: bfloat16 on CUDA, float32 on CPU
MomentsDtype = Literal["float32", "bfloat16"]
LRDecayStyle = Literal[
    "constant", "linear", "cosine", "inverse-square-root"
]  # megatron-core's schedules without extra settings


@dataclass
class ReplayConfig:
    routing: RoutingMode = "R3"  # off | R2 (replay the old-policy forward's routing) | R3 (replay the rollout's)
    sampling_mask: bool = True  # score tokens renormalised over the engine's kept set
    # The replay trace (moerl check-replay): per step, the experts every router used for this many samples of each
    # data-parallel replica, beside the rollout's, written under trace_dir (the job's: RUN_DIR/replay_trace). 0: none.
    trace_samples: int = 0
    trace_dir: str | None = None

    def __post_init__(self):
        check_choices(self, "replay")


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_steps: int | None = None  # default: no decay
    lr_decay_style: LRDecayStyle = "constant"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # shard optimizer state over data parallel (CUDA only: gloo has no reduce-scatter)
    distributed_optimizer: bool = True
    # megatron-core's hybrid-device optimizer: Adam's state, master weights and update in host memory (with the
    # distributed optimizer, so on CUDA; without CUDA the state is in host memory anyway)
    cpu_offload: bool = False
    # Adam's two moments: bfloat16 halves them (megatron-core's precision-aware optimizer: Transformer Engine's
    # FusedAdam with the distributed optimizer, so on CUDA only)
    moments_dtype: MomentsDtype = "float32"

    def __post_init__(self):
        check_choices(self, "optim")


@dataclass
class TrainerConfig:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    micro_batch_tokens: int = 4096  # tokens per micro-batch, padding included
    # padded: [b, s] rows | packed: samples end to end, each attending only to itself
    micro_batch_format: MicroBatchFormat = "padded"
    # packed only: what a group's samples share (its prompt, an episode's history before a fork) fed once, a prefix tree
    shared_prompt: bool = False
    dtype: TrainerDtype = "auto"
    recompute: bool = False  # full activation recompute, one layer per checkpoint; routing replay follows it
    # colocated: megatron-core's NCCL communicators suspended while the engines run (torch >= 2.12 with NCCL >= 2.29.7;
    # elsewhere they stay, and the run says so once)
    suspend_communicators: bool = True
    loss: LossConfig = field(default_factory=LossConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self):
        check_choices(self, "trainer")
        if self.shared_prompt and self.micro_batch_format != "packed":
            raise ConfigError("trainer.shared_prompt feeds packed micro-batches: set trainer.micro_batch_format=packed")
        if self.shared_prompt and self.replay.trace_samples:
            raise ConfigError(
                "trainer.shared_prompt: the replay trace reads each sample's positions end to end, which a shared "
                "prompt's responses are not; set trainer.replay.trace_samples=0"
            )
