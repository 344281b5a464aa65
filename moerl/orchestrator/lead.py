"""What global rank 0 runs beside its trainer rank: the engines it started, the rollouts (the rollout manager's process
and the endpoint to it), the catch-up syncs a step may need, and the metrics and progress bar. The other ranks hold
none of it: the job (:mod:`moerl.orchestrator.job`) calls it where ``job.lead`` is not None."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from moerl.engines.client import EngineClient, EngineError
from moerl.engines.health import State
from moerl.engines.pool import EnginePool
from moerl.errors import MoerlError
from moerl.orchestrator.components import RewardEngines, start_manager
from moerl.orchestrator.config import RunConfig
from moerl.orchestrator.metrics import CpuMeter, MetricsWriter
from moerl.orchestrator.rollouts import Accounting, Group, PromptState, RolloutEndpoint, rollout_metrics
from moerl.weight_sync.base import SyncStats, WeightSync
from moerl.weight_sync.tensor import TensorSync

log = logging.getLogger("moerl.train")


@dataclass
class StepTimes:
    """A step's clock readings (perf_counter seconds) and the rollouts' waiting time at its start."""

    start: float
    trained: float
    end: float
    waited_before: float


class Lead:
    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        hf: Path,
        urls: list[str],
        pool: EnginePool | None,
        sync: WeightSync,
        state: dict[str, Any],
        version: int,
        reward: RewardEngines | None = None,
    ):
        """``state``: a resumed run's (the data position, the prompts to issue again, the accounting); ``version``: the
        trainer's policy version at start; ``reward``: the reward model's engines, and the pool of those the job
        started."""
        from tqdm import tqdm

        self.cfg, self.pool, self.sync = cfg, pool, sync
        acct = Accounting(issued=state["accounting"].get("issued", 0), trained=state["accounting"].get("trained", 0))
        acct.dropped.update(state["accounting"].get("dropped", {}))
        for index in state["pending"]:
            acct.set(index, PromptState.IN_FLIGHT)
        self.zmq = zmq.Context()
        self.rollouts = RolloutEndpoint(self.zmq, cfg.rollout, cfg.run.mode, acct, cursor=state["cursor"])
        self.reward_pool = reward.pool if reward is not None else None
        # colocated: the reward replicas share the trainer's GPUs, and give back their memory while it trains
        self.colocated_reward: list[str] = []
        self.reward_released: set[str] = set()  # those the last sleep released, less those started again since
        if reward is not None and reward.pool is not None and cfg.run.placement == "colocated":
            self.colocated_reward = reward.urls
        self.manager: subprocess.Popen | None = start_manager(
            run_dir / "config.yaml", hf, urls, self.rollouts, state["cursor"], state["pending"], run_dir, reward
        )
        self.rollouts.watch(self.manager, run_dir / "logs" / "rollout_manager.log")
        self.cpu = CpuMeter(self.manager.pid, self.rollouts)
        if pool is not None:
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
        groups until it forms them again), and the reward model's."""
        if self.reward_pool is not None:  # the manager's scoring finds them back by /health: they hold no policy
            w = self.cfg.reward.engines
            self.reward_released -= set(self.reward_pool.revive(w.max_restarts, w.restart_window_s))
        if self.pool is None:
            return
        e = self.cfg.engines
        restarted = self.pool.revive(e.max_restarts, e.restart_window_s)
        self.sync.started_again(restarted)
        self.rollouts.restarting(restarted)

    def restart(self, urls: list[str]) -> list[str]:
        """Of these replicas, which the weight sync cannot use as they are (waiting in a failed broadcast for good, or
        holding all the weight groups they may), those the job started are killed and started again (now, or by a later
        revive once their processes have ended); those."""
        if self.pool is None:
            return []
        killed = self.pool.kill(urls)
        self.revive()
        return killed

    def sleep_engines(self) -> None:
        """Colocated, before the trainer's phase: the engines give back their memory. One that fails to is left as it
        is (the update wakes, or passes over, what it finds)."""
        assert isinstance(self.sync, TensorSync), "colocated placement syncs by TensorSync"
        try:
            self.sync.sleep()
        except (MoerlError, EngineError) as e:
            log.warning("colocated: the engines did not all release their memory before the trainer's phase: %s", e)
        self.reward_released = self._on_colocated_reward(self.colocated_reward, "release their memory", _release_memory)

    def wake_reward_engines(self) -> None:
        """Colocated, once the policy's engines generate again: the reward replicas the sleep released take back their
        memory (their weights from host memory: they take no updates) and score again. One started again since holds
        its memory and serves already; SGLang's scheduler fails on a resume of what it did not release. One that fails
        to wake is killed and started again: the manager's scoring waits on a paused replica, since it answers."""
        woken = sorted(self.reward_released)
        self.reward_released = set()
        failed = set(woken) - self._on_colocated_reward(woken, "take back their memory", _take_back_memory)
        if failed and self.reward_pool is not None:  # left paused or without its memory, it would never score again
            log.warning("colocated: reward engine(s) %s killed, to be started again", ", ".join(sorted(failed)))
            self.reward_pool.kill(sorted(failed))

    @staticmethod
    def _on_colocated_reward(urls: list[str], what: str, call: Callable[[EngineClient], Awaitable[None]]) -> set[str]:
        """``call(client)`` on each of these colocated reward replicas; those it succeeded on. One that fails is left
        as it is (revive restarts it if it died; a restarted replica holds its memory)."""

        async def each(url: str) -> None:
            async with EngineClient([url], timeout_s=REWARD_MEMORY_TIMEOUT_S, retries=0) as client:
                await call(client)

        async def every() -> list:
            return await asyncio.gather(*(each(url) for url in urls), return_exceptions=True)

        if not urls:
            return set()
        done = set()
        for url, outcome in zip(urls, asyncio.run(every()), strict=True):
            if isinstance(outcome, MoerlError | EngineError):
                log.warning("colocated: reward engine %s did not %s: %s", url, what, outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                done.add(url)
        return done

    def start_step(self) -> float:
        """What the last update reached holds this version (the manager's view of it may lag by a probe); the rollouts'
        waiting time so far."""
        self.cpu.start_step()
        self.caught_up, self.catch_ups = set(self.sync.engines), 0
        return self.rollouts.waited_s

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
        if isinstance(self.sync, TensorSync):
            phases = {
                "colocate/sleep_seconds": self.sync.sleep_seconds,
                "colocate/wake_seconds": self.sync.wake_seconds,
                "colocate/push_seconds": stats.seconds,
            }
            metrics.update(phases)
            metrics["colocate/step_fraction"] = sum(phases.values()) / wall
            metrics["colocate/trainer_offloaded_bytes"] = float(self.sync.offloaded_bytes)  # rank 0's
        metrics.update(rollouts.take_scored().metrics())
        states = list(rollouts.engines.values())
        metrics.update({f"engines/{state}": float(states.count(state)) for state in State})
        metrics["engines/restarts"] = float(sum(self.pool.restarts.values())) if self.pool is not None else 0.0
        if self.reward_pool is not None:
            metrics["reward_engines/restarts"] = float(sum(self.reward_pool.restarts.values()))
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
        """Stop the manager (every live prompt accounted for, written to accounting.json), the metrics and the engines;
        the final accounting."""
        self.rollouts.stop()
        summary = {
            **self.rollouts.acct.state(),
            "balanced": self.rollouts.acct.balanced(),
            "live": len(self.rollouts.acct.live),
        }
        (run_dir / "accounting.json").write_text(json.dumps(summary, indent=1))
        self.rollouts.close()
        if self.manager is not None:
            try:
                self.manager.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.manager.kill()
        self.writer.close()
        if self.bar is not None:
            self.bar.close()
        return summary

    def stop_engines(self) -> None:
        """After the weight sync has closed: the engines the job started, and the sockets' context."""
        for pool in (self.pool, self.reward_pool):
            if pool is not None:
                pool.stop()
        self.zmq.term()


REWARD_MEMORY_TIMEOUT_S = 120.0  # a release or resume of a reward replica's memory


async def _release_memory(client: EngineClient) -> None:
    await client.pause("retract")
    try:
        await client.release_memory()
    except (MoerlError, EngineError):
        await client.resume()  # it serves on, holding its memory, rather than staying paused through the step
        raise


async def _take_back_memory(client: EngineClient) -> None:
    await client.resume_memory()
    await client.resume()
