"""Process groups: one place that turns a parallel layout into megatron-core parallel state."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from moerl.env import free_port
from moerl.layout import Layout
from moerl.megatron import cpu_compat


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
    cpu_compat.bind_te_general_gemm()
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
