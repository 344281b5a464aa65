"""Per-rank bodies of the colocated-offload tests in tests/trainer/test_trainer.py (importable by spawned processes)."""

from __future__ import annotations

import logging
from unittest import mock

import torch
import torch.distributed as dist

from tests.workers import full_tensors


def _on_device(tensors) -> int:
    """The bytes of ``tensors``' storages, each once however many views share it (0 for a storage offloaded)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _held(trainer) -> dict[str, int]:
    """The bytes of the trainer's weights, optimizer state (less what views the weights) and gradient buffers on its
    device."""
    from moerl.trainer.trainer import _optimizer_tensors

    ddp = trainer.model
    weights = list(ddp.module.parameters())
    shared = {p.untyped_storage().data_ptr() for p in weights}
    state = [t for t in _optimizer_tensors(trainer.optimizer) if t.untyped_storage().data_ptr() not in shared]
    grads = [b.grad_data for b in ddp.buffers + ddp.expert_parallel_buffers]
    return {"weights": _on_device(weights), "state": _on_device(state), "grads": _on_device(grads)}


def offloads_on_a_gpu(mcore_dir: str, trainer_cfg, samples: list) -> dict[str, list[int]]:
    """A step, then each way the trainer's state leaves its device, on a trainer that takes its device for a GPU (its
    tensors stay on the CPU, where they are offloaded for real): for each, at every ``torch.cuda.empty_cache`` it made,
    the bytes its offloads held off the device then."""
    from moerl.trainer.trainer import Trainer

    trainer = Trainer(mcore_dir, trainer_cfg)
    trainer.step(samples)
    trainer.device = torch.device("cuda")
    emptied: list[int] = []

    def empty_cache() -> None:
        emptied.append(trainer.offloaded_state.held_bytes + trainer.offloaded_weights.held_bytes)

    def after(offload) -> list[int]:
        emptied.clear()
        offload()
        return list(emptied)

    def on_device_then_off() -> None:
        with trainer.on_device():
            pass

    def weights_on_device_then_off() -> None:
        with trainer.weights_on_device():
            pass

    with mock.patch.object(torch.cuda, "empty_cache", empty_cache):
        return {
            "training state after a step": after(trainer.offload_training_state),
            "the rest after a push": after(trainer.offload),
            "all after on_device": after(on_device_then_off),
            "all after weights_on_device": after(weights_on_device_then_off),
        }


def steps_with_a_push_between(mcore_dir: str, trainer_cfg, samples: list, offload: bool) -> dict:
    """Two steps on ``samples``; between them, with ``offload``, the trainer's state offloaded whole (as a colocated
    run's first push after a resume finds it) and its weights brought back as a push brings them
    (:meth:`~moerl.trainer.trainer.Trainer.weights_on_device`): what it held on its device before the offload, within
    and after; the weights it read within; each step's metrics."""
    from moerl.trainer.trainer import Trainer

    trainer = Trainer(mcore_dir, trainer_cfg)
    out: dict = {"metrics": [trainer.step(samples)]}
    if offload:
        out["before"] = _held(trainer)
        out["weights before"] = full_tensors(trainer.model.module)
        trainer.offload()
        with trainer.weights_on_device():
            out["within"] = _held(trainer)
            out["weights within"] = full_tensors(trainer.model.module)
        out["after"] = _held(trainer)
    out["metrics"].append(trainer.step(samples))
    return out


class _Backend:
    """An NCCL backend a collective has used, of a torch 2.12+ loading NCCL 2.29.7+: built with NCCL's communicator
    offload (``offload``), or without it, where its memory stats and suspend raise as torch's do."""

    def __init__(self, offload: bool):
        self.offload = offload
        self.calls: list[str] = []

    def memory_stats(self) -> dict[str, int]:
        if not self.offload:
            raise RuntimeError("getMemoryStats() requires NCCL 2.29.7 or later")
        return {"suspend": 1 << 20}

    def suspend(self) -> None:
        if not self.offload:
            raise RuntimeError("suspend() requires NCCL 2.29.7 or later")
        self.calls.append("suspend")

    def resume(self) -> None:
        self.calls.append("resume")


class _Said(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def communicators_where_ranks_lack_offload(lacking: list[list[int]]) -> list[dict]:
    """For each entry of ``lacking`` (the ranks whose torch was built without NCCL's communicator offload), the
    :class:`~moerl.megatron.parallel.IdleCommunicators` of a CUDA process over one used NCCL backend a rank, suspended
    twice, resumed, suspended and resumed again, as offloads and steps do: what each suspend returned, the calls the
    backend got, why they stay and what was logged."""
    from moerl.megatron import parallel
    from moerl.megatron.parallel import IdleCommunicators, init_process_group

    init_process_group(timeout_s=60)
    said = _Said()
    logging.getLogger("moerl.parallel").addHandler(said)
    out = []
    for ranks in lacking:
        backend = _Backend(offload=dist.get_rank() not in ranks)
        said.lines.clear()
        with (
            mock.patch.object(parallel, "_suspend_problem", lambda: None),
            mock.patch.object(parallel, "_used_nccl_backends", lambda ours, backend=backend: [backend]),
        ):
            with mock.patch.object(torch.cuda, "is_available", lambda: True):
                communicators = IdleCommunicators()
            freed = [communicators.suspend(), communicators.suspend()]
            communicators.resume()
            freed.append(communicators.suspend())
            communicators.resume()
        out.append(
            {"freed": freed, "calls": backend.calls, "unsupported": communicators.unsupported, "said": said.lines[:]}
        )
    return out
