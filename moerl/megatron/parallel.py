"""Process groups: one place that turns a parallel layout into megatron-core parallel state."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from moerl.env import free_port
from moerl.errors import MoerlError
from moerl.megatron import cpu_compat


class LayoutError(MoerlError):
    """A parallel layout that does not fit the model or the world size."""


@dataclass(frozen=True)
class Layout:
    """Tensor, pipeline, expert and expert-tensor parallel sizes; data parallel is what is left.

    ``etp`` defaults to 1 under expert parallelism: experts are small matrices, and megatron's
    "parallel folding" lets EP span the TP ranks, so TP2+EP2 runs on two ranks. Without expert
    parallelism it defaults to ``tp`` and must equal it (see ``__post_init__``).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp if self.ep == 1 else 1)
        for name in ("tp", "pp", "ep", "etp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}={getattr(self, name)}: parallel sizes must be >= 1")
        # With EP=1 megatron-core marks expert weights as dense parameters and reduces their
        # gradients over the dense data-parallel group only; if ETP != TP the expert replicas span
        # more ranks than that group and their gradients would silently miss contributions.
        if self.ep == 1 and self.etp != self.tp:
            raise LayoutError(
                f"etp={self.etp} with ep=1 needs etp == tp ({self.tp}): megatron-core reduces expert "
                "gradients over the dense data-parallel group when expert parallelism is off"
            )

    @property
    def sequence_parallel(self) -> bool:
        # megatron-core MoE with TP>1 requires sequence parallelism.
        return self.tp > 1

    def check_world(self, world_size: int) -> None:
        dense = self.tp * self.pp
        expert = self.etp * self.ep * self.pp
        if world_size % dense:
            raise LayoutError(f"world size {world_size} is not divisible by tp*pp = {dense}")
        if world_size % expert:
            raise LayoutError(f"world size {world_size} is not divisible by etp*ep*pp = {expert}")

    def __str__(self) -> str:
        return f"TP{self.tp} PP{self.pp} EP{self.ep} ETP{self.etp}"


def init_process_group(timeout_s: float = 600) -> None:
    """The trainer ranks' default process group (from torchrun's environment): NCCL on this rank's own
    GPU (``LOCAL_RANK``), chosen before the group exists, else gloo. The only place moerl creates it.

    No ``device_id=`` is passed: torch would then build later groups by splitting the default
    communicator, and the weight-sync group shared with the engines is not a split of it."""
    if dist.is_initialized():
        return
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))


def collective_device() -> torch.device:
    """Where a tensor must be for a collective of the default group: this rank's GPU under NCCL (which
    refuses CPU tensors), the CPU under gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def init_distributed(layout: Layout, seed: int = 1234, timeout_s: int = 600) -> None:
    """Initialise torch.distributed (:func:`init_process_group`, unless done) and megatron parallel state.

    Uses NCCL with CUDA, gloo (plus the CPU compatibility layer) without.
    """
    if not torch.cuda.is_available():
        cpu_compat.apply()
    init_process_group(timeout_s)
    layout.check_world(dist.get_world_size())
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def ensure_single_process_env() -> None:
    """Make a plain (non-torchrun) process a world of one, e.g. for the checkpoint converter."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
