"""What global rank 0 runs beside its trainer rank (:class:`Lead`): the engines it started, the rollouts (the rollout
manager's process and the endpoint to it), the catch-up syncs a step may need, and the metrics and progress bar. The
other ranks hold none of it: theirs is a :class:`Follower`, with the same methods doing nothing, so the job
(:mod:`moerl.orchestrator.job`) calls either alike."""

from __future__ import annotations

import enum
import json
import logging
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from moerl.engines.health import State
from moerl.errors import MoerlError
from moerl.orchestrator.components import Engines, brief_manager
from moerl.orchestrator.config import RunConfig
from moerl.orchestrator.metrics import CpuMeter, MetricsWriter
from moerl.orchestrator.rollouts import Accounting, Group, PromptState, RolloutBuffer, rollout_metrics
from moerl.orchestrator.run_state import STOP_REQUEST
from moerl.sample import Sample
from moerl.trainer.distribute import Interlude
from moerl.weight_sync.base import SyncStats, WeightSync

log = logging.getLogger("moerl.train")


class Pause(enum.IntEnum):
    """What every rank stops to do between two instalments of a step (an :class:`Interlude`'s kind)."""

    CATCH_UP = 1  # no replica serves and one came back: push it the current policy, so the step can get its groups
    STOP = 2  # no replica served for engines.down_timeout_s, or the rollout manager is gone: checkpoint, then stop
    STOP_REQUESTED = 3  # run.dir/stop_requested appeared (run_state.STOP_REQUEST): checkpoint, then end the run


@dataclass
class StepTimes:
    """A step's clock readings (perf_counter seconds) and the rollouts' waiting time at its start."""

    start: float
    trained: float
    end: float
    waited_before: float


class Lead:
    """Global rank 0's part of the job, once its engines started: the rollouts, the catch-ups and the metrics."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        hf: Path,
        engines: Engines,
        sync: WeightSync,
        state: dict[str, Any],
        version: int,
        manager: subprocess.Popen,
    ):
        """``engines``: those the job started or was given, the scorers' too, and where they run; ``state``: a
        resumed run's (the data position, the prompts to issue again, the accounting); ``version``: the trainer's policy
        version at start; ``manager``: the rollout manager's process, waiting for its spec
        (:func:`~moerl.orchestrator.components.start_manager`)."""
        from tqdm import tqdm

        self.cfg, self.run_dir, self.engines, self.sync = cfg, run_dir, engines, sync
        acct = Accounting(issued=state["accounting"].get("issued", 0), trained=state["accounting"].get("trained", 0))
        acct.dropped.update(state["accounting"].get("dropped", {}))
        for index in state["pending"]:
            acct.set(index, PromptState.IN_FLIGHT)
        self.zmq = zmq.Context()
        self.rollouts = RolloutBuffer(self.zmq, cfg.rollout, cfg.run.mode, acct, state["cursor"], run_dir)
        brief_manager(
            run_dir / "config.yaml",
            hf,
            engines.urls,
            self.rollouts,
            state["cursor"],
            state["pending"],
            run_dir,
            engines.scorers,
        )
        self.manager = manager
        self.rollouts.watch(self.manager, run_dir / "logs" / "rollout_manager.log")
        self.cpu = CpuMeter(self.manager.pid, self.rollouts)
        if engines.pool is not None:
            sync.while_down = self.revive
            sync.restart_engines = self.restart
        self.writer = MetricsWriter(run_dir, resume_after=version if cfg.run.resume != "false" else None)
        self.bar = (
            tqdm(total=cfg.run.steps, initial=version, desc=f"GRPO {cfg.run.mode}", unit="step", dynamic_ncols=True)
            if cfg.run.progress
            else None
        )
        self.caught_up: set[str] = set()  # replicas a catch-up sync already went to, at the current version
        self.back: list[str] = []  # the replicas the next catch-up sync goes to
        self.catch_ups = 0  # catch-up syncs in the current step

    # ---- engines -------------------------------------------------------------------------------
    def revive(self) -> None:
        """The replicas whose process died are started again (stale until a sync reaches them, outside the broadcast's
        groups until it forms them again), and the scorers'."""
        pool = self.engines.pool
        for served in self.engines.scorers.values():  # the manager's scoring finds them back by /health: no policy
            if served.pool is not None:
                w = served.scorer.engines
                self.engines.placement.started_again(served.pool.revive(w.max_restarts, w.restart_window_s))
        if pool is None:
            return
        e = self.cfg.engines
        restarted = pool.revive(e.max_restarts, e.restart_window_s)
        self.sync.started_again(restarted)
        self.rollouts.restarting(restarted)

    def restart(self, urls: list[str]) -> list[str]:
        """Of these replicas, which the weight sync cannot use as they are (waiting in a failed broadcast for good, or
        holding all the weight groups they may), those the job started are killed and started again (now, or by a later
        revive once their processes have ended); those."""
        if self.engines.pool is None:
            return []
        killed = self.engines.pool.kill(urls)
        self.revive()
        return killed

    # ---- the rollouts --------------------------------------------------------------------------
    def order(self, groups: int) -> None:
        """Ask the manager for ``groups`` more groups (async runs order ahead of the first step)."""
        self.rollouts.order(groups)

    def start_step(self) -> float:
        """What the last update reached holds this version (the manager's view of it may lag by a probe); the rollouts'
        waiting time so far."""
        self.cpu.start_step()
        self.caught_up, self.catch_ups = set(self.sync.engines), 0
        return self.rollouts.waited_s

    def instalments(self, version: int, taken: list[Group]) -> Iterator[list[Sample] | Interlude]:
        """The step's samples an instalment at a time as the groups arrive (each instalment's groups added to
        ``taken``), for the trainer to send each rank its part, or an interlude for every rank: a catch-up sync, or the
        stop."""
        cfg = self.cfg
        try:
            for instalment in self.rollouts.instalments(
                version, cfg.rollout.groups_per_step, whole=cfg.run.mode == "sync", waiting=self.while_waiting
            ):
                if isinstance(instalment, Interlude):
                    yield instalment
                    continue
                # the groups are in (a sync step's as one instalment): the trainer's turn
                self.engines.placement.before_training(self.sync, list(self.engines.scorer_pools.values()))
                instalment = sorted(instalment, key=lambda g: g.index)  # deterministic order within what has arrived
                taken.extend(instalment)
                yield [s for g in instalment for s in g.samples]
        except MoerlError:  # the rollouts keep it (stop_error) for the stop
            yield Interlude(Pause.STOP)

    def while_waiting(self) -> Interlude | None:
        """While the step waits for groups: the stop asked for, or a catch-up of the replicas back while none
        serves."""
        if self.stop_requested():
            return Interlude(Pause.STOP_REQUESTED)
        return Interlude(Pause.CATCH_UP) if self.catch_up_needed() else None

    def stop_requested(self) -> bool:
        """Whether run.dir/stop_requested asks the run to checkpoint and stop."""
        return (self.run_dir / STOP_REQUEST).exists()

    def catch_up_needed(self) -> list[str]:
        """While the step waits for groups: replicas that died are started again; when none serves and some are back
        (stale: they hold what they started from), those, for every rank to stop and bring them the current policy."""
        self.revive()
        states = self.rollouts.engines
        self.caught_up -= self.rollouts.take_left()  # lost it since (restarted, or found without it by a request)
        back = sorted(url for url, state in states.items() if state == State.STALE and url not in self.caught_up)
        if back and State.HEALTHY not in states.values():
            self.caught_up.update(back)
            self.back = back
            return back
        return []

    def missed(self) -> None:
        """A catch-up sync found none of :attr:`back` there: each is caught up once back again."""
        self.caught_up -= set(self.back)

    def caught_up_with(self, stats: SyncStats | None, version: int) -> None:
        """A catch-up sync reached :attr:`sync`'s engines; those it missed, or that went since, are caught up once
        back."""
        log.info(
            "catch-up sync of version %d to %s in %.2f s",
            version,
            ", ".join(self.sync.engines),
            stats.seconds if stats is not None else 0.0,
        )
        self.catch_ups += 1
        self.caught_up -= set(self.back) - set(self.sync.engines)

    def before_the_sync(self) -> None:
        self.revive()  # the sync reaches those that answer by then
        self.rollouts.drain()  # what replicas lost until now, the sync gives them (those it misses are stale after it)
        self.rollouts.take_left()
        self.rollouts.updating()

    def serve(self, version: int, catch_up: bool = False) -> None:
        """New requests name the adapter the last sync loaded (LoRA runs; full-weight syncs change the weights
        themselves), and a replica out of rotation comes back once it reports the weight version the others now serve.
        A catch-up of full weights leaves the policy the others hold: they stay in rotation (a LoRA catch-up's adapter
        is new)."""
        weight_version, adapter = self.sync.served(version)
        self.rollouts.served(weight_version, self.sync.engines, adapter, version, also=catch_up and adapter is None)

    def holding_policy(self) -> list[str]:
        """The engines the last update reached that are still there."""
        return self.sync.engines

    def trained(self, taken: list[Group]) -> None:
        """These groups were trained on: not to be issued again on resume."""
        self.rollouts.trained(taken)

    @property
    def stop_error(self) -> MoerlError | None:
        """Why the rollouts stopped the run, if they did."""
        return self.rollouts.stop_error

    def halt(self) -> None:
        """The prompts waiting for an engine fail (the run stops)."""
        self.rollouts.halt()

    # ---- metrics -------------------------------------------------------------------------------
    def record(
        self,
        metrics: dict,
        taken: list[Group],
        stats: SyncStats,
        times: StepTimes,
        version: int,
        full_weight_bytes: int,
    ) -> None:
        rollouts = self.rollouts
        rollouts.trained(taken)
        rollouts.drain()
        metrics.update(rollout_metrics(taken))
        metrics.update(rollouts.acct.counts())
        reissues = rollouts.take_reissues()
        wall = times.end - times.start
        metrics.update(
            {
                "step": version,
                "mode": self.cfg.run.mode,
                "sync/seconds": stats.seconds,
                "sync/pause_seconds": stats.pause_seconds,
                "sync/bytes": stats.bytes,
                "sync/buckets": stats.buckets,
                "sync/full_weight_bytes": full_weight_bytes,
                "time/step_seconds": wall,
                "time/train_seconds": times.trained - times.start,
                "time/trainer_idle_fraction": (rollouts.waited_s - times.waited_before) / wall,
                "rollout/retries": float(sum(g.retries for g in taken)),
                "throughput/samples_per_second": metrics["rollout/samples"] / wall,
                "rollout/retries_engine_failure": float(reissues["engine_failure"]),
                "rollout/retries_worker_lost": float(reissues["worker_lost"]),
                "sync/catch_ups": float(self.catch_ups),
                "prompts/dropped_engine_failure": float(rollouts.acct.dropped["engine_failure"]),
            }
        )
        metrics.update(self.engines.placement.step_metrics(self.sync, stats, wall))
        metrics.update(stats.strategy_metrics())
        metrics.update(rollouts.take_scored().metrics())
        states = list(rollouts.engines.values())
        metrics.update({f"engines/{state}": float(states.count(state)) for state in State})
        pool = self.engines.pool
        metrics["engines/restarts"] = float(sum(pool.restarts.values())) if pool is not None else 0.0
        for key, served in self.engines.scorer_pools.items():
            metrics[f"{key}_engines/restarts"] = float(sum(served.restarts.values()))
        metrics.update(self.cpu.step_metrics(wall))
        self.writer.write(metrics)
        if self.bar is not None:
            self.bar.update(1)
            down = len(states) - states.count(State.HEALTHY)
            self.bar.set_postfix(
                reward=f"{metrics['rollout/reward_mean']:.3f}",
                agree=f"{metrics.get('routing/agreement', float('nan')):.3f}",
                stale=int(metrics["staleness/max"]),
                **({"engines_down": down} if down else {}),
            )

    # ---- the end -------------------------------------------------------------------------------
    def close(self, run_dir: Path) -> dict:
        """Stop the manager (every live prompt accounted for, written to accounting.json), the metrics and the sockets;
        the final accounting."""
        self.rollouts.stop()
        summary = {
            **self.rollouts.acct.state(),
            "balanced": self.rollouts.acct.balanced(),
            "live": len(self.rollouts.acct.live),
        }
        (run_dir / "accounting.json").write_text(json.dumps(summary, indent=1))
        self.rollouts.close()
        try:
            self.manager.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.manager.kill()
        self.writer.close()
        if self.bar is not None:
            self.bar.close()
        self.zmq.term()
        return summary


class Follower:
    """A trainer rank other than global rank 0 (and rank 0 until its rollouts start): :class:`Lead`'s methods, doing
    nothing. Its part of each step comes from rank 0, in the collectives every rank takes part in."""

    rollouts = None  # the run state's is rank 0's (save_checkpoint)
    stop_error = None
    back = None  # a catch-up sync reaches the engines rank 0 names

    def order(self, groups: int) -> None:
        pass

    def start_step(self) -> float:
        return 0.0

    def instalments(self, version: int, taken: list[Group]) -> None:
        return None  # this rank's part of the step's samples comes from rank 0

    def before_the_sync(self) -> None:
        pass

    def serve(self, version: int, catch_up: bool = False) -> None:
        pass

    def holding_policy(self) -> None:
        return None

    def missed(self) -> None:
        pass

    def caught_up_with(self, stats: SyncStats | None, version: int) -> None:
        pass

    def trained(self, taken: list[Group]) -> None:
        pass

    def record(
        self,
        metrics: dict,
        taken: list[Group],
        stats: SyncStats,
        times: StepTimes,
        version: int,
        full_weight_bytes: int,
    ) -> None:
        pass

    def halt(self) -> None:
        pass

    def stop_requested(self) -> bool:
        return False

    def close(self, run_dir: Path) -> None:
        return None
