"""Process groups: one place that turns a parallel layout into megatron-core parallel state.

megatron-core is imported where that state is made: the job's launcher reaches :func:`on_lead` through the run's
checkpoints, and checks a run without it (2 s of imports on a CPU).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from moerl.env import free_port
from moerl.errors import EnginesDown, MoerlError, RolloutManagerLost, relayed
from moerl.layout import Layout
from moerl.megatron import cpu_compat

log = logging.getLogger("moerl.parallel")


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


# Errors every rank raises as themselves when global rank 0 meets them alone, so that the job writes its checkpoint on
# each; what the other ranks' copy says.
_RAISED_AS_THEMSELVES = {
    EnginesDown: "no engine answered /health for engines.down_timeout_s (global rank 0's error says which)",
    RolloutManagerLost: "the rollout manager process exited (global rank 0's error says how)",
}


def lead_agrees(error: Exception | None, what: str) -> None:
    """Collective: how a part of the job that global rank 0 took alone ended (``error``: what it raised there; None on
    the other ranks, and on success). If it failed, every rank raises now, so that none waits in a collective rank 0
    never joins: under NCCL until its timeout, and launched without torchrun nothing else ends them.
    :class:`EnginesDown` and :class:`RolloutManagerLost` are raised as themselves on every rank; any other failure rank
    0 raises as itself and the other ranks as a relayed :class:`MoerlError` saying that rank 0 failed in ``what``."""
    kinds = list(_RAISED_AS_THEMSELVES)
    code = (
        0 if error is None else next((i + 1 for i, kind in enumerate(kinds) if isinstance(error, kind)), len(kinds) + 1)
    )
    outcome = torch.tensor([code], dtype=torch.int32, device=collective_device())
    if dist.get_world_size() > 1:
        dist.broadcast(outcome, 0)
    if error is not None:
        raise error
    code = int(outcome.item())
    if 0 < code <= len(kinds):
        raise relayed(kinds[code - 1](_RAISED_AS_THEMSELVES[kinds[code - 1]]))
    if code:
        raise relayed(MoerlError(f"global rank 0 failed in {what} (its error says why)"))


def ranks_agree(error: Exception | None, what: str) -> None:
    """Collective: how a check every rank made of its own ended (``error``: what it raised there). If any failed, every
    rank raises now: that rank its error, the others a relayed :class:`MoerlError` naming the rank and its error, so
    that no rank goes on to wait for one that has stopped."""
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, None if error is None else str(error))  # one line per rank, once
    if error is not None:
        raise error
    failed = [(rank, message) for rank, message in enumerate(found) if message is not None]
    if failed:
        rank, message = failed[0]
        raise relayed(MoerlError(f"rank {rank} failed in {what}: {message}"))


def on_lead(call, what: str):
    """Collective: ``call()`` on global rank 0 alone, then :func:`lead_agrees` on how it ended; its result on rank 0,
    None on the other ranks."""
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = call()
        except Exception as e:  # noqa: BLE001 - told to every rank, then raised
            error = e
    lead_agrees(error, what)
    return result


class IdleCommunicators:
    """megatron-core's NCCL communicators, suspended while colocated engines hold the GPU: ``ncclCommSuspend`` gives
    back their buffers (7-10 GB a rank at 3D+EP, verl #6266) and keeps the communicators, which ``ncclCommResume``
    restores at the same addresses. torch >= 2.12 built with NCCL >= 2.29.7 has it (``Backend.suspend``); elsewhere
    they stay (:attr:`unsupported` says why), and the first offload says so once.

    Each suspend and resume is collective over that communicator's ranks, so every rank takes megatron-core's groups in
    one order: by the name parallel_state keeps each under, which is the same on every rank. The world group stays up:
    the job's own collectives run on it while the engines generate (and the data plane's transfers). So does a group
    no collective has used yet, which holds no communicator."""

    def __init__(self) -> None:
        self.suspended: list[Any] = []  # the backends suspended now, in the order they were
        # why the communicators stay, the same on every rank; None: none has found a reason yet
        self.unsupported: str | None = None if torch.cuda.is_available() else "no CUDA"
        self.ours: list[dist.ProcessGroup] = []  # moerl's own groups, suspended after megatron-core's (see include)

    def include(self, group: dist.ProcessGroup | None) -> None:
        """``group`` suspended too, after megatron-core's groups and those included before (None: this rank is in no
        such group). Every member includes it at the same point, so the order stays one on every rank."""
        if group is not None and all(group is not known for known in self.ours):
            self.ours.append(group)

    def suspend(self) -> int:
        """Collective: every used NCCL communicator of megatron-core's groups suspended; the bytes they gave back.

        Every rank first finds alone whether it can suspend its own (:func:`_suspendable`), then all agree over the
        world group: a rank suspending while another cannot would wait in NCCL for it for good. Where one cannot, none
        does, now or later, and each says why once."""
        if self.unsupported is not None or self.suspended:
            return 0
        backends, freed, problem = _suspendable(self.ours)
        self.unsupported = _first_problem(problem)
        if self.unsupported is not None:
            log.warning("megatron-core's NCCL communicators stay on the GPU meanwhile: %s", self.unsupported)
            return 0
        for backend in backends:
            backend.suspend()
            self.suspended.append(backend)
        return freed

    def resume(self) -> None:
        """Collective: what :meth:`suspend` suspended, back, in the same order."""
        for backend in self.suspended:
            backend.resume()
        self.suspended = []


def _suspendable(ours: list[dist.ProcessGroup]) -> tuple[list[Any], int, str | None]:
    """This rank's used NCCL backends (:func:`_used_nccl_backends`) and the bytes they can give back, or why it cannot
    suspend them. Each backend is asked alone (``ncclCommMemStats``, no collective): torch built against an NCCL older
    than 2.29.7 has ``Backend.suspend`` and may load a newer NCCL, and then its memory stats raise, as its suspend
    would (torch gates both on the NCCL it was compiled with)."""
    problem = _suspend_problem()
    if problem is not None:
        return [], 0, problem
    backends = _used_nccl_backends(ours)
    try:
        freed = sum(int(backend.memory_stats().get("suspend", 0)) for backend in backends)
    except RuntimeError as e:  # NotImplementedError is one
        built = f"torch {torch.__version__} was built without ncclCommSuspend, whatever NCCL it loads ({e})"
        return [], 0, f"{built}; a torch built with NCCL 2.29.7 or later has it"
    return backends, freed, None


def _first_problem(mine: str | None) -> str | None:
    """Collective over the world: the first rank's reason not to suspend (``mine``: this rank's), naming the rank;
    None where every rank can."""
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)  # a line per rank, once per suspend
    return next((f"rank {rank}: {why}" for rank, why in enumerate(found) if why is not None), None)


def _suspend_problem() -> str | None:
    """Why this process cannot suspend NCCL communicators, as far as its torch and NCCL versions tell; None where it
    can."""
    from torch._C._distributed_c10d import Backend

    if not hasattr(Backend, "suspend"):
        return f"torch {torch.__version__} has no Backend.suspend (torch 2.12 or later has)"
    version = tuple(torch.cuda.nccl.version())[:3]
    if version < (2, 29, 7):
        nccl = ".".join(map(str, version))
        return f"torch {torch.__version__} runs NCCL {nccl}; ncclCommSuspend needs 2.29.7 or later"
    return None


def _groups(ours: Sequence[dist.ProcessGroup] = ()) -> list[dist.ProcessGroup]:
    """megatron-core's process groups, in the order of the names parallel_state keeps them under, then ``ours``, each
    once (the world group left out)."""
    from megatron.core import parallel_state

    named = sorted(n for n in dir(parallel_state) if n.startswith("_") and "GROUP" in n)
    out: list[dist.ProcessGroup] = []
    for value in [getattr(parallel_state, name) for name in named] + [list(ours)]:
        groups = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else [value]
        for group in groups:
            if isinstance(group, dist.ProcessGroup) and group is not dist.group.WORLD and group not in out:
                out.append(group)
    return out


def _used_nccl_backends(ours: list[dist.ProcessGroup]) -> list[Any]:
    """The NCCL backends of :func:`_groups` (megatron-core's, then ``ours``) that a collective has used."""
    out = []
    for group in _groups(ours):
        if dist.get_backend(group) != "nccl":
            continue
        backend: Any = group._get_backend(torch.device("cuda"))  # torch's stubs lack suspend and the count
        if backend._get_sequence_number_for_group():  # collectives issued: its communicator exists
            out.append(backend)
    return out


def _destroy_model_parallel() -> None:
    """megatron-core's parallel state dropped and its process groups destroyed. Its ``destroy_model_parallel``
    destroys only its gloo side groups and forgets the rest, so each initialisation in one process (tests, a converter
    called twice) would leave 17 groups behind, with transport threads that poll."""
    from megatron.core import parallel_state

    held = _groups()
    parallel_state.destroy_model_parallel()
    registered = dist.distributed_c10d._world.pg_map  # torch's registry: the groups not destroyed yet
    for group in held:
        if group in registered:
            dist.destroy_process_group(group)


def init_distributed(layout: Layout, seed: int = 1234, timeout_s: int = 600) -> None:
    """Initialise torch.distributed (:func:`init_process_group`, unless done) and megatron parallel state.

    Uses NCCL with CUDA, gloo (plus the CPU compatibility layer) without.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not torch.cuda.is_available():
        cpu_compat.apply()
    cpu_compat.bind_te_general_gemm()
    init_process_group(timeout_s)
    layout.check_world(dist.get_world_size())
    _destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    _destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def ensure_single_process_env() -> None:
    """Make a plain (non-torchrun) process a world of one, e.g. for the checkpoint converter."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
