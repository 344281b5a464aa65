"""The LoRA section of a run's config, and the names of the adapters' parameters: what the job's config, the converter,
the engines' server flags and the trainer share, without the adapters themselves (:mod:`moerl.megatron.lora`), which
need megatron-core."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from moerl.errors import LoRAError

LORA_PARAMS = ("lora_A", "lora_B")


@dataclass
class LoRAConfig:
    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0  # the update is scaled by alpha / rank (PEFT's convention)
    dropout: float = 0.0  # on the adapter's input, training passes only
    # Module paths (megatron names) to adapt, as glob patterns matched against the end of each path:
    # "linear_fc1" takes every expert's, shared expert's and dense MLP's; "*.local_experts.*.linear_fc1"
    # only the routed experts'; "shared_experts.*" only the shared experts'.
    targets: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    seed: int = 0  # adapter initialisation (A uniform like PEFT's kaiming init, B zero)

    def __post_init__(self):
        if self.rank < 1:
            raise LoRAError(f"lora.rank={self.rank}: must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise LoRAError(f"lora.dropout={self.dropout}: must be in [0, 1)")
        if not self.targets:
            raise LoRAError("lora.targets is empty: name at least one module (e.g. linear_qkv)")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def targets_module(self, path: str) -> bool:
        return any(fnmatch.fnmatchcase(path, t) or fnmatch.fnmatchcase(path, "*." + t) for t in self.targets)

    def adapts(self, tensor: str) -> bool:
        """Whether the megatron tensor ``tensor`` (``...linear_fc1.weight``) is a weight whose layer gets an adapter."""
        return tensor.endswith(".weight") and self.targets_module(tensor.removesuffix(".weight"))


def is_lora_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in LORA_PARAMS
