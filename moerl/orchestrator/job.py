"""The main job on one trainer rank, as named phases (:class:`Job`): set up, start the rollouts, then steps until the
last, then the teardown. Rank 0 prepares the model (the CPU demo's tiny model is made once and cached), starts the
engines and the rollout manager, owns the rollout buffer and pushes weights; every rank trains. Per step: the step's
groups come from the buffer (``sync``: all at once after generation; ``periodic``: each instalment as it finishes, all
from the current policy; ``async``: from a buffer the engines keep filling, stale groups dropped), one optimizer step,
then a weight sync while the engines are paused."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

from moerl.errors import ConfigError, EnginesDown, MoerlError, relayed
from moerl.megatron.parallel import init_process_group, on_lead, ranks_agree
from moerl.megatron.peers import PeerWatch
from moerl.orchestrator.components import (
    Engines,
    full_weight_bytes,
    make_sync,
    make_trainer,
    start_engines,
    start_manager,
    start_scorer_engines,
    sync_address,
    verify_tolerance,
)
from moerl.orchestrator.config import RunConfig, to_yaml
from moerl.orchestrator.lead import Follower, Lead, Pause, StepTimes
from moerl.orchestrator.model_cache import prepare_model
from moerl.orchestrator.placement import placement_of
from moerl.orchestrator.preflight import check_layout, preflight
from moerl.orchestrator.rollouts import Group
from moerl.orchestrator.run_state import RUN_STATE, STOP_REQUEST, latest_checkpoint, save_checkpoint
from moerl.weight_sync.base import WeightSync

log = logging.getLogger("moerl.train")


class StoppedAsRequested(Exception):
    """Raised on every rank, after the checkpoint, to leave the step where the stop was asked for."""


class Job:
    """The main job on one trainer rank, as its phases: set up, start the rollouts, then steps until the last. Every
    rank trains and takes part in each weight sync; global rank 0 also prepares the model and runs what :class:`Lead`
    holds (the other ranks' :class:`Follower` does nothing in its place). The placement's hooks
    (:mod:`moerl.orchestrator.placement`) run at each phase."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.run_dir = Path(cfg.run.dir)
        self.placement = placement_of(cfg)
        self.engines = Engines(self.placement)  # rank 0: those it started or was given, once they start
        self.sync: WeightSync | None = None
        self.lead: Lead | Follower = Follower()  # rank 0's is a Lead once its rollouts started
        self.manager: subprocess.Popen | None = None  # rank 0's rollout manager process, from the engines' start
        self.watch: PeerWatch | None = None  # the other ranks' heartbeat, once the process group is made

    @property
    def weight_sync(self) -> WeightSync:
        assert self.sync is not None, "the weight sync is made when the rollouts start"
        return self.sync

    def run(self) -> dict | None:
        """The whole job; rank 0 returns the final accounting."""
        try:
            resumed = self.setup()
            self.start_rollouts()
            # Engines given by URL may hold another run's weights: they get this run's before the first rollout.
            self.weight_sync.start(self.trainer, engines_hold_it=not resumed and not self.cfg.engines.urls)
            self.serve_policy()
            self.verify()
            if self.cfg.run.mode == "async":  # a resumed run's pending prompts are re-issued first
                self.lead.order(self.cfg.rollout.outstanding)
            while self.trainer.version < self.cfg.run.steps:
                self.step()
                if self.trainer.version < self.cfg.run.steps and self.stop_requested():
                    self.stop_as_requested()
            self.placement.at_end(self.trainer)
        except StoppedAsRequested:
            self.placement.at_end(self.trainer)
        except Exception as e:
            # One rank's failure makes torchrun stop the others, maybe this one in its teardown: said now, not after it.
            if isinstance(e, MoerlError):
                if not e.relayed:
                    print(f"error: {e}", file=sys.stderr, flush=True)
                e.said = True
            else:
                log.error(
                    "stopping at step %d: %s: %s",
                    self.trainer.version if hasattr(self, "trainer") else 0,  # 0: before the trainer was built
                    type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "",
                )
            for exited in self.engines.exited():  # what most likely caused it
                log.error("%s", exited)
            raise
        finally:
            summary = self.teardown()
            if self.watch is not None:
                self.watch.stop()
        return summary

    # ---- phases --------------------------------------------------------------------------------
    def setup(self) -> bool:
        """Checks, the model, the process group (the one place it is made) and the trainer, resumed where there is a
        checkpoint; whether it was. Engines on GPUs of their own are launched before the trainer is built."""
        cfg = self.cfg
        check_layout(cfg, self.world)
        # Generation in sync mode can outlast any default collective timeout.
        init_process_group(timeout_s=6 * 3600)
        refused = None
        if self.placement.sync_strategy(cfg) == "broadcast":  # each node's own
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
        if self.placement.loads_overlap:  # minutes each for a large model: the engines load while the trainer does
            on_lead(self.launch_engines, "starting the engines")
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
        cfg, placement = self.cfg, self.placement
        if placement.loads_overlap:  # launched as the trainer was built; the teardown stops all, whichever fails
            on_lead(lambda: self.engines.wait_started(cfg), "starting the engines")
        else:
            placement.make_room(self.trainer)
            on_lead(self.launch_engines, "starting the engines")
        urls = self.engines.urls if self.rank == 0 else None
        strategy = placement.sync_strategy(cfg)
        sync = self.sync = make_sync(cfg, strategy, urls, self.hf, self.run_dir, self.trainer.hf_config)
        sync.connect()

        def lead() -> None:
            if cfg.engines.urls:  # verify compares on rank 0, at the precision the engines report
                self.tolerance = verify_tolerance(cfg, [str(info.get("dtype", "auto")) for info in sync.server_info()])
            assert self.manager is not None, "rank 0 started it with its engines"
            self.lead = Lead(
                cfg, self.run_dir, self.hf, self.engines, sync, self.state, self.trainer.version, self.manager
            )

        on_lead(lead, "starting the rollout manager")

    def launch_engines(self) -> None:
        """Rank 0: the rollout manager's process, and the engines the job starts: where :attr:`Placement.loads_overlap`,
        launched, for :meth:`start_rollouts` to wait on; elsewhere each pool answering before the next starts."""
        cfg, placement = self.cfg, self.placement
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.manager = start_manager(self.run_dir)
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        e, wait = self.engines, not placement.loads_overlap
        e.urls, e.pool = start_engines(cfg, placement, self.hf, self.run_dir, local_ranks, wait=wait)
        start_scorer_engines(cfg, placement, self.run_dir, local_ranks, wait, e)

    def step(self) -> None:
        """Take the step's groups, train on them, bring the engines to the new policy, record, maybe save."""
        cfg, trainer, sync = self.cfg, self.trainer, self.weight_sync
        start = time.perf_counter()
        waited = self.lead.start_step()
        taken: list[Group] = []
        # rank 0 sends each rank its part
        metrics = trainer.step(self.lead.instalments(trainer.version, taken), self.interlude)
        self.placement.after_training(trainer)
        trained_at = time.perf_counter()
        on_lead(self.lead.before_the_sync, "taking in the rollouts after the step")
        try:
            stats = sync.update(trainer)
            self.serve_policy()
            self.placement.before_generation(list(self.engines.scorer_pools.values()))
            end = time.perf_counter()
            metrics.update(self.verify())
        except EnginesDown as e:
            self.lead.trained(taken)  # in the step just made: not to be re-issued on resume
            self.stop_with_checkpoint(e)
        times = StepTimes(start, trained_at, end, waited)

        def record() -> None:
            assert stats is not None, "on rank 0 an update to every engine returns its stats (or raises)"
            self.lead.record(metrics, taken, stats, times, trainer.version, self.full_bytes)

        on_lead(record, "recording the step's metrics")
        if trainer.version == cfg.run.steps or (cfg.run.save_every and trainer.version % cfg.run.save_every == 0):
            save_checkpoint(trainer, self.lead.rollouts, self.run_dir)

    def interlude(self, kind: int) -> None:  # a Pause, as every rank receives it
        """Collective, between two instalments of a step; the weights are still the last update's."""
        if kind == Pause.STOP:
            self.stop_with_checkpoint(self.lead.stop_error)
        if kind == Pause.STOP_REQUESTED:
            self.stop_as_requested()
        sync = self.weight_sync
        try:
            stats = sync.update(self.trainer, only=self.lead.back)
            if not sync.reached:  # gone again before the sync: the wait goes on, and it is caught up when it is back
                self.lead.missed()
                return
            self.lead.caught_up_with(stats, self.trainer.version)
            self.serve_policy(catch_up=True)
            self.verify(catch_up=True)  # with sync.verify: what came back serves the policy before it takes a request
        except EnginesDown as e:
            self.stop_with_checkpoint(e)

    def stop_with_checkpoint(self, error: MoerlError | None) -> None:
        """Collective: the run's checkpoint (every prompt not yet trained pending, to be issued again), then ``error``
        (global rank 0's; the other ranks say rank 0 stopped the run)."""
        checkpoint = self.checkpoint_now()
        where = f"checkpoint {checkpoint} written; run.resume=true continues from it"
        if error is None:
            raise relayed(MoerlError(f"global rank 0 stopped the run (its error says why); {where}"))
        stopped = type(error)(f"{error}; {where}")
        stopped.relayed = error.relayed
        raise stopped

    def checkpoint_now(self) -> Path:
        """Collective, where the run stops before its last step: its checkpoint, every prompt not yet trained in it
        pending (the groups of a step not finished too), to be issued again."""
        self.lead.halt()  # the other prompts waiting for an engine fail too, while the checkpoint is written
        save_checkpoint(self.trainer, self.lead.rollouts, self.run_dir)
        return self.run_dir / "checkpoints" / f"step_{self.trainer.version}"

    def stop_requested(self) -> bool:
        """Collective: whether global rank 0 found run.dir/stop_requested."""
        box = [self.lead.stop_requested()]
        dist.broadcast_object_list(box, src=0)
        return bool(box[0])

    def stop_as_requested(self) -> None:
        """Collective: the checkpoint, the request taken away (a resumed run does not stop at once), then the run ends
        as if it had reached its last step."""
        checkpoint = self.checkpoint_now()
        on_lead(lambda: (self.run_dir / STOP_REQUEST).unlink(missing_ok=True), "taking the stop request away")
        if self.rank == 0:
            log.warning(
                "stopped at step %d as %s asked: checkpoint %s written; run.resume=true continues from it",
                self.trainer.version,
                self.run_dir / STOP_REQUEST,
                checkpoint,
            )
        raise StoppedAsRequested

    def serve_policy(self, catch_up: bool = False) -> None:
        """Rank 0 tells the manager what the engines serve now (:meth:`Lead.serve`)."""
        self.lead.serve(self.trainer.version, catch_up)

    def verify(self, catch_up: bool = False) -> dict[str, float]:
        """With sync.verify, every engine the sync reached serves the trainer's policy (after the engines resumed). One
        that went since the sync is out of rotation until it is back."""
        if not self.cfg.sync.verify:
            return {}
        sync = self.weight_sync
        reached = self.lead.holding_policy()
        worst = sync.verify(self.trainer, self.tolerance)
        if self.lead.holding_policy() != reached:
            self.serve_policy(catch_up)
        return worst

    def teardown(self) -> dict | None:
        """Stop the manager (every live prompt accounted for), close the sync and the metrics, stop the engines."""
        summary = self.lead.close(self.run_dir)
        if isinstance(self.lead, Follower) and self.manager is not None:  # started, never briefed: the run failed first
            self.manager.kill()
        if self.sync is not None:
            self.sync.close()
        self.engines.stop()
        return summary
