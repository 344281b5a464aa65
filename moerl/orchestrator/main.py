"""The main job, one trainer rank (``moerl train``; ``recipes/qwen_moe_grpo.sh`` launches it through torchrun).

Rank 0 prepares the model (the CPU demo's tiny model is made once and cached), starts the engines and
the rollout manager, owns the rollout buffer and pushes weights; every rank trains. Per step: the
step's groups come from the buffer (``sync``: all at once after generation; ``periodic``: each piece
as it finishes, all from the current policy; ``async``: from a buffer the engines keep filling, stale
groups dropped), one optimizer step, then a weight sync while the engines are paused.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moerl.dtypes import MODEL_DTYPES, resolve as resolve_dtype
from moerl.engines.health import State
from moerl.env import child_env, die_with_parent
from moerl.files import staged_dir
from moerl.errors import ConfigError, EnginesDown, MoerlError, relayed
from moerl.megatron.parallel import init_process_group, on_lead
from moerl.orchestrator.buffer import Accounting, RolloutBuffer, rollout_metrics
from moerl.orchestrator.config import RunConfig, load_config, served_by, sglang_lora_problem, to_yaml
from moerl.orchestrator.messages import ManagerSpec
from moerl.orchestrator.metrics import MetricsWriter
from moerl.trainer.distribute import Interlude
from moerl.trainer.trainer import Trainer
from moerl.weight_sync.base import WeightSync
from moerl.weight_sync.broadcast import BroadcastSync
from moerl.weight_sync.disk import DiskSync
from moerl.weight_sync.lora import AdapterSync

log = logging.getLogger("moerl.train")
RUN_STATE = "run_state.json"
TINY_MODEL = "tiny-qwen3-moe-addition-v1"


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(
        prog="moerl train",
        description="GRPO on a Qwen MoE model: Megatron trainer + SGLang (or embedded) engines, with routing and sampling-mask "
        "replay, in sync, periodic or async mode. Run through recipes/qwen_moe_grpo.sh (torchrun).",
        epilog="Overrides are omegaconf dotlist entries, e.g. run.mode=sync run.steps=20 trainer.ep=2 model.path=/models/Qwen3-30B-A3B",
    )
    p.add_argument("--config", help="YAML config (default: none; the schema's defaults)")
    p.add_argument("--check", action="store_true",
                   help="check the config, model, task and engine URLs as the job would, print the number of trainer ranks it needs, and exit")
    p.add_argument("--show-config", action="store_true", help="print the whole resolved config (every key, with overrides) and exit")
    p.add_argument("--show-plan", action="store_true",
                   help="print the memory plan (per trainer rank and engine GPU, from the model's config.json alone) and exit")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    return p.parse_intermixed_args(argv)  # flags and overrides in any order


def trainer_world_size(cfg: RunConfig) -> int:
    if cfg.simulation.profile is not None:
        return 1  # one process stands for the simulated trainer
    t = cfg.trainer
    return cfg.run.trainer_ranks or t.tp * t.pp * t.ep


def check_layout(cfg: RunConfig, world: int) -> None:
    from moerl.layout import Layout, LayoutError

    if cfg.simulation.profile is not None:
        if world != 1:
            raise ConfigError(f"simulation.profile: a simulated trainer runs as one process, not {world} (launch the recipe, which starts one)")
        return
    try:
        Layout(tp=cfg.trainer.tp, pp=cfg.trainer.pp, ep=cfg.trainer.ep).check_world(world)
    except LayoutError as e:
        raise ConfigError(f"trainer layout (tp={cfg.trainer.tp}, pp={cfg.trainer.pp}, ep={cfg.trainer.ep}) on {world} rank(s): {e}") from None


# ---- model preparation (rank 0, before the process group) --------------------------------------
def _done(path: Path) -> bool:
    return (path / ".complete").is_file()


def _build_once(target: Path, build) -> Path:
    """``build(staging)`` into a staging directory renamed to ``target``: a crash never leaves a half model."""
    if _done(target):
        return target
    with staged_dir(target) as staging:
        build(staging)
        (staging / ".complete").write_text("")
    return target


def check_model(cfg: RunConfig, hf: Path, converting: bool) -> None:
    """The model at ``hf`` can be trained at the configured layout (and, when it is to be converted, its
    tensors are all there with the right shapes): one error line before minutes of preparation."""
    from moerl.checkpoint.hf import HFReader, check_hf_tensors, read_config
    from moerl.layout import Layout
    from moerl.models import family_for

    raw = read_config(hf)
    family = family_for(raw)
    model = family.normalize(raw)
    family.check(model)
    family.check_layout(model, Layout(tp=cfg.trainer.tp, pp=cfg.trainer.pp, ep=cfg.trainer.ep))
    if converting:
        check_hf_tensors(HFReader(hf), family, model)


def preflight(cfg: RunConfig, world: int) -> None:
    """Everything that can be checked before the ranks start (the recipe runs it before torchrun): the
    layout, the run directory, the engines given by URL, the task and the model's config and tensors."""
    check_layout(cfg, world)
    run_dir = Path(cfg.run.dir)
    if (run_dir / "metrics.jsonl").exists() and cfg.run.resume == "false":
        raise ConfigError(f"run.dir={run_dir} already holds a run: pass run.resume=true to continue it, or choose another run.dir")
    if cfg.run.resume == "true" and latest_checkpoint(run_dir) is None:
        raise ConfigError(f"run.resume=true: {run_dir / 'checkpoints'} holds no checkpoint to continue from "
                          "(run.resume=auto starts the run where there is none)")
    if cfg.engines.urls:
        check_engine_urls(cfg.engines.urls, simulated=cfg.simulation.profile is not None, sglang_refused=sglang_lora_problem(cfg))
    elif cfg.engines.server == "sglang":
        from moerl.engines.sglang import sglang_problem

        if problem := sglang_problem():
            raise ConfigError(f"engines.server=sglang: {problem}; or set engines.server=embedded")
    check_task(cfg)
    profile = simulation_profile(cfg)
    if (model_path := model_dir(cfg, profile)) is not None:
        hf = Path(model_path)
        if not (hf / "config.json").is_file():
            raise ConfigError(f"model.path={hf} is not a HF model directory (no config.json)")
        check_model(cfg, hf, converting=profile is None and not cfg.model.mcore)
    if profile is None:  # a simulation's trainer holds no memory to plan
        print(memory_plan(cfg, world, checked=True).table(), file=sys.stderr)


def simulation_profile(cfg: RunConfig):
    """The :class:`~moerl.simulation.Profile` of a simulation (one that times a trainer too), None for a real run."""
    from moerl.simulation import Profile

    if cfg.simulation.profile is None:
        return None
    profile = Profile.load(cfg.simulation.profile)
    if profile.trainer is None:
        raise ConfigError(f"simulation.profile={cfg.simulation.profile} has no trainer section: the job's simulation needs its "
                          "trainer's rate (tokens_per_s_per_gpu, optimizer_step_s)")
    return profile


def model_dir(cfg: RunConfig, profile) -> str | None:
    """The HF directory given for the run (a simulation's profile may name one), None for the CPU demo's tiny model."""
    return cfg.model.path or (profile.model if profile is not None else None)


def memory_plan(cfg: RunConfig, world: int, checked: bool):
    """The memory plan (:mod:`moerl.orchestrator.memory`) of the configured model on ``world`` trainer ranks;
    ``checked``: a plan that does not fit raises :class:`ConfigError`."""
    from moerl.checkpoint.hf import read_config
    from moerl.orchestrator import memory

    if cfg.model.path is None:
        from moerl.models.tiny import TINY_QWEN3

        model_config = dict(TINY_QWEN3, architectures=["Qwen3MoeForCausalLM"])
    else:
        model_config = read_config(cfg.model.path)
    return (memory.check if checked else memory.plan_for)(cfg, model_config, world)


def check_task(cfg: RunConfig) -> None:
    """The prompts load and the reward function resolves, before the rollout manager needs them."""
    from moerl.tasks import load_records
    from moerl.tasks.rewards import Rewarder

    load_records(cfg.task)
    Rewarder(cfg.task)


def prepare_model(cfg: RunConfig) -> tuple[Path, Path | None]:
    """(HF directory, Megatron checkpoint) of the model to train, made once and cached; a simulation has no checkpoint."""
    cache = Path(cfg.run.cache_dir).expanduser()
    profile = simulation_profile(cfg)
    if model_dir(cfg, profile) is None:
        from moerl.tasks.tiny import save_warm_tiny_model

        def build(staging: Path) -> None:
            log.info("creating the tiny demo model (once) in %s", cache / TINY_MODEL)
            save_warm_tiny_model(staging / "model")  # a subdirectory: the build marker stays out of the HF directory

        hf = _build_once(cache / TINY_MODEL / "hf", build) / "model"
    else:
        hf = Path(model_dir(cfg, profile))
    if profile is not None:
        return hf, None
    if cfg.model.mcore:
        mcore = Path(cfg.model.mcore)
        if not mcore.is_dir():
            raise ConfigError(f"model.mcore={mcore} does not exist; leave it null to convert model.path once into run.cache_dir")
        return hf, mcore
    fingerprint = hashlib.sha1(str(hf.resolve()).encode() + (hf / "config.json").read_bytes()).hexdigest()[:12]
    for f in sorted(hf.glob("*.safetensors")):
        fingerprint = hashlib.sha1((fingerprint + f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}").encode()).hexdigest()[:12]

    def convert(staging: Path) -> None:
        log.info("converting %s to the Megatron layout (tools/convert_ckpt.py hf-to-mcore)", hf)
        subprocess.run([sys.executable, "-m", "moerl.checkpoint.cli", "hf-to-mcore", "--hf", str(hf), "--out", str(staging / "ckpt")],
                       check=True, env=child_env(), preexec_fn=die_with_parent)

    return hf, _build_once(cache / "mcore" / fingerprint, convert) / "ckpt"


# ---- engines -------------------------------------------------------------------------------
def start_engines(cfg: RunConfig, hf: Path, run_dir: Path, local_trainer_ranks: int):
    """(URLs, pool or None): the configured engines, health-checked, or ones started here."""
    from moerl.engines.sglang import SGLangConfig, SGLangPool, lora_target_modules

    e = cfg.engines
    if e.urls:  # health-checked by run() before the model was prepared
        return list(e.urls), None
    cuda = torch.cuda.is_available()
    server = served_by(e, cfg.simulation)
    pool = SGLangPool(SGLangConfig(
        model_path=str(hf), server=server, replicas=e.replicas, gpus_per_replica=e.gpus_per_replica, base_port=0,
        dtype=resolve_dtype(e.dtype), mem_fraction_static=e.mem_fraction_static, log_dir=str(run_dir / "logs"), extra_args=list(e.extra_args),
        gpu_offset=local_trainer_ranks if cuda else 0, lora_max_rank=cfg.lora.rank if cfg.lora.enabled else None,
        lora_target_modules=lora_target_modules(hf, cfg.lora.targets) if cfg.lora.enabled and server == "sglang" else None,
        simulate=cfg.simulation.profile, time_scale=cfg.simulation.time_scale,
        replicas_per_process=cfg.simulation.replicas_per_process if server == "simulated" else 1,
    ))
    if e.server == "auto" and cuda and server == "embedded":
        from moerl.engines.sglang import sglang_problem

        log.warning("engines.server=auto: %s; serving with moerl's embedded engine instead", sglang_problem())
    log.info("starting %d %s engine(s); logs in %s", e.replicas, server, run_dir / "logs")
    return pool.start(e.start_timeout_s), pool


def check_engine_urls(urls: list[str], simulated: bool = False, sglang_refused: str | None = None) -> None:
    """Every engine answers, those that are SGLang servers run a release whose API moerl speaks (and none is, with
    ``sglang_refused``: why this run cannot use one), and they are simulated engines exactly when the run is a
    simulation (a simulation's hollow checkpoints would load as zeros into a real engine; a simulated one answers a real
    run with random tokens). The config's own check cannot see that an engine given by URL is SGLang."""
    from moerl.engines.client import EngineClient
    from moerl.engines.sglang import sglang_problem

    async def health():
        async with EngineClient(urls, retries=0) as client:
            up = await client.healthy()
            return up, (await client.server_info() if all(up) else [])

    up, infos = asyncio.run(health())
    down = [u for u, ok in zip(urls, up) if not ok]
    if down:
        raise ConfigError(f"engines.urls: {', '.join(down)} unreachable (no 200 from /health); start the engines or fix the URLs")
    for url, info in zip(urls, infos):
        engine = str(info.get("engine"))
        if (engine == "moerl-simulated") != simulated:
            raise ConfigError(f"engines.urls: {url} is {'a' if engine == 'moerl-simulated' else 'not a'} simulated engine and this run "
                              f"{'is' if simulated else 'is not'} a simulation (simulation.profile)")
        if engine.startswith("moerl-"):
            continue
        if problem := sglang_problem(str(info.get("version"))):
            raise ConfigError(f"engines.urls: {url} runs {problem}")
        if sglang_refused:
            raise ConfigError(f"engines.urls: {url} is an SGLang server, and {sglang_refused}")


def start_manager(cfg_path: Path, hf: Path, urls: list[str], buffer, cursor: int, reissue: list[int], run_dir: Path) -> subprocess.Popen:
    spec = ManagerSpec(config=str(cfg_path), hf_dir=str(hf), urls=urls, orders=buffer.orders_address, events=buffer.events_address,
                       cursor=cursor, reissue=reissue).write(run_dir / "manager_spec.json")
    log_file = open(run_dir / "logs" / "rollout_manager.log", "a")
    # A session of its own: a signal to the job's process group (a launcher stopping it) reaches rank 0, whose teardown
    # stops the manager in order and reads its last events; the manager dies with rank 0 if rank 0 dies first.
    return subprocess.Popen([sys.executable, "-m", "moerl.orchestrator.manager", "--spec", str(spec)], stdout=log_file,
                            stderr=subprocess.STDOUT, env=child_env(), start_new_session=True, preexec_fn=die_with_parent)


# ---- checkpoints ---------------------------------------------------------------------------
def latest_checkpoint(run_dir: Path) -> Path | None:
    done = [d for d in (run_dir / "checkpoints").glob("step_*") if (d / RUN_STATE).is_file()]
    return max(done, key=lambda d: int(d.name.split("_")[1])) if done else None


# What every rank stops to do between two pieces of a step (Interlude kinds).
CATCH_UP = 1  # no replica serves and one came back: push it the current policy, so the step can get its groups
STOP = 2  # no replica served for engines.down_timeout_s, or the rollout manager is gone: write a checkpoint, then stop with that error


class Job:
    """The main job on one trainer rank. Every rank trains and takes part in each weight sync; global rank 0 also
    prepares the model, runs the engines, the rollout manager and the rollout buffer, and writes the metrics."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.run_dir = Path(cfg.run.dir)
        self.lead = self.rank == 0
        self.pool = self.sync = self.manager = self.buffer = self.writer = self.bar = self.zmq = self.cpu = None
        self.urls: list[str] | None = None  # rank 0: the engines'
        self.caught_up: set[str] = set()  # rank 0: replicas a catch-up sync already went to, at the current version
        self.back: list[str] = []  # rank 0: the replicas the next catch-up sync goes to
        self.catch_ups = 0  # rank 0: catch-up syncs in the current step

    def run(self) -> dict | None:
        """The whole job; rank 0 returns the final accounting."""
        resumed = self.setup()
        try:
            self.start_rollouts()
            # Engines given by URL may hold another run's weights: they get this run's before the first rollout.
            self.sync.start(self.trainer, engines_hold_it=not resumed and not self.cfg.engines.urls)
            self.serve_policy()
            self.verify()
            if self.lead and self.cfg.run.mode == "async":
                self.buffer.order(self.cfg.rollout.outstanding)  # a resumed run's pending prompts are re-issued first
            while self.trainer.version < self.cfg.run.steps:
                self.step()
        except Exception as e:
            # One rank's failure makes torchrun stop the others, maybe this one in its teardown: said now, not after it.
            if isinstance(e, MoerlError):
                if not getattr(e, "relayed", False):
                    print(f"error: {e}", file=sys.stderr, flush=True)
                e.said = True
            else:
                log.error("stopping at step %d: %s: %s", self.trainer.version, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            raise
        finally:
            summary = self.teardown()
        return summary

    # ---- phases --------------------------------------------------------------------------------
    def setup(self) -> bool:
        """Checks, the model, the process group (the one place it is made) and the trainer, resumed where there is a
        checkpoint; whether it was."""
        cfg = self.cfg
        check_layout(cfg, self.world)
        # Generation in sync mode can outlast any default collective timeout.
        init_process_group(timeout_s=6 * 3600)

        def prepare() -> list[str | None]:
            preflight(cfg, self.world)  # before minutes of model preparation (again: torchrun may have started this rank directly)
            (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
            return [str(p) if p is not None else None for p in prepare_model(cfg)]

        box = [on_lead(prepare, "checking the run and preparing the model")]
        dist.broadcast_object_list(box, src=0)
        self.hf, mcore = Path(box[0][0]), box[0][1]
        self.trainer = make_trainer(cfg, self.hf, mcore)
        self.full_bytes = full_weight_bytes(self.trainer)  # what a full-weight sync moves, beside what each sync moved
        self.tolerance = verify_tolerance(cfg)
        resume_from = latest_checkpoint(self.run_dir) if cfg.run.resume != "false" else None
        self.state = {"cursor": 0, "pending": [], "accounting": {}}
        if resume_from is not None:
            self.trainer.load(resume_from)
            self.state = json.loads((resume_from / RUN_STATE).read_text())
        return resume_from is not None

    def start_rollouts(self) -> None:
        """The engines and the weight sync to them; on rank 0 the rollout buffer, the manager and the metrics."""
        cfg = self.cfg

        def engines() -> list[str]:
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
            urls, self.pool = start_engines(cfg, self.hf, self.run_dir, int(os.environ.get("LOCAL_WORLD_SIZE", self.world)))
            return urls

        self.urls = on_lead(engines, "starting the engines")
        self.sync = make_sync(cfg, self.urls, self.hf, self.run_dir, self.trainer.hf_config)
        self.sync.connect()
        on_lead(self.start_buffer, "starting the rollout buffer and the rollout manager")

    def start_buffer(self) -> None:
        """Rank 0: the rollout buffer, the manager feeding it, the metrics and the progress bar."""
        import zmq
        from tqdm import tqdm

        cfg, state = self.cfg, self.state
        if cfg.engines.urls:  # verify compares on rank 0, at the precision the engines report
            self.tolerance = verify_tolerance(cfg, [str(info.get("dtype", "auto")) for info in self.sync.link.run(self.sync.link.client.server_info())])
        acct = Accounting(issued=state["accounting"].get("issued", 0), trained=state["accounting"].get("trained", 0))
        acct.dropped.update(state["accounting"].get("dropped", {}))
        for index in state["pending"]:
            acct.set(index, "in_flight")
        self.zmq = zmq.Context()
        self.buffer = RolloutBuffer(self.zmq, cfg.rollout, cfg.run.mode, acct, cursor=state["cursor"])
        self.manager = start_manager(self.run_dir / "config.yaml", self.hf, self.urls, self.buffer, state["cursor"], state["pending"], self.run_dir)
        self.buffer.watch(self.manager, self.run_dir / "logs" / "rollout_manager.log")
        self.cpu = CpuMeter(self.manager.pid, self.buffer)
        if self.pool is not None:
            self.sync.while_down = self.revive
            self.sync.restart_engines = self.restart_wedged
        self.writer = MetricsWriter(self.run_dir, resume_after=self.trainer.version if cfg.run.resume != "false" else None)
        if cfg.run.progress:
            self.bar = tqdm(total=cfg.run.steps, initial=self.trainer.version, desc=f"GRPO {cfg.run.mode}", unit="step", dynamic_ncols=True)

    def step(self) -> None:
        """Take the step's groups, train on them, bring the engines to the new policy, record, maybe save."""
        cfg, trainer = self.cfg, self.trainer
        start = time.perf_counter()
        waited = self.buffer.waited_s if self.lead else 0.0
        if self.lead:
            self.cpu.start_step()
        taken = []

        # What the last update reached holds this version; the manager's view of it may lag by a probe.
        self.caught_up, self.catch_ups = set(self.sync.link.client.targets) if self.lead else set(), 0

        def pieces():
            try:
                for piece in self.buffer.pieces(trainer.version, cfg.rollout.groups_per_step, whole=cfg.run.mode == "sync",
                                                waiting=self.while_waiting):
                    if isinstance(piece, Interlude):
                        yield piece
                        continue
                    piece = sorted(piece, key=lambda g: g.index)  # deterministic order within what has arrived
                    taken.extend(piece)
                    yield [s for g in piece for s in g.samples]
            except MoerlError:  # the buffer keeps it (stop_error) for the stop
                yield Interlude(STOP)

        metrics = trainer.step(pieces() if self.lead else None, self.interlude)  # rank 0 sends each rank its part
        trained_at = time.perf_counter()

        def before_the_sync() -> None:
            if self.pool is not None:
                self.revive()  # the sync reaches those that answer by then
            self.buffer.drain()  # what replicas lost until now, the sync gives them (those it misses are stale after it)
            self.buffer.take_left()
            self.buffer.updating()

        on_lead(before_the_sync, "taking in the rollouts after the step")
        try:
            stats = self.sync.update(trainer)
            self.serve_policy()
            end = time.perf_counter()
            metrics.update(self.verify())
        except EnginesDown as e:
            if self.lead:
                self.buffer.trained(taken)  # in the step just made: not to be re-issued on resume
            self.stop_with_checkpoint(e)
        on_lead(lambda: self.record(metrics, taken, stats, start, trained_at, end, waited), "recording the step's metrics")
        if trainer.version == cfg.run.steps or (cfg.run.save_every and trainer.version % cfg.run.save_every == 0):
            save_checkpoint(trainer, self.buffer, self.run_dir)

    def revive(self) -> None:
        """Rank 0: the replicas whose process died are started again (stale until a sync reaches them, outside the
        broadcast's groups until it forms them again)."""
        e = self.cfg.engines
        restarted = self.pool.revive(e.max_restarts, e.restart_window_s)
        self.sync.may_be_new |= set(restarted)
        self.buffer.restarting(restarted)

    def restart(self, urls: list[str]) -> list[str]:
        """Rank 0: of these replicas, which the weight sync cannot use as they are (waiting in a failed broadcast for good,
        or holding all the weight groups they may), those the job started are killed and started again (now, or by a
        later revive once their processes have ended); those."""
        killed = self.pool.kill(urls)
        self.revive()
        return killed

    def while_waiting(self) -> Interlude | None:
        """Rank 0, while the step waits for groups: replicas that died are started again; when none serves and one is
        back (stale: it holds what it started from), every rank stops to bring it to the current policy."""
        if self.pool is not None:
            self.revive()
        states = self.buffer.engines
        self.caught_up -= self.buffer.take_left()  # lost it since (restarted, or found without it by a request)
        back = sorted(url for url, state in states.items() if state == State.STALE.value and url not in self.caught_up)
        if back and State.HEALTHY.value not in states.values():
            self.caught_up.update(back)
            self.back = back
            return Interlude(CATCH_UP)
        return None

    def interlude(self, kind: int) -> None:
        """Collective, between two pieces of a step; the weights are still the last update's."""
        if kind == STOP:
            self.stop_with_checkpoint(self.buffer.stop_error if self.lead else None)
        try:
            stats = self.sync.update(self.trainer, only=self.back if self.lead else None)
            if not self.sync.reached:  # gone again before the sync: the wait goes on, and it is caught up when it is back
                self.caught_up -= set(self.back)
                return
            if self.lead:
                log.info("catch-up sync of version %d to %s in %.2f s", self.trainer.version, ", ".join(self.sync.link.client.targets), stats.seconds)
                self.catch_ups += 1
            self.serve_policy(catch_up=True)
            self.verify(catch_up=True)  # with sync.verify: what came back serves the policy before it takes a request
            if self.lead:  # those it missed, or that went before the verify: caught up once back
                self.caught_up -= set(self.back) - set(self.sync.link.client.targets)
        except EnginesDown as e:
            self.stop_with_checkpoint(e)

    def stop_with_checkpoint(self, error: MoerlError | None) -> None:
        """Collective: the run's checkpoint (every prompt not yet trained pending, to be issued again), then ``error``
        (global rank 0's; the other ranks say rank 0 stopped the run)."""
        if self.lead:
            self.buffer.halt()  # the other prompts waiting for an engine fail too, while the checkpoint is written
        save_checkpoint(self.trainer, self.buffer, self.run_dir)
        where = f"checkpoint {self.run_dir / 'checkpoints' / f'step_{self.trainer.version}'} written; run.resume=true continues from it"
        if error is None:
            raise relayed(MoerlError(f"global rank 0 stopped the run (its error says why); {where}"))
        stopped = type(error)(f"{error}; {where}")
        stopped.relayed = getattr(error, "relayed", False)
        raise stopped

    def serve_policy(self, catch_up: bool = False) -> None:
        """New requests name the adapter the last sync loaded (LoRA runs; full-weight syncs change the weights themselves),
        and a replica out of rotation comes back once it reports the weight version the others now serve. A catch-up of
        full weights leaves the policy the others hold: they stay in rotation (a LoRA catch-up's adapter is new)."""
        if not self.lead:
            return
        weight_version, adapter = self.sync.served(self.trainer.version)
        self.buffer.served(weight_version, self.sync.link.client.targets, adapter, self.trainer.version,
                           also=catch_up and adapter is None)

    def verify(self, catch_up: bool = False) -> dict[str, float]:
        """With sync.verify, every engine the sync reached serves the trainer's policy (after the engines resumed). One
        that went since the sync is out of rotation until it is back."""
        if not self.cfg.sync.verify:
            return {}
        reached = list(self.sync.link.client.targets) if self.lead else None
        worst = self.sync.verify(self.trainer, self.tolerance)
        if self.lead and self.sync.link.client.targets != reached:
            self.serve_policy(catch_up)
        return worst

    def record(self, metrics: dict, taken: list, stats, start: float, trained_at: float, end: float, waited: float) -> None:
        buffer = self.buffer
        buffer.trained(taken)
        buffer.drain()
        metrics.update(rollout_metrics(taken))
        metrics.update(buffer.acct.counts())
        reissues = buffer.take_reissues()
        metrics.update({
            "step": self.trainer.version, "mode": self.cfg.run.mode, "sync/seconds": stats.seconds, "sync/pause_seconds": stats.pause_seconds,
            "sync/bytes": stats.bytes, "sync/buckets": stats.buckets, "sync/full_weight_bytes": self.full_bytes, "time/step_seconds": end - start,
            "time/train_seconds": trained_at - start, "time/trainer_idle_fraction": (buffer.waited_s - waited) / (end - start),
            "rollout/retries": float(sum(g.retries for g in taken)), "throughput/samples_per_second": metrics["rollout/samples"] / (end - start),
            "rollout/retries_engine_failure": float(reissues["engine_failure"]), "rollout/retries_worker_lost": float(reissues["worker_lost"]),
            "rollout/retries_stale_prefix": float(reissues["stale_prefix"]),
            "sync/catch_ups": float(self.catch_ups),
            "prompts/dropped_engine_failure": float(buffer.acct.dropped["engine_failure"]),
        })
        states = list(buffer.engines.values())
        metrics.update({f"engines/{state.value}": float(states.count(state.value)) for state in State})
        metrics["engines/restarts"] = float(sum(self.pool.restarts.values())) if self.pool is not None else 0.0
        metrics.update(self.cpu.step_metrics(end - start))
        self.writer.write(metrics)
        if self.bar is not None:
            self.bar.update(1)
            down = len(states) - states.count(State.HEALTHY.value)
            self.bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}", agree=f"{metrics.get('routing/agreement', float('nan')):.3f}",
                                 stale=int(metrics["staleness/max"]), **({"engines_down": down} if down else {}))

    def teardown(self) -> dict | None:
        """Stop the manager (every live prompt accounted for), close the sync and the metrics, stop the engines."""
        summary = None
        if self.buffer is not None:
            self.buffer.stop()
            summary = {**self.buffer.acct.state(), "balanced": self.buffer.acct.balanced(), "live": len(self.buffer.acct.live)}
            (self.run_dir / "accounting.json").write_text(json.dumps(summary, indent=1))
            self.buffer.close()
        if self.manager is not None:
            try:
                self.manager.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.manager.kill()
        for closeable in (self.sync, self.writer, self.bar):
            if closeable is not None:
                closeable.close()
        if self.pool is not None:
            self.pool.stop()
        if self.zmq is not None:
            self.zmq.term()
        return summary


class CpuMeter:
    """The orchestrator's own CPU cost per step, never scaled in a simulation: the rollout manager process's (the engine
    client, rewards, and the completions its generation workers hand it), its helper processes' (the generation
    workers: engine requests and decoding), and rank 0's rollout buffer's (taking in the finished groups). The manager's own is the figure that must
    stay well below the step: it is one process."""

    def __init__(self, manager_pid: int, buffer: RolloutBuffer):
        import psutil

        self.manager, self.buffer = psutil.Process(manager_pid), buffer
        self.helpers: dict[int, float] = {}  # each helper's CPU when last seen: one that ended keeps its last reading
        self.manager_s = self.helpers_s = self.buffer_s = 0.0

    def _manager_total(self) -> float:
        import psutil

        try:
            t = self.manager.cpu_times()
        except psutil.Error:  # it stopped: its time so far is all there is
            return self.manager_s
        return t.user + t.system

    def _helpers_total(self) -> float:
        import psutil

        try:
            helpers = self.manager.children(recursive=True)
        except psutil.Error:
            helpers = []
        for p in helpers:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            self.helpers[p.pid] = t.user + t.system
        return sum(self.helpers.values())

    def start_step(self) -> None:
        self.manager_s, self.helpers_s, self.buffer_s = self._manager_total(), self._helpers_total(), self.buffer.cpu_s

    def step_metrics(self, wall_s: float) -> dict[str, float]:
        manager = self._manager_total() - self.manager_s
        return {"cpu/manager_seconds": manager, "cpu/manager_fraction": manager / wall_s,
                "cpu/manager_helpers_seconds": self._helpers_total() - self.helpers_s, "cpu/buffer_seconds": self.buffer.cpu_s - self.buffer_s}


def verify_tolerance(cfg: RunConfig, engine_dtypes: list[str] | None = None) -> float:
    """sync.verify's bound on the mean |log-prob delta| of the probe: tight where engine and trainer both
    compute in fp32 (only summation order differs), loose where either rounds to bf16. ``engine_dtypes``: what the
    engines given by URL report they compute in (their configured dtype is not this job's to set; SGLang's "auto" is
    never fp32)."""
    if cfg.sync.verify_tolerance is not None:
        return cfg.sync.verify_tolerance
    engines = engine_dtypes if engine_dtypes is not None else [resolve_dtype(cfg.engines.dtype)]
    return 1e-4 if resolve_dtype(cfg.trainer.dtype) == "float32" and all(d == "float32" for d in engines) else 5e-2


def make_trainer(cfg: RunConfig, hf: Path, mcore: str | None):
    """The trainer of the Megatron checkpoint ``mcore``, or in a simulation the simulated one of the model at ``hf``."""
    profile = simulation_profile(cfg)
    if profile is None:
        return Trainer(mcore, cfg.trainer, lora=cfg.lora)
    from moerl.trainer.simulated import SimulatedTrainer

    s = cfg.simulation
    return SimulatedTrainer(hf, cfg.trainer, profile.trainer, s.trainer_gpus, s.time_scale, MODEL_DTYPES[profile.dtype])


def full_weight_bytes(trainer) -> int:
    from moerl.models import family_for

    family = family_for(trainer.hf_config)
    return family.hub_numel(family.normalize(trainer.hf_config)) * trainer.dtype.itemsize


def make_sync(cfg: RunConfig, urls: list[str] | None, hf: Path, run_dir: Path, hf_config: dict) -> WeightSync:
    """The configured weight-sync strategy; ``urls``: the engines, on global rank 0, None on the other ranks."""
    sync = _sync_strategy(cfg, urls, hf, run_dir, hf_config)
    sync.down_timeout_s = cfg.engines.down_timeout_s
    return sync


def _sync_strategy(cfg: RunConfig, urls: list[str] | None, hf: Path, run_dir: Path, hf_config: dict) -> WeightSync:
    if cfg.lora.enabled:
        return AdapterSync(urls, cfg.lora, hf_config, str(hf.resolve()), directory=run_dir / "adapters" if cfg.sync.method == "disk" else None)
    pause = "abort" if cfg.rollout.partial == "retry" else "in_place"
    # Updates that land while requests keep running (async, continued in place) cannot flush the engines'
    # cache: SGLang refuses. Everywhere else nothing runs during an update and the cache is flushed.
    flush = not (cfg.run.mode == "async" and cfg.rollout.partial == "in_place")
    if cfg.simulation.profile is not None:
        from moerl.weight_sync.simulated import SimulatedSync

        return SimulatedSync(urls, run_dir / "weights", hf, pause=pause, flush_cache=flush)
    if cfg.sync.method == "disk":
        return DiskSync(urls, run_dir / "weights", hf, pause=pause, flush_cache=flush)
    return BroadcastSync(urls, sync_address(cfg), "nccl" if torch.cuda.is_available() else "gloo",
                         bucket_bytes=cfg.sync.bucket_mb << 20, pause=pause, flush_cache=flush)


def sync_address(cfg: RunConfig) -> str:
    """Where the engines reach this rank, which hosts its weight group's rendezvous if it sends: ``MOERL_SYNC_ADDRESS``,
    else the address this host routes to the engines from. A loopback address where an engine is on another host would
    leave the first push waiting for engines that never connect: refused. Engines the job starts run beside global rank
    0, on torchrun's first node (its rendezvous host, MASTER_ADDR, seen from the others)."""
    import ipaddress
    import socket
    from urllib.parse import urlsplit

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
    address = given or _route_from(hosts[0])
    elsewhere = [host for host in hosts if host and not loopback(host)]
    if elsewhere and loopback(address):
        raise ConfigError(f"the weight sync would host its groups at {address}, a loopback address" +
                          (" (MOERL_SYNC_ADDRESS)" if given else f" ({socket.gethostname()} resolves to it)") +
                          f", which the engines on {', '.join(elsewhere)} cannot reach: set MOERL_SYNC_ADDRESS on each "
                          "trainer node to the address the engines reach that node at")
    return address


def _route_from(host: str) -> str:
    """This host's address on the route to ``host`` (no packet is sent), else the one its hostname resolves to."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def save_checkpoint(trainer, buffer, run_dir: Path) -> None:
    """The trainer (collective) and, from rank 0, the data position and every live prompt to re-issue."""
    out = run_dir / "checkpoints" / f"step_{trainer.version}"
    complete = (out / RUN_STATE).is_file()  # the same version saved already (a stop in the step after it): its state is new
    if not complete:
        # A previous attempt at this step that never finished.
        on_lead(lambda: shutil.rmtree(out) if out.exists() else None, f"removing the unfinished checkpoint {out}")
        trainer.save(out)

    def run_state() -> None:
        buffer.drain()
        state = {"step": trainer.version, "cursor": buffer.cursor, "pending": buffer.pending(), "accounting": buffer.acct.state()}
        partial = out / f".{RUN_STATE}.partial"
        partial.write_text(json.dumps(state, indent=1))
        partial.replace(out / RUN_STATE)  # whole or not at all: it marks the checkpoint complete

    on_lead(run_state, f"writing the run state of checkpoint {out}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its per-bucket parameter listings drown the run's own lines
    try:
        cfg = load_config(args.config, args.overrides)
    except MoerlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.show_config:
        print(to_yaml(cfg), end="")
        return 0
    try:
        if args.check:  # the recipe's single-node launch: torchrun will start this many ranks here
            world = trainer_world_size(cfg)
            if torch.cuda.is_available() and world > torch.cuda.device_count():
                raise ConfigError(f"the trainer needs {world} GPUs and this node has {torch.cuda.device_count()}: launch it across "
                                  "nodes with torchrun --nnodes N ... --no-python recipes/qwen_moe_grpo.sh (see recipes/qwen3_30b_a3b.yaml)")
            preflight(cfg, world)
            print(world)
            return 0
        if args.show_plan:
            plan = memory_plan(cfg, int(os.environ.get("WORLD_SIZE", trainer_world_size(cfg))), checked=False)
            print(plan.table())
            for problem in plan.problems:
                print(f"error: memory plan: {problem}", file=sys.stderr)
            return 2 if plan.problems else 0
        # torchrun stops the other ranks with SIGTERM when one fails: the job's teardown still runs (engines and
        # rollout manager stopped, accounting written).
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        summary = Job(cfg).run()
    except MoerlError as e:
        if not (getattr(e, "relayed", False) or getattr(e, "said", False)):
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if summary is not None:
        print(f"done: {cfg.run.dir} (metrics.jsonl, tensorboard/, accounting.json; plot with: moerl plot {cfg.run.dir})")
    return 0


def _exit_on_sigterm(signum, frame) -> None:
    # Once: a second SIGTERM (torchrun's, then the rank's own once torchrun is gone) would cut the teardown short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    raise SystemExit(main())
