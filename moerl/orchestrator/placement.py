"""Where the engines run beside the trainer (``run.placement``), and what that asks of each phase of the job.

:class:`Separate`: the engines on GPUs of their own, after the trainer's on a node; the weights reach them by the
run's sync method. :class:`Colocated`: the engines on the trainer's own GPUs, taking turns with it. The trainer's state
leaves the device before the engines start and after each step; the engines (and the scorers' replicas the job started:
the reward model's, the teacher's) give back their memory once a step's groups are in and take it back before the next
generation; the weights are handed over on the machine (:class:`~moerl.weight_sync.tensor.TensorSync`). The job builds
one placement (:func:`placement_of`) and calls its hooks at every phase, whichever it is; the memory plan
(:mod:`moerl.orchestrator.memory`) takes its terms from it. What colocation refuses is checked with the rest of the
config, when it loads (:func:`~moerl.orchestrator.config.colocation_problems`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moerl.errors import MoerlError
from moerl.orchestrator.config import started_scorers

# The engines' client and the weight sync are imported where a job uses them: the memory plan, made by the launcher's
# check before torchrun, imports this module.

if TYPE_CHECKING:
    from moerl.engines.client import EngineClient
    from moerl.engines.pool import EnginePool
    from moerl.layout import Layout
    from moerl.orchestrator.config import RunConfig, Scorer
    from moerl.trainer.protocol import TrainerLike
    from moerl.trainer.trainer import Trainer
    from moerl.weight_sync.base import SyncStats, WeightSync
    from moerl.weight_sync.tensor import TensorSync

log = logging.getLogger("moerl.train")

# A weight-sync NCCL communicator, assumed to hold NCCL's default buffers: NCCL_BUFFSIZE (4 MiB) per channel per peer,
# on up to 32 channels (NCCL_MAX_CTAS's default; NVLink rings on H100s open that many), to its two ring neighbours:
# 256 MiB. Separate, a broadcast sync's groups hold them on each engine GPU, outside mem_fraction_static; colocated, a
# trainer rank keeps them resident while the engines run.
NCCL_BUFFER_BYTES = 4 << 20
NCCL_CHANNELS = 32
NCCL_RING_PEERS = 2
COMMUNICATOR_BYTES = NCCL_BUFFER_BYTES * NCCL_CHANNELS * NCCL_RING_PEERS
# Colocated (assumed, not measured): what a released SGLang engine keeps on each of its GPUs (its CUDA context, its own
# TP group's communicator, the memory saver's bookkeeping), and what a trainer rank keeps while the engines run (its
# CUDA context, half a GiB, and NCCL communicators: megatron-core's, about eight groups, and the weight handover's,
# which carries each bucket to the engines' GPUs; counted though they are suspended where torch and NCCL can, which the
# plan cannot know before launch).
RELEASED_ENGINE_BYTES = 2 << 30
TRAINER_RESIDENT_BYTES = (1 << 29) + 9 * COMMUNICATOR_BYTES
SCORER_MEMORY_TIMEOUT_S = 120.0  # a release or resume of a scorer replica's memory


@dataclass
class ScorerMemory:
    """A scorer's replicas the job starts, per GPU (:func:`~moerl.orchestrator.config.scorers`)."""

    scorer: Scorer
    weights: float  # bytes of weights on each of its GPUs
    static: float  # the static memory SGLang takes on each: a fraction of what is free when it starts


@dataclass
class Colocation:
    """Per GPU of a colocated node, the phases that take turns: the trainer's is :attr:`MemoryPlan.trainer`."""

    engines: float  # the engines generate: their static memory (weights, KV cache) beside the trainer's resident part
    push: float  # the handover: the trainer's weights, the engines' weights and one bucket, beside what stays resident
    ranks: int  # trainer ranks on the node, each keeping MemoryPlan.host in host memory
    scorer_backup: float = 0.0  # the node's scorer replicas' weights, copied into host memory (weights CPU backup)


class Placement:
    """Where the engines run, as the hooks each phase of the job calls: on every rank around the trainer's phase, on
    global rank 0 around the engines' (given the weight sync and the pools of scorer replicas the job started), and the
    memory plan's terms. A hook that does nothing here does nothing for :class:`Separate`."""

    # Whether the engines' pools (the policy's, the scorers') load at once and while the trainer is built (GPUs of their
    # own), or each once the trainer made room and the pool before holds its memory (GPUs they share, where SGLang sizes
    # its static memory from what is free when it starts).
    loads_overlap: bool
    # Whether the scorers' replicas the job starts keep their weights in host memory while they give back the GPU's.
    scorer_weights_on_host: bool

    # ---- the engines' GPUs and weight sync -----------------------------------------------------
    def gpu_offset(self, taken: int) -> int:
        """A node's first GPU for engines the job starts, where ``taken`` of its GPUs are the trainer's and those of
        engines started before."""
        raise NotImplementedError

    def sync_strategy(self, cfg: RunConfig) -> str:
        """How the weights reach the engines: tensor (handed over on the machine), adapters (LoRA), simulated, disk
        or broadcast."""
        raise NotImplementedError

    # ---- every rank, around the trainer's phase ------------------------------------------------
    def make_room(self, trainer: TrainerLike) -> None:
        """Before the engines start."""

    def after_training(self, trainer: TrainerLike) -> None:
        """After a step's optimizer step, before the weight sync."""

    def at_end(self, trainer: TrainerLike) -> None:
        """After the last step, before the process group ends."""

    # ---- around the engines' phase: on global rank 0, which holds them (elsewhere none is released) ----
    def before_training(self, sync: WeightSync, scorers: list[EnginePool]) -> None:
        """The step's groups are in: the trainer's turn."""

    def before_generation(self, scorers: list[EnginePool]) -> None:
        """The engines serve the new policy: the next generation's turn."""

    def started_again(self, scorer_urls: list[str]) -> None:
        """These scorer replicas were started again (holding their memory)."""

    def step_metrics(self, sync: WeightSync, stats: SyncStats, wall: float) -> dict[str, float]:
        """What the placement adds to a step's metrics; ``wall``: the step's seconds."""
        return {}

    # ---- the memory plan -----------------------------------------------------------------------
    def senders(self, cfg: RunConfig, layout: Layout) -> int:
        """Trainer ranks that each form a weight-sync group with every engine GPU (whose communicators take memory
        there beside ``engines.mem_fraction_static``)."""
        raise NotImplementedError

    def trainer_terms(self, cfg: RunConfig, terms: dict[str, float], host: dict[str, float]) -> None:
        """What a trainer rank holds by placement: ``terms`` on its device, ``host`` in host memory."""

    def scorers_on_trainer_gpus(self, cfg: RunConfig) -> bool:
        """Whether the scorers' replicas the job starts share the trainer's GPUs."""
        raise NotImplementedError

    def scorer_gpus(self, cfg: RunConfig) -> int:
        """The GPUs of their own the scorers' replicas the job starts take, beside the trainer's and the policy
        engines'."""
        raise NotImplementedError

    def scorer_room(self, cfg: RunConfig, device: float, before: float) -> float:
        """The memory of a scorer engine GPU that SGLang takes its static fraction of: what is free when it starts,
        where the scorers started before it took ``before`` of it if they share its GPUs."""
        return device

    def phases(
        self,
        cfg: RunConfig,
        trainer_weights: float,
        engine_weights: float,
        scorers: list[ScorerMemory],
        world: int,
        device: float,
    ) -> Colocation | None:
        """Per GPU, the phases that take turns on the trainer's GPUs (None: the trainer has them to itself), from a
        trainer rank's weights, each engine GPU's and each scorer's."""
        return None


class Separate(Placement):
    """The engines on GPUs of their own, after the trainer's on a node; they generate while the trainer trains."""

    loads_overlap = True
    scorer_weights_on_host = False

    def gpu_offset(self, taken: int) -> int:
        return taken

    def sync_strategy(self, cfg: RunConfig) -> str:
        if cfg.lora.enabled:
            return "adapters"
        if cfg.simulation.profile is not None:
            return "simulated"
        return cfg.sync.method

    def senders(self, cfg: RunConfig, layout: Layout) -> int:
        # every pipeline stage's expert-parallel ranks send (sends_weights)
        return layout.pp * layout.ep if cfg.sync.method == "broadcast" and not cfg.sync.delta else 0

    def scorers_on_trainer_gpus(self, cfg: RunConfig) -> bool:
        return False

    def scorer_gpus(self, cfg: RunConfig) -> int:
        return sum(s.gpus for s in started_scorers(cfg))


class Colocated(Placement):
    """The engines, and the scorers' replicas the job starts, on the trainer's own GPUs from the first, taking turns
    with the trainer: refused with LoRA, a simulation, engines given by URL and modes other than sync
    (:func:`~moerl.orchestrator.config.colocation_problems`)."""

    loads_overlap = False
    scorer_weights_on_host = True  # no push brings a scorer's weights back

    def __init__(self) -> None:
        self.released: set[str] = set()  # rank 0: scorer replicas the last sleep released, less those started since

    def gpu_offset(self, taken: int) -> int:
        return 0

    def sync_strategy(self, cfg: RunConfig) -> str:
        return "tensor"

    # ---- every rank, around the trainer's phase ------------------------------------------------
    def make_room(self, trainer: TrainerLike) -> None:
        _real(trainer).offload()

    def after_training(self, trainer: TrainerLike) -> None:
        _real(trainer).offload_training_state()  # before the engines' weights come back for the push

    def at_end(self, trainer: TrainerLike) -> None:
        _real(trainer).resume_communicators()  # none left suspended when the process group ends

    # ---- global rank 0, around the engines' phase ----------------------------------------------
    def before_training(self, sync: WeightSync, scorers: list[EnginePool]) -> None:
        """The engines give back their memory, and the scorers' replicas theirs. One that fails to is left as it is (the
        update wakes, or passes over, what it finds)."""
        from moerl.engines.client import EngineError

        try:
            _handover(sync).sleep()
        except (MoerlError, EngineError) as e:
            log.warning("colocated: the engines did not all release their memory before the trainer's phase: %s", e)
        urls = [url for pool in scorers for url in pool.urls]
        self.released = _on_scorer_replicas(urls, "release their memory", _release_memory)

    def before_generation(self, scorers: list[EnginePool]) -> None:
        """The scorer replicas the sleep released take back their memory (their weights from host memory: they take no
        updates) and score again. One started again since holds its memory and serves already; SGLang's scheduler
        fails on a resume of what it did not release. One that fails to wake is killed and started again: the
        manager's scoring waits on a paused replica, since it answers."""
        woken = sorted(self.released)
        self.released = set()
        failed = set(woken) - _on_scorer_replicas(woken, "take back their memory", _take_back_memory)
        for pool in scorers:  # left paused or without its memory, it would never score again
            if dead := sorted(failed & set(pool.urls)):
                log.warning("colocated: scorer engine(s) %s killed, to be started again", ", ".join(dead))
                pool.kill(dead)

    def started_again(self, scorer_urls: list[str]) -> None:
        self.released -= set(scorer_urls)

    def step_metrics(self, sync: WeightSync, stats: SyncStats, wall: float) -> dict[str, float]:
        handover = _handover(sync)
        phases = {
            "colocate/sleep_seconds": handover.sleep_seconds,
            "colocate/wake_seconds": handover.wake_seconds,
            "colocate/push_seconds": stats.seconds,
        }
        return {
            **phases,
            "colocate/step_fraction": sum(phases.values()) / wall,
            "colocate/trainer_offloaded_bytes": float(handover.offloaded_bytes),  # rank 0's
        }

    # ---- the memory plan -----------------------------------------------------------------------
    def senders(self, cfg: RunConfig, layout: Layout) -> int:
        return 0  # handed over on the machine

    def trainer_terms(self, cfg: RunConfig, terms: dict[str, float], host: dict[str, float]) -> None:
        """While the engines run, the weights, the optimizer state and the KL reference are in host memory (the
        gradients are freed); on the device, what a released engine keeps."""
        host["weights"] = terms["weights"]
        host.update({name: terms[name] for name in ("optimizer state", "KL reference") if name in terms})
        terms["released engine (assumed)"] = RELEASED_ENGINE_BYTES * (1 + len(started_scorers(cfg)))

    def scorers_on_trainer_gpus(self, cfg: RunConfig) -> bool:
        return bool(started_scorers(cfg))

    def scorer_gpus(self, cfg: RunConfig) -> int:
        return 0

    def scorer_room(self, cfg: RunConfig, device: float, before: float) -> float:
        """A scorer's replicas start beside the policy's engines, the trainer's resident part and the scorers started
        before them."""
        return device - (cfg.engines.mem_fraction_static * device + TRAINER_RESIDENT_BYTES + before)

    def phases(
        self,
        cfg: RunConfig,
        trainer_weights: float,
        engine_weights: float,
        scorers: list[ScorerMemory],
        world: int,
        device: float,
    ) -> Colocation:
        released = RELEASED_ENGINE_BYTES * (1 + len(scorers))
        return Colocation(
            engines=cfg.engines.mem_fraction_static * device + sum(s.static for s in scorers) + TRAINER_RESIDENT_BYTES,
            push=trainer_weights + engine_weights + (cfg.sync.bucket_mb << 20) + released + TRAINER_RESIDENT_BYTES,
            ranks=world,
            # each scorer GPU's weights (a replica's over its GPUs), kept in host memory while released
            scorer_backup=sum(s.weights * s.scorer.gpus for s in scorers),
        )


def placement_of(cfg: RunConfig) -> Placement:
    """The placement ``run.placement`` names."""
    return Colocated() if cfg.run.placement == "colocated" else Separate()


def _handover(sync: WeightSync) -> TensorSync:
    from moerl.weight_sync.tensor import TensorSync

    assert isinstance(sync, TensorSync), "colocated placement syncs by TensorSync (Colocated.sync_strategy)"
    return sync


def _on_scorer_replicas(urls: list[str], what: str, call: Callable[[EngineClient], Awaitable[None]]) -> set[str]:
    """``call(client)`` on each of these colocated scorer replicas; those it succeeded on. One that fails is left as it
    is (revive restarts it if it died; a restarted replica holds its memory)."""
    from moerl.engines.client import EngineClient, EngineError

    async def each(url: str) -> None:
        async with EngineClient([url], timeout_s=SCORER_MEMORY_TIMEOUT_S, retries=0) as client:
            await call(client)

    async def every() -> list:
        return await asyncio.gather(*(each(url) for url in urls), return_exceptions=True)

    if not urls:
        return set()
    done = set()
    for url, outcome in zip(urls, asyncio.run(every()), strict=True):
        if isinstance(outcome, MoerlError | EngineError):
            log.warning("colocated: scorer engine %s did not %s: %s", url, what, outcome)
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            done.add(url)
    return done


async def _release_memory(client: EngineClient) -> None:
    from moerl.engines.client import EngineError

    await client.pause("retract")
    try:
        await client.release_memory()
    except (MoerlError, EngineError):
        await client.resume()  # it serves on, holding its memory, rather than staying paused through the step
        raise


async def _take_back_memory(client: EngineClient) -> None:
    await client.resume_memory()
    await client.resume()


def _real(trainer: TrainerLike) -> Trainer:
    """The trainer colocation offloads: the real one (a simulation is refused colocation)."""
    from moerl.trainer.trainer import Trainer

    assert isinstance(trainer, Trainer), "run.placement=colocated takes turns with the real trainer"
    return trainer
