"""The job's parts, as each run configures them: the trainer (or a simulation's), the engines (started here or given by
URL), the rollout manager's process, and the weight-sync strategy with the address its groups are hosted at."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moerl.dtypes import MODEL_DTYPES
from moerl.dtypes import resolve as resolve_dtype
from moerl.env import child_env, die_with_parent
from moerl.errors import ConfigError
from moerl.orchestrator.config import EngineSection, RunConfig, Scorer, scorers, served_by
from moerl.orchestrator.messages import ManagerSpec, ServedModel
from moerl.orchestrator.model_cache import engine_model
from moerl.orchestrator.placement import Placement
from moerl.orchestrator.preflight import simulation_profile

if TYPE_CHECKING:
    from moerl.engines.pool import EnginePool, EnginePoolConfig
    from moerl.orchestrator.rollouts import RolloutBuffer
    from moerl.trainer.protocol import TrainerLike
    from moerl.weight_sync.base import WeightSync

log = logging.getLogger("moerl.train")


def pool_config(
    e: EngineSection, model_path: str, server: str, log_dir: Path, gpu_offset: int, **more: Any
) -> EnginePoolConfig:
    """What an engine pool of the section ``e`` is started with: its replicas of ``model_path`` served by ``server``,
    from GPU ``gpu_offset`` on (``more``: the policy's own settings)."""
    from moerl.engines.pool import EnginePoolConfig

    return EnginePoolConfig(
        model_path=model_path,
        server=server,
        replicas=e.replicas,
        gpus_per_replica=e.gpus_per_replica,
        base_port=0,
        dtype=resolve_dtype(e.dtype),
        mem_fraction_static=e.mem_fraction_static,
        kv_tokens=e.kv_tokens,
        log_dir=str(log_dir),
        extra_args=list(e.extra_args),
        gpu_offset=gpu_offset,
        **more,
    )


def start_engines(
    cfg: RunConfig, placement: Placement, hf: Path, run_dir: Path, local_trainer_ranks: int, wait: bool = True
) -> tuple[list[str], EnginePool | None]:
    """(URLs, pool or None): the configured engines, health-checked, or ones started here where ``placement`` puts
    them (``wait`` false: launched, for the caller's ``pool.wait_started``)."""
    from moerl.engines.pool import EnginePool
    from moerl.engines.sglang import lora_target_modules

    e = cfg.engines
    if e.urls:  # health-checked by run() before the model was prepared
        return list(e.urls), None
    cuda = torch.cuda.is_available()
    server = served_by(e, cfg.simulation)
    pool = EnginePool(
        pool_config(
            e,
            str(engine_model(cfg, hf)),
            server,
            run_dir / "logs",
            placement.gpu_offset(local_trainer_ranks) if cuda else 0,
            lora_max_rank=cfg.lora.rank if cfg.lora.enabled else None,
            lora_target_modules=lora_target_modules(hf, cfg.lora.targets)
            if cfg.lora.enabled and server == "sglang"
            else None,
            simulate=cfg.simulation.profile,
            time_scale=cfg.simulation.time_scale,
            replicas_per_process=cfg.simulation.replicas_per_process if server == "simulated" else 1,
        )
    )
    if e.server == "auto" and cuda and server == "embedded":
        from moerl.engines.sglang import sglang_problem

        log.warning("engines.server=auto: %s; serving with moerl's embedded engine instead", sglang_problem())
    log.info("starting %d %s engine(s); logs in %s", e.replicas, server, run_dir / "logs")
    if not wait:
        pool.launch()
        return pool.urls, pool
    return pool.start(e.start_timeout_s), pool


@dataclass
class ScorerEngines:
    """A scorer's replicas (the reward model's, the teacher's): its section, its HF directory (for its tokenizer), their
    URLs, and the pool of those the job started (None: given by URL)."""

    scorer: Scorer
    model: Path
    urls: list[str]
    pool: EnginePool | None


@dataclass
class Engines:
    """Where the engines run, and on global rank 0 those it started or was given: the policy's URLs and the pool of
    those the job started, and each scorer's by its section (:func:`start_engines`, :func:`start_scorer_engines`).
    Elsewhere, and on rank 0 before they start, none."""

    placement: Placement
    urls: list[str] = field(default_factory=list)
    pool: EnginePool | None = None
    scorers: dict[str, ScorerEngines] = field(default_factory=dict)

    @property
    def scorer_pools(self) -> dict[str, EnginePool]:
        """The scorers' pools the job started, by section."""
        return {key: s.pool for key, s in self.scorers.items() if s.pool is not None}

    def exited(self) -> list[str]:
        """The replicas of the pools the job started whose servers have exited, each with the end of its log."""
        return [line for pool in (self.pool, *self.scorer_pools.values()) if pool is not None for line in pool.exited()]

    def wait_started(self, cfg: RunConfig) -> None:
        """Until the pools launched answer."""
        if self.pool is not None:
            self.pool.wait_started(cfg.engines.start_timeout_s)
        for served in self.scorers.values():
            if served.pool is not None:
                served.pool.wait_started(served.scorer.engines.start_timeout_s)

    def stop(self) -> None:
        """The pools the job started."""
        for pool in (self.pool, *self.scorer_pools.values()):
            if pool is not None:
                pool.stop()


def start_scorer_engines(
    cfg: RunConfig, placement: Placement, run_dir: Path, local_trainer_ranks: int, wait: bool, engines: Engines
) -> None:
    """Each scorer's replicas (:func:`~moerl.orchestrator.config.scorers`) into ``engines.scorers``: those given by URL,
    or ones started here where ``placement`` puts them (separate: on the GPUs after the trainer's, the policy engines'
    and the scorers' before them; colocated: on the trainer's, keeping their weights in host memory while released).
    Each logs under ``logs/<section>``. ``wait`` false: launched, for the caller's ``wait_started``, on ports other than
    those of the pools launched before (maybe not bound yet)."""
    from moerl.engines.pool import EnginePool
    from moerl.orchestrator.model_cache import prepare_scorer_model

    policy = cfg.engines
    taken = local_trainer_ranks + (0 if policy.urls else policy.replicas * policy.gpus_per_replica)
    for scorer in scorers(cfg):
        model = prepare_scorer_model(cfg, scorer)
        e = scorer.engines
        if not scorer.started:  # health-checked by the preflight
            engines.scorers[scorer.key] = ScorerEngines(scorer, model, list(e.urls), None)
            continue
        server = served_by(e)
        offset = placement.gpu_offset(taken) if torch.cuda.is_available() else 0
        taken += scorer.gpus
        log_dir = run_dir / "logs" / scorer.key
        pool = EnginePool(
            pool_config(e, str(model), server, log_dir, offset, weights_cpu_backup=placement.scorer_weights_on_host)
        )
        log.info("starting %d %s %s engine(s); logs in %s", e.replicas, server, scorer.key, log_dir)
        if wait:
            engines.scorers[scorer.key] = ScorerEngines(scorer, model, pool.start(e.start_timeout_s), pool)
            continue
        before = [p for p in (engines.pool, *engines.scorer_pools.values()) if p is not None]
        pool.launch(avoid=[port for p in before for port in p.ports])
        engines.scorers[scorer.key] = ScorerEngines(scorer, model, pool.urls, pool)


MANAGER_SPEC = "manager_spec.json"


def start_manager(run_dir: Path) -> subprocess.Popen:
    """The rollout manager's process, started before the engines are up: it imports for seconds, meanwhile, then waits
    for its spec in ``run_dir`` (:func:`brief_manager`)."""
    (run_dir / MANAGER_SPEC).unlink(missing_ok=True)  # a resumed run's, of its last start
    # A session of its own: a signal to the job's process group (a launcher stopping it) reaches rank 0, whose teardown
    # stops the manager in order and reads its last events; the manager dies with rank 0 if rank 0 dies first.
    with open(run_dir / "logs" / "rollout_manager.log", "a") as log_file:  # the child keeps its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "moerl.cli.rollout_manager", "--spec", str(run_dir / MANAGER_SPEC)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=child_env(),
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def brief_manager(
    cfg_path: Path,
    hf: Path,
    urls: list[str],
    rollouts: RolloutBuffer,
    cursor: int,
    reissue: list[int],
    run_dir: Path,
    scorer_engines: dict[str, ScorerEngines] | None = None,
) -> None:
    """Write the spec the process of :func:`start_manager` waits for: the engines, once up, and the data position."""
    given = scorer_engines or {}
    ManagerSpec(
        config=str(cfg_path),
        hf_dir=str(hf),
        urls=urls,
        scorers={key: ServedModel(str(s.model), s.urls) for key, s in given.items()},
        orders=rollouts.orders_address,
        events=rollouts.events_address,
        cursor=cursor,
        reissue=reissue,
    ).write(run_dir / MANAGER_SPEC)


def make_trainer(cfg: RunConfig, hf: Path, mcore: str | None) -> TrainerLike:
    """The trainer of the Megatron checkpoint ``mcore``, or in a simulation the simulated one of the model at ``hf``."""
    profile = simulation_profile(cfg)
    if profile is None:
        from moerl.checkpoint.mcore import start_results_queue
        from moerl.trainer.trainer import Trainer

        assert mcore is not None, "prepare_model makes a Megatron checkpoint for every run but a simulation"
        trainer = Trainer(mcore, cfg.trainer, lora=cfg.lora)
        start_results_queue()  # for the checkpoints every run writes: its imports run while the engines start
        return trainer
    from moerl.trainer.simulated import SimulatedTrainer

    s = cfg.simulation
    assert profile.trainer is not None, "simulation_profile refuses a profile without a trainer section"
    return SimulatedTrainer(hf, cfg.trainer, profile.trainer, s.trainer_gpus, s.time_scale, MODEL_DTYPES[profile.dtype])


def full_weight_bytes(trainer: TrainerLike) -> int:
    from moerl.models import family_for

    family = family_for(trainer.hf_config)
    return family.hub_numel(family.normalize(trainer.hf_config)) * trainer.dtype.itemsize


def verify_tolerance(cfg: RunConfig, engine_dtypes: list[str] | None = None) -> float:
    """sync.verify's bound on the mean |log-prob delta| of the probe: tight where engine and reference both compute in
    fp32 (only summation order differs), loose where either rounds to bf16. The reference is the trainer's forward,
    or with FP8 engines an FP8 forward of the pushed tensors in the engines' own dtype
    (:mod:`moerl.weight_sync.fp8_probe`), whatever the trainer's. ``engine_dtypes``: what the engines given by URL
    report they compute in (their configured dtype is not this job's to set; SGLang's "auto" is never fp32)."""
    if cfg.sync.verify_tolerance is not None:
        return cfg.sync.verify_tolerance
    engines = engine_dtypes if engine_dtypes is not None else [resolve_dtype(cfg.engines.dtype)]
    reference_fp32 = cfg.engines.quantization == "fp8" or resolve_dtype(cfg.trainer.dtype) == "float32"
    return 1e-4 if reference_fp32 and all(d == "float32" for d in engines) else 5e-2


def make_sync(
    cfg: RunConfig, strategy: str, urls: list[str] | None, hf: Path, run_dir: Path, hf_config: dict
) -> WeightSync:
    """The weight sync of ``strategy`` (:meth:`Placement.sync_strategy`); ``urls``: the engines, on global rank 0, None
    on the other ranks."""
    from moerl.weight_sync.base import FullWeightSync

    sync = _sync_strategy(cfg, strategy, urls, hf, run_dir, hf_config)
    sync.down_timeout_s = cfg.engines.down_timeout_s
    if isinstance(sync, FullWeightSync):
        sync.quantization, sync.verifying = cfg.engines.quantization, cfg.sync.verify
    return sync


def _sync_strategy(
    cfg: RunConfig, strategy: str, urls: list[str] | None, hf: Path, run_dir: Path, hf_config: dict
) -> WeightSync:
    # Imported here: `moerl engines` builds its pool with this module, on nodes that need no trainer (megatron-core).
    from moerl.weight_sync.broadcast import BroadcastSync
    from moerl.weight_sync.disk import DiskSync
    from moerl.weight_sync.lora import AdapterSync
    from moerl.weight_sync.tensor import TensorSync

    if strategy == "tensor":
        return TensorSync(urls, cfg.sync.bucket_mb << 20, cfg.engines.gpus_per_replica)
    if strategy == "adapters":
        return AdapterSync(
            urls,
            cfg.lora,
            hf_config,
            str(hf.resolve()),
            directory=run_dir / "adapters" if cfg.sync.method == "disk" else None,
        )
    pause = "abort" if cfg.rollout.partial == "retry" else "in_place"
    # Updates that land while requests keep running (async, continued in place) cannot flush the engines'
    # cache: SGLang refuses. Everywhere else nothing runs during an update and the cache is flushed.
    flush = not (cfg.run.mode == "async" and cfg.rollout.partial == "in_place")
    if strategy == "simulated":
        from moerl.weight_sync.simulated import SimulatedSync

        return SimulatedSync(urls, run_dir / "weights", hf, pause=pause, flush_cache=flush)
    if cfg.sync.delta:  # the configuration allows it with separate placement's full weights only
        from moerl.weight_sync.delta import DeltaSync

        return DeltaSync(
            urls, engine_model(cfg, hf) if urls is not None else None, cfg.sync.bucket_mb << 20, pause, flush
        )
    if strategy == "disk":
        return DiskSync(urls, run_dir / "weights", hf, pause=pause, flush_cache=flush)
    return BroadcastSync(
        urls,
        sync_address(cfg),
        "nccl" if torch.cuda.is_available() else "gloo",
        bucket_bytes=cfg.sync.bucket_mb << 20,
        pause=pause,
        flush_cache=flush,
    )


def sync_address(cfg: RunConfig) -> str:
    """Where the engines reach this rank, which hosts its weight group's rendezvous if it sends: ``MOERL_SYNC_ADDRESS``,
    else the address this host routes to the engines from. A loopback address where an engine is on another host would
    leave the first push waiting for engines that never connect: refused. Engines the job starts run beside global rank
    0, on torchrun's first node (its rendezvous host, MASTER_ADDR, seen from the others)."""
    import ipaddress
    import socket
    from urllib.parse import urlsplit

    from moerl.engines.pool import route_address

    if cfg.engines.urls:
        hosts = [urlsplit(url).hostname or "" for url in cfg.engines.urls]
    else:
        hosts = ["127.0.0.1" if os.environ.get("GROUP_RANK", "0") == "0" else os.environ.get("MASTER_ADDR", "")]

    def loopback(host: str) -> bool:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except (OSError, ValueError):
            return False

    given = os.environ.get("MOERL_SYNC_ADDRESS")
    if given:
        try:  # the weight groups' rendezvous listens there: an address of another host would never be served
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind((given, 0))
        except OSError as e:
            raise ConfigError(
                f"MOERL_SYNC_ADDRESS={given} is not an address of this host ({socket.gethostname()}: {e.strerror}): "
                "set it on each trainer node to that node's own address, the one the engines reach it at"
            ) from None
    address = given or route_address(hosts[0]) or "127.0.0.1"
    elsewhere = [host for host in hosts if host and not loopback(host)]
    if elsewhere and loopback(address):
        raise ConfigError(
            f"the weight sync would host its groups at {address}, a loopback address"
            + (" (MOERL_SYNC_ADDRESS)" if given else f" ({socket.gethostname()} resolves to it)")
            + f", which the engines on {', '.join(elsewhere)} cannot reach: set MOERL_SYNC_ADDRESS on each "
            "trainer node to the address the engines reach that node at"
        )
    return address
