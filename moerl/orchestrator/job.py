"""The main job on one trainer rank, as named phases (:class:`Job`): set up, start the rollouts, then steps until the
last, then the teardown. Rank 0 prepares the model (the CPU demo's tiny model is made once and cached), starts the
engines and the rollout manager, owns the rollout buffer and pushes weights; every rank trains. Per step: the step's
groups come from the buffer (``sync``: all at once after generation; ``periodic``: each piece as it finishes, all from
the current policy; ``async``: from a buffer the engines keep filling, stale groups dropped), one optimizer step, then
a weight sync while the engines are paused.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from moerl.engines.pool import EnginePool
from moerl.errors import ConfigError, EnginesDown, MoerlError, relayed
from moerl.megatron.parallel import init_process_group, on_lead, ranks_agree
from moerl.megatron.peers import PeerWatch
from moerl.orchestrator.components import (
    RewardEngines,
    full_weight_bytes,
    make_sync,
    make_trainer,
    start_engines,
    start_reward_engines,
    sync_address,
    sync_strategy,
    verify_tolerance,
)
from moerl.orchestrator.config import RunConfig, to_yaml
from moerl.orchestrator.lead import Lead, StepTimes
from moerl.orchestrator.model_cache import prepare_model
from moerl.orchestrator.preflight import check_layout, preflight
from moerl.orchestrator.rollouts import Group
from moerl.orchestrator.run_state import RUN_STATE, latest_checkpoint, save_checkpoint
from moerl.sample import Sample
from moerl.trainer.distribute import Interlude
from moerl.weight_sync.base import WeightSync

log = logging.getLogger("moerl.train")


class Pause(enum.IntEnum):
    """What every rank stops to do between two pieces of a step (an :class:`Interlude`'s kind)."""

    CATCH_UP = 1  # no replica serves and one came back: push it the current policy, so the step can get its groups
    STOP = 2  # no replica served for engines.down_timeout_s, or the rollout manager is gone: checkpoint, then stop


class Job:
    """The main job on one trainer rank, as its phases: set up, start the rollouts, then steps until the last. Every
    rank trains and takes part in each weight sync; global rank 0 also prepares the model and runs what :class:`Lead`
    holds."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.run_dir = Path(cfg.run.dir)
        self.pool: EnginePool | None = None  # rank 0: the engines it started
        self.reward: RewardEngines | None = None  # rank 0: the reward model's engines (reward.model)
        self.sync: WeightSync | None = None
        self.lead: Lead | None = None  # rank 0, once its rollouts started
        self.watch: PeerWatch | None = None  # the other ranks' heartbeat, once the process group is made

    @property
    def rank0(self) -> Lead:
        """Rank 0's part, where it runs."""
        assert self.lead is not None, "only global rank 0 holds the rollouts"
        return self.lead

    @property
    def weight_sync(self) -> WeightSync:
        assert self.sync is not None, "the weight sync is made when the rollouts start"
        return self.sync

    def run(self) -> dict | None:
        """The whole job; rank 0 returns the final accounting."""
        resumed = self.setup()
        try:
            self.start_rollouts()
            # Engines given by URL may hold another run's weights: they get this run's before the first rollout.
            self.weight_sync.start(self.trainer, engines_hold_it=not resumed and not self.cfg.engines.urls)
            self.serve_policy()
            self.verify()
            if self.lead is not None and self.cfg.run.mode == "async":
                self.lead.rollouts.order(
                    self.cfg.rollout.outstanding
                )  # a resumed run's pending prompts are re-issued first
            while self.trainer.version < self.cfg.run.steps:
                self.step()
            if self.cfg.run.placement == "colocated":  # none left suspended when the process group ends
                self.trainer.resume_communicators()
        except Exception as e:
            # One rank's failure makes torchrun stop the others, maybe this one in its teardown: said now, not after it.
            if isinstance(e, MoerlError):
                if not e.relayed:
                    print(f"error: {e}", file=sys.stderr, flush=True)
                e.said = True
            else:
                log.error(
                    "stopping at step %d: %s: %s",
                    self.trainer.version,
                    type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "",
                )
            raise
        finally:
            summary = self.teardown()
            if self.watch is not None:
                self.watch.stop()
        return summary

    # ---- phases --------------------------------------------------------------------------------
    def setup(self) -> bool:
        """Checks, the model, the process group (the one place it is made) and the trainer, resumed where there is a
        checkpoint; whether it was."""
        cfg = self.cfg
        check_layout(cfg, self.world)
        # Generation in sync mode can outlast any default collective timeout.
        init_process_group(timeout_s=6 * 3600)
        refused = None
        if sync_strategy(cfg) == "broadcast":  # each node's own
            try:
                sync_address(cfg)
            except ConfigError as e:
                refused = e
        ranks_agree(refused, "checking the weight sync's address (MOERL_SYNC_ADDRESS)")
        if self.world > 1:
            self.watch = PeerWatch(self.rank, self.world, cfg.run.peer_silence_s)

        def prepare() -> list[str | None]:
            # before minutes of model preparation (again: torchrun may have started this rank directly)
            preflight(cfg, self.world)
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
        """The engines and the weight sync to them; on rank 0 the rollouts, the manager and the metrics
        (:class:`Lead`)."""
        cfg = self.cfg
        if cfg.run.placement == "colocated":  # the engines start on the trainer's GPUs: the trainer makes room
            self.trainer.offload()

        def engines() -> list[str]:
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
            # Separate placement: the reward model's replicas (on GPUs of their own) load while the policy's do;
            # colocated, each pool starts once the one before holds its memory on the GPUs they share.
            together = cfg.run.placement == "separate"
            urls, self.pool = start_engines(cfg, self.hf, self.run_dir, local_ranks, wait=not together)
            self.reward = start_reward_engines(cfg, self.run_dir, local_ranks, wait=not together, beside=self.pool)
            if together:  # the teardown stops both, whichever fails
                if self.pool is not None:
                    self.pool.wait_started(cfg.engines.start_timeout_s)
                if self.reward is not None and self.reward.pool is not None:
                    self.reward.pool.wait_started(cfg.reward.engines.start_timeout_s)
            return urls

        urls = on_lead(engines, "starting the engines")
        sync = self.sync = make_sync(cfg, urls, self.hf, self.run_dir, self.trainer.hf_config)
        sync.connect()

        def lead() -> None:
            if cfg.engines.urls:  # verify compares on rank 0, at the precision the engines report
                self.tolerance = verify_tolerance(cfg, [str(info.get("dtype", "auto")) for info in sync.server_info()])
            self.lead = Lead(
                cfg,
                self.run_dir,
                self.hf,
                urls,
                self.pool,
                sync,
                self.state,
                self.trainer.version,
                self.reward,
            )

        on_lead(lead, "starting the rollout manager")

    def step(self) -> None:
        """Take the step's groups, train on them, bring the engines to the new policy, record, maybe save."""
        cfg, trainer, sync = self.cfg, self.trainer, self.weight_sync
        start = time.perf_counter()
        waited = self.lead.start_step() if self.lead is not None else 0.0
        taken: list[Group] = []
        # rank 0 sends each rank its part
        metrics = trainer.step(self.pieces(taken) if self.lead is not None else None, self.interlude)
        if cfg.run.placement == "colocated":  # before the engines' weights come back for the push
            trainer.offload_training_state()
        trained_at = time.perf_counter()
        on_lead(lambda: self.rank0.before_the_sync(), "taking in the rollouts after the step")
        try:
            stats = sync.update(trainer)
            self.serve_policy()
            if self.lead is not None and cfg.run.placement == "colocated":
                self.lead.wake_reward_engines()
            end = time.perf_counter()
            metrics.update(self.verify())
        except EnginesDown as e:
            if self.lead is not None:
                self.lead.rollouts.trained(taken)  # in the step just made: not to be re-issued on resume
            self.stop_with_checkpoint(e)
        times = StepTimes(start, trained_at, end, waited)

        def record() -> None:
            assert stats is not None, "on rank 0 an update to every engine returns its stats (or raises)"
            self.rank0.record(metrics, taken, stats, times, trainer.version, self.full_bytes)

        on_lead(record, "recording the step's metrics")
        if trainer.version == cfg.run.steps or (cfg.run.save_every and trainer.version % cfg.run.save_every == 0):
            save_checkpoint(trainer, self.lead.rollouts if self.lead is not None else None, self.run_dir)

    def pieces(self, taken: list[Group]) -> Iterator[list[Sample] | Interlude]:
        """Rank 0: the step's samples a piece at a time as the groups arrive (each piece's groups added to ``taken``),
        or an interlude for every rank: a catch-up sync, or the stop."""
        cfg, lead = self.cfg, self.rank0
        try:
            for piece in lead.rollouts.pieces(
                self.trainer.version,
                cfg.rollout.groups_per_step,
                whole=cfg.run.mode == "sync",
                waiting=self.while_waiting,
            ):
                if isinstance(piece, Interlude):
                    yield piece
                    continue
                if cfg.run.placement == "colocated":  # a sync step's groups come as one piece: now the trainer's turn
                    lead.sleep_engines()
                piece = sorted(piece, key=lambda g: g.index)  # deterministic order within what has arrived
                taken.extend(piece)
                yield [s for g in piece for s in g.samples]
        except MoerlError:  # the rollouts keep it (stop_error) for the stop
            yield Interlude(Pause.STOP)

    def while_waiting(self) -> Interlude | None:
        """Rank 0, while the step waits for groups: a catch-up of the replicas back while none serves."""
        return Interlude(Pause.CATCH_UP) if self.rank0.catch_up_needed() else None

    def interlude(self, kind: int) -> None:  # a Pause, as every rank receives it
        """Collective, between two pieces of a step; the weights are still the last update's."""
        if kind == Pause.STOP:
            self.stop_with_checkpoint(self.lead.rollouts.stop_error if self.lead is not None else None)
        sync = self.weight_sync
        try:
            stats = sync.update(self.trainer, only=self.lead.back if self.lead is not None else None)
            if not sync.reached:  # gone again before the sync: the wait goes on, and it is caught up when it is back
                if self.lead is not None:
                    self.lead.caught_up -= set(self.lead.back)
                return
            if self.lead is not None:
                self.lead.caught_up_with(stats, self.trainer.version)
            self.serve_policy(catch_up=True)
            self.verify(catch_up=True)  # with sync.verify: what came back serves the policy before it takes a request
        except EnginesDown as e:
            self.stop_with_checkpoint(e)

    def stop_with_checkpoint(self, error: MoerlError | None) -> None:
        """Collective: the run's checkpoint (every prompt not yet trained pending, to be issued again), then ``error``
        (global rank 0's; the other ranks say rank 0 stopped the run)."""
        if self.lead is not None:
            # the other prompts waiting for an engine fail too, while the checkpoint is written
            self.lead.rollouts.halt()
        save_checkpoint(self.trainer, self.lead.rollouts if self.lead is not None else None, self.run_dir)
        checkpoint = self.run_dir / "checkpoints" / f"step_{self.trainer.version}"
        where = f"checkpoint {checkpoint} written; run.resume=true continues from it"
        if error is None:
            raise relayed(MoerlError(f"global rank 0 stopped the run (its error says why); {where}"))
        stopped = type(error)(f"{error}; {where}")
        stopped.relayed = error.relayed
        raise stopped

    def serve_policy(self, catch_up: bool = False) -> None:
        """Rank 0 tells the manager what the engines serve now (:meth:`Lead.serve`)."""
        if self.lead is not None:
            self.lead.serve(self.trainer.version, catch_up)

    def verify(self, catch_up: bool = False) -> dict[str, float]:
        """With sync.verify, every engine the sync reached serves the trainer's policy (after the engines resumed). One
        that went since the sync is out of rotation until it is back."""
        if not self.cfg.sync.verify:
            return {}
        sync = self.weight_sync
        reached = sync.engines if self.lead is not None else None
        worst = sync.verify(self.trainer, self.tolerance)
        if self.lead is not None and sync.engines != reached:
            self.serve_policy(catch_up)
        return worst

    def teardown(self) -> dict | None:
        """Stop the manager (every live prompt accounted for), close the sync and the metrics, stop the engines."""
        summary = self.lead.close(self.run_dir) if self.lead is not None else None
        if self.sync is not None:
            self.sync.close()
        if self.lead is not None:
            self.lead.stop_engines()
        else:  # started, and the rest of rank 0's part never was
            for pool in (self.pool, self.reward.pool if self.reward is not None else None):
                if pool is not None:
                    pool.stop()
        return summary
