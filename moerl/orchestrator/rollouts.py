"""The trainer's end of the rollouts (global rank 0): orders to the rollout manager process, the finished groups it
streams back (a bounded buffer), the engines' health it reports, and every prompt accounted for.

Each prompt index is in exactly one state: in flight (issued, not back), ready (back, not taken),
taken (in the step being trained), trained, or dropped with a reason. Staleness is judged when a
group is taken: a group whose oldest model token is more than ``max_staleness`` versions behind the
trainer is dropped. In async mode the buffer keeps ``outstanding`` groups in flight or ready,
ordering one more group for each one taken or dropped, so engines never wait on the trainer.

Dynamic sampling (``rollout.filter_groups``): a group the manager's filter turned away comes back dropped as
filtered, and another is ordered in its place; past ``rollout.max_filtered_per_step`` in one step the run stops
(:class:`FilterExhausted`). The on-policy modes order ``rollout.oversample`` groups more than a step needs; what is left
of them once the step has its groups is dropped as surplus (they would be stale by the next step).
"""

from __future__ import annotations

import subprocess
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from moerl.engines.health import State
from moerl.errors import EnginesDown, MoerlError, RolloutManagerLost
from moerl.orchestrator.config import RolloutSection
from moerl.orchestrator.messages import (
    Dropped,
    DropReason,
    EnginesChanged,
    Event,
    Generate,
    GroupDone,
    Issued,
    Order,
    Restarting,
    RolloutFailed,
    Served,
    Stop,
    Updating,
    receive_event,
)
from moerl.sample import Sample
from moerl.simulation import LENGTHS_FILE, LengthRecord
from moerl.tasks.filters import reward_varies

WAITING_POLL_S = 0.5  # how often instalments() calls its waiting hook while no group is ready


class RolloutError(RuntimeError):
    """The rollout manager failed; the message carries its traceback."""


class FilterExhausted(MoerlError):
    """``rollout.filter_groups`` turned away more groups in one step than ``rollout.max_filtered_per_step``."""


class PromptState(StrEnum):
    """Where a live prompt is: its group generating, ready for a step, or taken by the step being trained."""

    IN_FLIGHT = "in_flight"
    READY = "ready"
    TAKEN = "taken"


class Outcome(StrEnum):
    """How a prompt left the accounting, besides a :class:`DropReason`: each counts in ``prompts/dropped`` but
    TRAINED."""

    TRAINED = "trained"
    STALE = "stale"  # past rollout.max_staleness when its step took it
    SURPLUS = "surplus"  # an oversampled group a step did not need
    UNUSED_AT_STOP = "unused_at_stop"  # ready, and the run stopped
    IN_FLIGHT_AT_STOP = "in_flight_at_stop"
    READY_AT_STOP = "ready_at_stop"
    TAKEN_AT_STOP = "taken_at_stop"


@dataclass
class Scored:
    """The groups scored since the last step's metrics: kept, turned away by the filter, and the prompts ordered in
    place of those; the rewards of every one of their samples."""

    kept: int = 0
    filtered: int = 0
    refills: int = 0
    reward_sum: float = 0.0
    rewards: int = 0

    def add(self, rewards: Iterable[float]) -> None:
        for reward in rewards:
            self.reward_sum += reward
            self.rewards += 1

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/filtered_groups": float(self.filtered),
            "rollout/filter_refills": float(self.refills),
            "rollout/filter_pass_rate": self.kept / max(self.kept + self.filtered, 1),
            # the policy's reward, where rollout/reward_mean is that of the groups trained
            "rollout/scored_reward_mean": self.reward_sum / max(self.rewards, 1),
        }


# A finished group as rank 0 holds it, from the manager's event until a step trains it: the event itself.
Group = GroupDone


@dataclass
class Accounting:
    issued: int = 0
    trained: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> prompts
    live: dict[int, PromptState] = field(default_factory=dict)

    def set(self, index: int, state: PromptState) -> None:
        self.live[index] = state

    def finish(self, index: int, outcome: Outcome | DropReason) -> None:
        self.live.pop(index, None)
        if outcome == Outcome.TRAINED:
            self.trained += 1
        else:
            self.dropped[outcome] += 1

    def counts(self) -> dict[str, int]:
        states = Counter(self.live.values())
        return {
            "prompts/issued": self.issued,
            "prompts/trained": self.trained,
            "prompts/dropped": sum(self.dropped.values()),
            "prompts/in_flight": states[PromptState.IN_FLIGHT],
            "prompts/ready": states[PromptState.READY],
            "prompts/taken": states[PromptState.TAKEN],
        }

    def balanced(self) -> bool:
        return self.issued == self.trained + sum(self.dropped.values()) + len(self.live)

    def state(self) -> dict:
        return {"issued": self.issued, "trained": self.trained, "dropped": dict(self.dropped)}


class RolloutBuffer:
    """The bounded rollout buffer, as rank 0 holds it: the ready groups, the orders to the manager that fill it, the
    accounting of every prompt."""

    def __init__(
        self,
        ctx: zmq.Context,
        cfg: RolloutSection,
        mode: str,
        accounting: Accounting | None = None,
        cursor: int = 0,
        run_dir: Path | None = None,
    ):
        """``run_dir``: where each finished group's response lengths are recorded as it arrives (None: nowhere)."""
        self.cfg, self.mode = cfg, mode
        self.orders = ctx.socket(zmq.PUSH)
        self.events = ctx.socket(zmq.PULL)
        self.orders_address = f"tcp://127.0.0.1:{self.orders.bind_to_random_port('tcp://127.0.0.1')}"
        self.events_address = f"tcp://127.0.0.1:{self.events.bind_to_random_port('tcp://127.0.0.1')}"
        self.ready: deque[Group] = deque()
        self.acct = accounting or Accounting()
        self.waited_s = 0.0  # time spent blocked waiting for groups
        self.cpu_s = 0.0  # CPU time spent taking in the manager's events (unpickling the samples, accounting)
        self.cursor = cursor  # the next new prompt index: where a resumed run's data continues
        self.engines: dict[str, State] = {}  # every replica's health state, as the manager last reported it
        self.left: set[str] = set()  # replicas that lost what the syncs left there since the last take_left()
        self.losses: dict[str, int] = {}  # each replica's count of such losses, as the manager last reported it
        # engine_failure | worker_lost -> re-issues of the prompts ended since the last read
        self.reissues: Counter = Counter()
        self.scored = Scored()
        self.surplus: set[int] = set()  # oversampled prompts still in flight that no step will take
        self.unissued = 0  # groups ordered whose Issued has not come yet (the manager issues them in order)
        self.surplus_unissued = 0  # of those, the last ones: surplus
        # What stops the run with a checkpoint: the manager found no engine for engines.down_timeout_s, or the manager
        # is gone.
        self.stop_error: MoerlError | None = None
        self._stopping = self._stopped = False
        self.manager: subprocess.Popen | None = None
        self.manager_log: Path | None = None
        # Every group that finishes, trained or not (a long one dropped as stale too), for calibrating a simulation
        # profile (moerl calibrate-lengths); a resumed run appends.
        self.lengths = open(run_dir / LENGTHS_FILE, "a") if run_dir is not None else None

    # ---- manager traffic ----------------------------------------------------------------------
    def watch(self, manager: subprocess.Popen, log: Path) -> None:
        """The manager's process. Once it is gone, orders are dropped and the step taking its groups raises
        :class:`RolloutManagerLost` (where every rank stops with a checkpoint)."""
        self.manager, self.manager_log = manager, log

    def _manager_gone(self) -> bool:
        if self.manager is None or (code := self.manager.poll()) is None:
            return False
        if self.stop_error is None:
            how = (
                f"killed by signal {-code}{' (SIGKILL: most often the kernel, for memory)' if code == -9 else ''}"
                if code < 0
                else f"exit code {code}"
            )
            self.stop_error = RolloutManagerLost(
                f"the rollout manager process exited ({how}); its log: {self.manager_log}"
            )
        return True

    def _send(self, order: Order) -> None:
        # A PUSH socket blocks while no peer is connected: until the manager connects, and for good once it is gone.
        while not self._manager_gone():
            try:
                return self.orders.send_pyobj(order, zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.05)

    def order(self, groups: int) -> None:
        if groups > 0:
            self._send(Generate(groups))
            self.unissued += groups

    def updating(self) -> None:
        """A weight update begins: the manager holds new requests until :meth:`served`."""
        self._send(Updating())

    def served(
        self,
        weight_version: str | None,
        engines: list[str],
        adapter: str | None = None,
        version: int = 0,
        also: bool = False,
    ) -> None:
        """The last weight sync reached ``engines``, which now report ``weight_version``; new requests sample with
        the LoRA ``adapter`` it loaded there (policy ``version``), if any. ``also``: it brought them the policy the
        last sync left elsewhere (a catch-up), which those replicas still serve."""
        self._send(Served(weight_version, engines, adapter, version, also))

    def restarting(self, urls: list[str]) -> None:
        """The job started these replicas' processes again."""
        if urls:
            self._send(Restarting(urls))

    def take_left(self) -> set[str]:
        left, self.left = self.left, set()
        return left

    def take_reissues(self) -> Counter:
        counts, self.reissues = self.reissues, Counter()
        return counts

    def take_scored(self) -> Scored:
        scored, self.scored = self.scored, Scored()
        return scored

    def _handle(self, event: Event) -> None:
        if isinstance(event, Issued):
            self.unissued -= 1
            if self.surplus_unissued:
                self.surplus_unissued -= 1
                self.surplus.add(event.index)
            if event.new:  # a resumed run's re-issued prompts were counted when first issued
                self.acct.issued += 1
                self.cursor = max(self.cursor, event.index + 1)
            self.acct.set(event.index, PromptState.IN_FLIGHT)
        elif isinstance(event, GroupDone):
            self._group_done(event)
        elif isinstance(event, Dropped):
            self.acct.finish(event.index, event.reason)
            self.reissues.update(engine_failure=event.engine_retries, worker_lost=event.workers_lost)
            filtered = event.reason == DropReason.FILTERED
            self.scored.filtered += filtered
            self.scored.add(event.rewards)
            if event.index in self.surplus:  # no step waits for it
                self.surplus.discard(event.index)
            elif not self._stopping:
                self.order(1)  # a prompt in its place: the step still needs its groups, the async queue its depth
                self.scored.refills += filtered
        elif isinstance(event, EnginesChanged):
            self.left |= {url for url, n in event.losses.items() if n > self.losses.get(url, 0)}
            self.engines, self.losses = event.states, event.losses
        elif isinstance(event, RolloutFailed):
            # the run already stops (on the first such error, most likely): the prompt ends live, at stop
            if self._stopping:
                return
            if event.engines_down:  # raised where the step takes its groups, which every rank stops for together
                self.stop_error = EnginesDown(event.message)
                return
            raise RolloutError(f"rollout of prompt {event.index} failed: {event.message}")
        else:
            for index in event.cancelled:
                if index in self.acct.live:
                    self.acct.finish(index, Outcome.IN_FLIGHT_AT_STOP)
            self._stopped = True

    def _group_done(self, group: Group) -> None:
        if self.lengths is not None:
            record = LengthRecord(
                group.index,
                [s.response_len for s in group.samples],
                [s.finish_reason == "length" for s in group.samples],
                self.cfg.max_new_tokens,
                episodes=group.episodes is not None,
            )
            self.lengths.write(record.line() + "\n")
            self.lengths.flush()  # a line a group: a run killed loses none
        self.reissues.update(engine_failure=group.engine_retries, worker_lost=group.workers_lost)
        self.scored.kept += 1
        self.scored.add(s.reward for s in group.samples)
        if group.index in self.surplus:
            self.surplus.discard(group.index)
            self.acct.finish(group.index, Outcome.SURPLUS)
            return
        self.ready.append(group)
        self.acct.set(group.index, PromptState.READY)

    def _receive(self, timeout_s: float | None) -> bool:
        """Handle one event, waiting up to ``timeout_s`` (None: forever). False on timeout."""
        if not self.events.poll(None if timeout_s is None else int(timeout_s * 1000)):
            return False
        start = time.thread_time()
        self._handle(receive_event(self.events))
        self.cpu_s += time.thread_time() - start
        return True

    def drain(self) -> None:
        while self._receive(0):
            pass

    # ---- what the trainer takes ---------------------------------------------------------------
    def instalments(
        self, version: int, groups: int, whole: bool, waiting: Callable[[], Any] | None = None
    ) -> Iterator[list[Group] | Any]:
        """``groups`` groups fit for policy ``version``, as instalments the moment they are ready (``whole``:
        one instalment once all are ready). Stale groups are dropped (and re-ordered in async mode). While none is
        ready, ``waiting()`` is called every :data:`WAITING_POLL_S`; what it returns, unless None, is yielded in
        between."""
        if self.mode != "async":
            self.order(groups + self.cfg.oversample)
        remaining = groups
        # The bound counts the groups turned away that this step orders again: a surplus one (the last step's, still in
        # flight or not yet read) holds no step up, whether the filter turned it away before this step or during it.
        refills_before = self.scored.refills
        instalment: list[Group] = []
        while remaining:
            if self.stop_error is not None:
                raise self.stop_error
            self.drain()
            self._check_filtered(refills_before, groups - remaining, groups)
            hook_at = time.monotonic() + WAITING_POLL_S
            while not self.ready:
                if self.stop_error is not None:
                    raise self.stop_error
                start = time.perf_counter()
                if not self._receive(WAITING_POLL_S):
                    self._manager_gone()
                self.waited_s += time.perf_counter() - start
                self._check_filtered(refills_before, groups - remaining, groups)
                if waiting is not None and time.monotonic() >= hook_at:
                    hook_at = time.monotonic() + WAITING_POLL_S
                    if (interlude := waiting()) is not None:
                        yield interlude
            while self.ready and remaining:
                group = self.ready.popleft()
                if self.mode == "async":
                    self.order(1)  # keep the engines' queue full while this one trains
                if version - group.oldest_version() > self.cfg.max_staleness:
                    self.acct.finish(group.index, Outcome.STALE)
                    if self.mode != "async":
                        self.order(1)
                    continue
                self.acct.set(group.index, PromptState.TAKEN)
                instalment.append(group)
                remaining -= 1
            if instalment and (not whole or not remaining):
                if not remaining:
                    self._drop_surplus()
                yield instalment
                instalment = []

    def _check_filtered(self, refills_before: int, taken: int, groups: int) -> None:
        """Stop the run once the filter has turned away more than its bound of the groups this step collects (those
        ordered again in their place: there were ``refills_before`` such when it began)."""
        filtered = self.scored.refills - refills_before
        if filtered <= self.cfg.filter_bound:
            return
        scored = self.scored.kept + self.scored.filtered
        self.stop_error = FilterExhausted(
            f"rollout.filter_groups={self.cfg.filter_groups} turned away {filtered} groups while this step collected "
            f"{taken} of its {groups} (a pass rate of {self.scored.kept / max(scored, 1):.0%} since the last "
            f"step), past rollout.max_filtered_per_step={self.cfg.filter_bound}: the data can no longer fill a step. "
            "Raise the bound, filter less, or give easier (or harder) prompts"
        )
        raise self.stop_error

    def _drop_surplus(self) -> None:
        """The on-policy modes, once a step has its groups: what it ordered beyond them is not trained."""
        if self.mode == "async":
            return
        for group in self.ready:
            self.acct.finish(group.index, Outcome.SURPLUS)
        self.ready.clear()
        self.surplus |= {index for index, state in self.acct.live.items() if state == PromptState.IN_FLIGHT}
        self.surplus_unissued = self.unissued

    def trained(self, groups: list[Group]) -> None:
        for g in groups:
            self.acct.finish(g.index, Outcome.TRAINED)

    def halt(self) -> None:
        """The run is stopping: nothing more is ordered, and a prompt that fails from now on ends live (at stop)."""
        self._stopping = True

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the manager; every prompt still live ends dropped with its reason."""
        self.halt()
        if not self._manager_gone():  # (one that is gone answers nothing)
            self._send(Stop())
            deadline = time.monotonic() + timeout_s
            while not self._stopped and time.monotonic() < deadline:
                self._receive(1.0)
        for group in self.ready:
            self.acct.finish(group.index, Outcome.UNUSED_AT_STOP)
        self.ready.clear()
        for index, state in list(self.acct.live.items()):
            self.acct.finish(index, Outcome(f"{state}_at_stop"))

    def pending(self) -> list[int]:
        """Prompts issued but neither trained nor dropped: re-issued first by a resumed run."""
        return sorted(self.acct.live)

    def close(self) -> None:
        self.orders.close(linger=0)
        self.events.close(linger=0)
        if self.lengths is not None:
            self.lengths.close()


def rollout_metrics(groups: list[Group]) -> dict[str, float]:
    samples = [s for g in groups for s in g.samples]
    rewards = np.array([s.reward for s in samples])
    lengths = np.array([s.response_len for s in samples])
    actions = np.array([s.action_count for s in samples])
    solved = [not reward_varies(g.samples) for g in groups]
    return (
        {
            "rollout/reward_mean": float(rewards.mean()),
            "rollout/reward_std": float(rewards.std()),
            "rollout/response_len_mean": float(lengths.mean()),
            "rollout/response_len_max": float(lengths.max()),
            "rollout/truncated_fraction": float(np.mean([s.finish_reason == "length" for s in samples])),
            "rollout/zero_variance_groups": float(np.mean(solved)),
            "rollout/samples": float(len(samples)),
            "rollout/group_seconds_mean": float(np.mean([g.seconds for g in groups])),
            # rollout.schedule.chunk_tokens: continuations of cut completions, and those moved to another replica
            "rollout/continued_requests": float(sum(g.continued for g in groups)),
            "rollout/moved_requests": float(sum(g.moved for g in groups)),
            # rollout.schedule.tail_tokens: requests placed as tail requests
            "rollout/tail_requests": float(sum(g.tail for g in groups)),
            # Samples continued across a weight update (rollout.partial=in_place): actions from two or more versions.
            "rollout/mixed_version_fraction": float(np.mean([np.ptp(s.at_actions(s.versions)) > 0 for s in samples])),
        }
        | episode_metrics(groups, float((lengths - actions).sum() / lengths.sum()))
        | scoring_metrics(groups)
        | process_metrics(samples)
    )


def process_metrics(samples: list[Sample]) -> dict[str, float]:
    """Where the samples carry step scores (:mod:`moerl.rewards.process`): steps per sample, the mean step score, and
    the correlation of each step's score with its sample's outcome reward (Pearson's, over the step's steps; left out
    where either is constant)."""
    scored = [(s.step_rewards, s.reward) for s in samples if s.step_rewards is not None]
    if not scored:
        return {}
    steps = np.concatenate([rewards for rewards, _ in scored]).astype(np.float64)
    outcomes = np.concatenate([np.full(len(rewards), outcome) for rewards, outcome in scored])
    metrics = {
        "process/steps_mean": len(steps) / len(scored),
        "process/step_reward_mean": float(steps.mean()),
    }
    if steps.std() > 0 and outcomes.std() > 0:
        metrics["process/outcome_correlation"] = float(np.corrcoef(steps, outcomes)[0, 1])
    return metrics


def scoring_metrics(groups: list[Group]) -> dict[str, float]:
    """With a reward model: the requests its replicas took for the step's groups, those asked again after a replica
    failed, the mean seconds a group's scoring took, and the mean model score and task reward of a scored response.
    With a teacher: its requests and retries alike, the generation workers lost under its requests, the seconds its
    scoring of the step's groups took (summed over the groups, which it scores as each finishes, overlapping generation)
    and their share of the groups' seconds from issue to scored, and where kept sets are renormalised the share of the
    actions whose kept set its top ids covered (``distill/kept_set_exact``) and the mean bound of the renormalisation's
    error (``distill/kept_set_gap``). With a process reward model: its requests and retries alike, its seconds per step
    scored and their share of the groups' seconds."""
    counts: Counter = Counter()
    for g in groups:
        counts.update(g.scoring or {})
    metrics: dict[str, float] = {}
    if "reward_engines/requests" in counts:
        metrics |= {
            "reward_engines/requests": float(counts["reward_engines/requests"]),
            "reward_engines/retries": float(counts["reward_engines/retries"]),
            "reward_engines/group_seconds_mean": counts["reward_engines/seconds"] / len(groups),
            "reward_engines/score_mean": counts["reward_engines/score_sum"] / max(counts["reward_engines/scored"], 1),
            "reward_engines/rule_mean": counts["reward_engines/rule_sum"] / max(counts["reward_engines/scored"], 1),
        }
    if "teacher_engines/requests" in counts:
        metrics |= {
            "teacher_engines/requests": float(counts["teacher_engines/requests"]),
            "teacher_engines/retries": float(counts["teacher_engines/retries"]),
            "teacher_engines/workers_lost": float(counts["teacher_engines/workers_lost"]),
            "distill/teacher_seconds": float(counts["teacher_engines/seconds"]),
            "distill/teacher_share": counts["teacher_engines/seconds"] / max(sum(g.seconds for g in groups), 1e-9),
        }
        if "teacher_engines/kept_set_exact" in counts:
            actions = max(counts["teacher_engines/actions"], 1)
            metrics["distill/kept_set_exact"] = counts["teacher_engines/kept_set_exact"] / actions
            metrics["distill/kept_set_gap"] = counts["teacher_engines/kept_set_gap"] / actions
    if "process_engines/requests" in counts:
        metrics |= {
            "process_engines/requests": float(counts["process_engines/requests"]),
            "process_engines/retries": float(counts["process_engines/retries"]),
            "process/prm_seconds_per_step": counts["process_engines/seconds"] / max(counts["process_engines/steps"], 1),
            "process/prm_share": counts["process_engines/seconds"] / max(sum(g.seconds for g in groups), 1e-9),
        }
    return metrics


def episode_metrics(groups: list[Group], env_token_fraction: float) -> dict[str, float]:
    """An agentic step's episodes: turns per episode; tool calls (and blocks that were not calls), forks, tool failures,
    failed episodes, episodes ended at their token budget (and of those, the ones whose agent failed after: scored
    anyway), recomputed routing positions and routing rows (received, and what full-sequence requests per turn would
    have received) summed; and the share of the response that is environment, tool or template tokens (fed, not
    scored). None of it for single-turn groups."""
    counts: Counter = Counter()
    for g in groups:
        counts.update(g.episodes or {})
    if not counts:
        return {}
    failed = {k: v for k, v in counts.items() if k.startswith("episode/failed_")}
    episodes = counts["episode/episodes"]
    return {
        "episode/turns_mean": counts["episode/turns"] / max(episodes, 1),
        "episode/tool_calls": float(counts["episode/tool_calls"]),
        "episode/malformed_tool_calls": float(counts["episode/malformed_tool_calls"]),
        "episode/forks": float(counts["episode/forks"]),
        "episode/tool_failures": float(counts["episode/tool_failures"]),
        "episode/failures": float(sum(failed.values())),
        "episode/truncated": float(counts["episode/truncated"]),
        "episode/truncated_agent_failed": float(counts["episode/truncated_agent_failed"]),
        "episode/env_token_fraction": env_token_fraction,
        "routing/recomputed_positions": float(counts["routing/recomputed_positions"]),
        "routing/rows_received": float(counts["routing/rows_received"]),
        "routing/rows_full_sequence": float(counts["routing/rows_full_sequence"]),
    } | {k: float(v) for k, v in failed.items()}
