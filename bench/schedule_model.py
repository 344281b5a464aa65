#!/usr/bin/env python3
"""An offline model of the async (or sync, or periodic) loop, to weigh scheduling policies moerl does not have before
building one.

bench/simulation.py runs the job itself; each of its async runs takes 20-35 minutes here. This is a discrete-event
model of the same loop, seconds a run: the async depth's groups in flight (rollout.outstanding, B * max_staleness by
default), each of a group's n responses drawn from the profile's length distribution, each replica's running requests
decoding at the profile's per-request rate for their count, the trainer taking groups as they finish (one whose issue
version lags its own by more than s is dropped as stale and another ordered, as the buffer does), training each as it
is taken (the job's instalments), then the optimizer step and a sync that holds every replica. Prefill (a few ms a
prompt here) and the orchestrator's own time are left out. A replica never reaches the profile's max_running_requests at
these depths; the model stops with an error if one would.

Policies (``--policies``):
  groups    the job's: a group's n completions are one request, on the replica holding the fewest groups
  capped    each completion a request of its own, on the replica running the fewest; a replica running a request
            older than ``--old-after`` seconds takes new ones only while it runs fewer than ``--cap`` (the profile's
            first point: below it each request decodes at R(1)), any other while it runs fewer than the profile's
            max_running_requests; where no replica may take one, the request waits
  migrate   each completion a request of its own, on the replica running the fewest of all but a share
            (``--tail-share``) kept for old requests: a request older than ``--old-after`` moves to one of those running
            fewer than ``--cap``, which decodes nothing while it prefills the request's output, re-sent as prompt
            (SGLang continues no request elsewhere: this stands for an abort and a re-issue)
  length_aware  the job's rollout.schedule.policy=length_aware, run by the job's own dispatcher
            (moerl.orchestrator.scheduling) on the model's clock: each completion a request of its own, with
            ``--probes``, ``--max-running``, ``--chunk-tokens``, ``--tail-tokens`` and ``--tail-running`` as the
            config's fields (each of the lists run); a chunk continued on another replica than its last costs that
            replica a prefill of the completion's output so far, during which it decodes nothing
A group's lengths follow the profile's correlation (``--correlations`` runs each of several), as the simulated engine's.
Any of them with ``--depth`` (the groups in flight, as a multiple of the default), ``--restart-young S`` (at each
sync, a group issued in the S seconds before the pause is aborted and issued again under the new version: its tokens
are lost, its staleness window is whole) and ``--abort-doomed`` (at each sync, a group that can no
longer be trained is aborted at once and another ordered, rather than decoded to the end and dropped). With
``length_aware``, ``--abort-predicted M``: as a completion finishes, and at each sync, a group whose unfinished
completions are predicted (from its finished ones, by the dispatcher's rule) to end past its window by more than M
times the time left to it is aborted and another ordered; the window ends where the step of its version + max
staleness is predicted to have its groups, from the mean step so far, and the completions are taken to decode at
least at the tail requests' rate, pausing at syncs. With ``length_aware``, ``--oracle``: the dispatcher is told each
completion's length as it is issued (each group predicted its longest, each request its own), to measure what better
predictions could give. ``--hold-long T``: a group whose longest completion will run T tokens or more, drawn between
syncs, is held and issued at the next sync (when its window opens) and another drawn in its place; the groups held go
beyond the depth, and as many later orders are skipped (a prompt's length known before it is issued: to measure what
issuing long groups at a sync could give); ``--hold-on history`` judges a group instead by the longest completion of
its prompt's group one epoch before (drawn from the same prompt difficulty: what a multi-epoch run's lengths.jsonl
tells of a prompt before it is issued again).

``--mode sync`` models the sync loop instead: a step's groups are issued together at the sync that begins it, trained
once all have ended, and the bound is sync's tail-counted one (each step's generation or its longest response at R(1),
whichever is longer, then its training and sync); a schedule's own share of the job's sync figures, with no harness.
``--mode periodic`` issues them so too, and trains each as it ends (the job's instalments), against periodic's bound.

``--lengths RUN_DIR`` replays a run's own draw instead of the profile's: the groups its job recorded (the run
directory's lengths.jsonl, which ``moerl calibrate-lengths`` reads) are issued in index order, as the job issued them
(in sync and periodic mode, step k's groups are the run's k-th B), once (no seeds, no ``--correlations``), and a
column gives each step's seconds, to set beside the job's ``time/step_seconds`` step by step. In async mode the model
also needs a draw for each group still in flight when it stops, which the run did not finish and so did not record:
replay a run of more steps than the model's.

For each: samples/s (simulated), the mode's tail-counted bound over the same steps (bench/simulation.py's, from the
steps' mean response and longest trained response) and its terms, the ratio, async's one-concurrency guide's ratio to
the same bound (bench/simulation.py's: the best of running every request at one concurrency, for the responses the run
trained), the share of the tokens decoded for groups that ended that no step trained (dropped groups', and what restarts
threw away), groups dropped as stale (those aborted as predicted late among them), the longest trained response, and
where in its version's step a group was issued (0: at the sync that began the version, 1: at the next; the median over
the trained groups and over the dropped ones, the fill's left out), each the mean over ``--seeds`` runs. With
``--abort-doomed`` a group is counted dropped at the sync that dooms it, not when it would have finished. The model's
``groups`` row is the job's policy: compare it with the job's rows in docs/benchmarks/simulation.md and simulation-96.md
to see how far the model can be trusted at a shape.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from moerl.orchestrator.config import ScheduleSection  # noqa: E402
from moerl.orchestrator.scheduling import Dispatcher, GroupLengths, Request  # noqa: E402
from moerl.simulation import CalibrationError, Profile, read_lengths  # noqa: E402
from report import publish  # noqa: E402
from simulation import bounds, one_concurrency_guide, step_times  # noqa: E402

POLICIES = ("groups", "capped", "migrate", "length_aware")
AGE_CHECK_S = 5.0  # how often requests are looked at for their age, where a policy routes by it


@dataclass
class Shape:
    trainer_gpus: int
    engine_gpus: int
    groups: int  # B: groups a step trains
    samples: int  # n: completions a group
    staleness: int
    max_new_tokens: int
    model_gb: float
    mode: str = "async"  # or sync, periodic: a step's groups are issued together at its sync (see the docstring)


@dataclass
class Policy:
    name: str = "groups"
    depth: float = 1.0
    old_after_s: float = 150.0
    cap: int = 8
    tail_share: float = 1 / 6
    restart_young_s: float = 0.0
    abort_doomed: bool = False
    abort_predicted: float | None = None  # None: off; else the margin (see --abort-predicted)
    oracle: bool = False  # length_aware: the dispatcher knows each completion's length (--oracle)
    hold_long: int = 0  # a group whose longest completion runs this many tokens waits for the next sync (0: none)
    hold_on: str = "drawn"  # what --hold-long judges: the group's own longest ("drawn"), or its prompt's last epoch's
    schedule: ScheduleSection = field(default_factory=ScheduleSection)  # length_aware: the job's rollout.schedule


@dataclass
class KnownRequest(Request):
    length: int = 0  # the tokens its completion decodes in all


@dataclass
class OracleLengths(GroupLengths):
    """Each group predicted its longest completion's length, known before any finishes (``--oracle``)."""

    longest_of: list[float] = field(default_factory=list)

    def known(self, group: int) -> int | None:
        return int(self.longest_of[group])


class OracleDispatcher(Dispatcher):
    """The job's dispatcher, each request predicted its own completion's length (``--oracle``)."""

    def predicted_total(self, request: Request) -> int:
        assert isinstance(request, KnownRequest)
        return request.length

    def predicted_left(self, request: Request) -> float:
        assert isinstance(request, KnownRequest)
        left = max(request.length - request.decoded, 1)
        chunk = self.schedule.chunk_tokens
        return min(left, chunk) if chunk else left


class AsyncLoop:
    """One run of the model (the module's docstring)."""

    def __init__(
        self, profile: Profile, shape: Shape, policy: Policy, seed: int, recorded: list[np.ndarray] | None = None
    ):
        self.e, self.t, self.shape, self.policy = profile.engine, profile.trainer, shape, policy
        self.rng = np.random.default_rng(seed)
        self.recorded, self.replayed = recorded, 0  # --lengths: a run's groups' lengths, and how many were issued
        self.replicas = shape.engine_gpus // self.e.gpus
        running = np.arange(self.e.max_running_requests + 1)
        self.per_request = np.array([self.e.decode_rate(max(1, int(c))) for c in running])
        self.sync_s = shape.model_gb / self.e.weight_update_gb_per_s
        self.on_policy = shape.mode != "async"  # a step's groups are issued together at the sync that begins it
        depth = shape.groups if self.on_policy else shape.groups * max(1, shape.staleness) * policy.depth
        self.in_flight = max(1, round(depth))
        self.next_step = 0  # on-policy modes: groups ordered for the next step, issued at its sync
        # Requests: tokens left, replica (-1 while waiting for one), start time, group; groups: their issue version and
        # time.
        self.length, self.left, self.start = np.zeros(0), np.zeros(0), np.zeros(0)
        self.replica, self.group, self.alive = np.zeros(0, int), np.zeros(0, int), np.zeros(0, bool)
        self.hold = np.zeros(self.replicas)  # a replica prefilling a moved request decodes nothing until then
        self.version_of, self.issued_at, self.running_of, self.tokens_of, self.longest_of = [], [], [], [], []
        self.now, self.version, self.paused, self.dropped = 0.0, 0, False, 0
        # When each version began to be served, and where in its version's step each trained and each dropped group was
        # issued (0: at the sync that began it, 1: at the next): a group issued late has less of its window left.
        self.served_at, self.fates = [0.0], {"trained": [], "dropped": []}
        self.collected_at: list[float] = []  # when each step had its groups
        self.aborted = 0  # groups aborted as predicted to outrun their window (--abort-predicted), counted in dropped
        self.decoded_of = np.zeros(0)  # tokens each group decoded (since its last restart)
        self.held: list[np.ndarray] = []  # --hold-long: groups drawn between syncs, to be issued at the next
        self.owed = 0  # --hold-long: issues skipped after held groups went beyond the depth
        self.lost = 0.0  # tokens restarts threw away
        # length_aware: the job's own dispatcher hands out replicas; a request's chunk ends at ``chunk_end``
        self.urls = [str(r) for r in range(self.replicas)]
        if policy.oracle:
            self.lengths = OracleLengths(shape.max_new_tokens, longest_of=self.longest_of)
            self.dispatcher = OracleDispatcher(lambda: self.urls, self.lengths, policy.schedule)
        else:
            self.lengths = GroupLengths(shape.max_new_tokens)
            self.dispatcher = Dispatcher(lambda: self.urls, self.lengths, policy.schedule)
        self.requests: list[Request] = []
        self.chunk_end = np.zeros(0)

    # ---- generation -------------------------------------------------------------------------------
    def _draw(self) -> tuple[np.ndarray, float]:
        """A group's response lengths, as the simulated engine draws them (correlated as the profile says), cut at
        max_new_tokens; and its longest as ``--hold-on`` knows it: drawn, or its prompt's group's one epoch before.
        With ``--lengths``, the run's next group."""
        if self.recorded is not None:
            if self.replayed == len(self.recorded):
                raise SystemExit(
                    f"--lengths: the run recorded {len(self.recorded)} groups and the model issues more; model fewer "
                    "--steps (in async mode, replay a run of more steps than the model's: see --help)"
                )
            lengths = self.recorded[self.replayed]  # within max_new_tokens: replayed_groups checked the run's cap
            self.replayed += 1
            return lengths, float(lengths.max())
        history = self.policy.hold_on == "history"
        epochs = self.e.response_tokens.draw_epochs(self.rng, self.shape.samples, 2 if history else 1)
        cut = np.minimum(np.maximum(np.round(epochs), 1), self.shape.max_new_tokens)
        return cut[-1], float(cut[0].max())

    def replace(self) -> None:
        """Order a group in place of one taken or dropped: in the on-policy modes for the next step, else now unless
        held groups went in its stead."""
        if self.on_policy:
            self.next_step += 1
        elif self.owed:
            self.owed -= 1
        else:
            self.issue()

    def issue(self, lengths: np.ndarray | None = None) -> None:
        """Issue a group: ``lengths``, else one drawn (with ``--hold-long``, a long one drawn is held for the next sync
        and another drawn)."""
        while lengths is None:
            lengths, longest = self._draw()
            if self.policy.hold_long and longest >= self.policy.hold_long and self.now > self.served_at[-1]:
                self.held.append(lengths)
                lengths = None
        g = len(self.version_of)
        self.version_of.append(self.version)
        self.issued_at.append(self.now)
        self.decoded_of = np.append(self.decoded_of, 0.0)
        self.running_of.append(len(lengths))
        self.tokens_of.append(float(lengths.sum()))
        self.longest_of.append(float(lengths.max()))
        home = -1
        if self.policy.name == "groups":  # the replica holding the fewest groups in flight
            live = self.alive & (self.replica >= 0)
            homes, _ = np.unique(np.stack([self.replica[live], self.group[live]]), axis=1)
            home = int(np.argmin(np.bincount(homes, minlength=self.replicas)))
        n = len(lengths)
        self.length = np.concatenate([self.length, lengths])
        self.left = np.concatenate([self.left, lengths])
        self.replica = np.concatenate([self.replica, np.full(n, home)])
        self.start = np.concatenate([self.start, np.full(n, self.now)])
        self.group = np.concatenate([self.group, np.full(n, g)])
        self.alive = np.concatenate([self.alive, np.ones(n, bool)])
        self.chunk_end = np.concatenate([self.chunk_end, np.zeros(n)])
        if self.policy.name == "length_aware":  # request i is completion i of the arrays above
            first = len(self.requests)
            self.requests += [self._request(g, k, int(lengths[k])) for k in range(n)]
            for i in range(first, first + n):
                self._submit(i)

    def _request(self, g: int, k: int, length: int) -> Request:
        """Completion ``k`` of group ``g``, which will decode ``length`` tokens (known to the dispatcher with
        ``--oracle``)."""
        probe = k < self.policy.schedule.probes
        return KnownRequest(g, probe, length=length) if self.policy.oracle else Request(g, probe)

    def _submit(self, i: int) -> None:
        """Queue request ``i`` (a completion, or its next chunk) with the job's dispatcher."""
        self.replica[i] = -1

        def start(url: str | None) -> bool:
            assert url is not None, "the model's replicas are usable whenever it dispatches"
            if not self.alive[i]:
                return False
            to, decoded = int(url), self.length[i] - self.left[i]
            if decoded and self.requests[i].last != url:  # a continuation elsewhere prefills its output first
                self.hold[to] = max(self.hold[to], self.now) + decoded / self.e.prefill_tokens_per_s
            self.replica[i] = to
            self.chunk_end[i] = self.left[i] - asked
            return True

        self.requests[i].decoded = int(round(self.length[i] - self.left[i]))
        asked = min(self.dispatcher.asked(self.requests[i], math.ceil(self.left[i])), self.left[i])
        self.dispatcher.submit(self.requests[i], start)

    def restart(self, g: int) -> None:
        members = np.nonzero(self.group == g)[0]
        self._stop(g)
        lengths, _ = self._draw()
        self.length[members], self.left[members], self.start[members], self.alive[members] = (
            lengths,
            lengths,
            self.now,
            True,
        )
        if self.policy.name != "groups":
            self.replica[members] = -1
        self.version_of[g], self.issued_at[g], self.running_of[g] = self.version, self.now, len(members)
        self.lost, self.decoded_of[g] = self.lost + self.decoded_of[g], 0.0
        self.tokens_of[g], self.longest_of[g] = float(lengths.sum()), float(lengths.max())
        if self.policy.name == "length_aware":  # new requests: the dispatcher saw the old ones end
            self.chunk_end[members] = 0.0
            for k, i in enumerate(members):
                self.requests[i] = self._request(g, k, int(lengths[k]))
                self._submit(i)

    def issue_points(self, fate: str) -> list[float]:
        """Where in its version's step each group of ``fate`` was issued: those of the fill (all issued at once, before
        any step) and those whose version is still served left out. A group restarted at a sync counts as issued
        there."""
        points = []
        for g in self.fates[fate]:
            v = self.version_of[g]
            if 0 < v and v + 1 < len(self.served_at):
                points.append((self.issued_at[g] - self.served_at[v]) / (self.served_at[v + 1] - self.served_at[v]))
        return points

    def untrained_share(self) -> float:
        """The share of the tokens decoded for groups that ended (trained or dropped) that no step trained: dropped
        groups' and restarts' lost output."""
        trained = float(self.decoded_of[self.fates["trained"]].sum())
        untrained = float(self.decoded_of[self.fates["dropped"]].sum()) + self.lost
        return untrained / (trained + untrained)

    def drop(self, g: int) -> None:
        self.dropped += 1
        self.fates["dropped"].append(g)

    def cancel(self, g: int) -> None:
        self._stop(g)
        self.running_of[g] = -1

    def _stop(self, g: int) -> None:
        """Group ``g``'s requests end where they are; under length_aware the dispatcher forgets them and the group's
        lengths. They are marked dead first, so a slot freed here goes to no sibling."""
        members = np.nonzero(self.group == g)[0]
        live = members[self.alive[members]]
        self.alive[members] = False
        if self.policy.name == "length_aware":
            for i in live:
                if self.replica[i] < 0:
                    self.dispatcher.withdraw(self.requests[i])
            for i in live:
                if self.replica[i] >= 0:
                    self.dispatcher.finish(self.requests[i])
            self.lengths.forget(g)

    def route(self) -> None:
        """Place the requests waiting for a replica; move old ones (``migrate``)."""
        p = self.policy
        if p.name in ("groups", "length_aware"):
            return
        placed = self.alive & (self.replica >= 0)
        running = np.bincount(self.replica[placed], minlength=self.replicas)
        old = placed & (self.now - self.start > p.old_after_s)
        kept = np.zeros(self.replicas, bool)
        if p.name == "migrate":
            kept[self.replicas - max(1, round(self.replicas * p.tail_share)) :] = True
            for i in np.nonzero(old & ~kept[np.maximum(self.replica, 0)])[0]:
                free = np.nonzero(kept & (running < p.cap))[0]
                if not len(free):
                    break
                to = free[np.argmin(running[free])]
                running[self.replica[i]] -= 1
                running[to] += 1
                self.replica[i] = to
                decoded = self.length[i] - self.left[i]  # re-sent as prompt: the new replica prefills it first
                self.hold[to] = max(self.hold[to], self.now) + decoded / self.e.prefill_tokens_per_s
        holding_old = np.zeros(self.replicas, bool)
        holding_old[self.replica[old]] = True
        for i in np.nonzero(self.alive & (self.replica < 0))[0]:
            limit = (
                np.where(holding_old, p.cap, self.e.max_running_requests)
                if p.name == "capped"
                else self.e.max_running_requests
            )
            may = ~kept & (running < limit)
            if not may.any():
                return
            options = np.nonzero(may)[0]
            to = options[np.argmin(running[options])]
            self.replica[i] = to
            running[to] += 1

    # ---- the loop -----------------------------------------------------------------------------------
    def run(self, steps: int) -> list[dict]:
        s, B = self.shape, self.shape.groups
        for _ in range(self.in_flight):
            self.issue()
        ready: list[int] = []
        taken: list[int] = []
        phase, phase_end, busy_until, paused_at = "collect", math.inf, 0.0, 0.0
        records = []
        while len(records) < steps or "ended" not in records[-1]:
            self.route()
            self._decode(phase_end, ready)
            if phase == "collect":
                # sync mode takes the step's groups once all have ended, so training starts then
                while ready and len(taken) < B and (s.mode != "sync" or len(ready) + len(taken) == B):
                    g = ready.pop(0)
                    self.replace()
                    if self.version - self.version_of[g] > s.staleness:
                        self.drop(g)
                        continue
                    self.fates["trained"].append(g)
                    taken.append(g)
                    busy_until = max(busy_until, self.now) + self.t.seconds(self.tokens_of[g], s.trainer_gpus)
                if len(taken) == B:
                    records.append(
                        {
                            "rollout/samples": B * s.samples,
                            "rollout/response_len_mean": float(np.mean([self.tokens_of[g] for g in taken])) / s.samples,
                            "rollout/response_len_max": max(self.longest_of[g] for g in taken),
                        }
                    )
                    phase, phase_end, taken = "train", busy_until + self.t.optimizer_step_s, []
                    self.collected_at.append(self.now)
            elif phase == "train" and self.now >= phase_end - 1e-9:
                phase, phase_end, self.paused, paused_at = "sync", self.now + self.sync_s, True, self.now
            elif phase == "sync" and self.now >= phase_end - 1e-9:
                self.paused, self.version, phase, phase_end, busy_until = (
                    False,
                    self.version + 1,
                    "collect",
                    math.inf,
                    self.now,
                )
                self.served_at.append(self.now)
                records[-1]["ended"] = self.now
                self._at_sync(paused_at)
                for lengths in self.held:  # their windows open now
                    self.issue(lengths)
                if len(records) < steps:  # no step takes groups ordered after the last
                    for _ in range(self.next_step):
                        self.issue()
                self.next_step = 0
                self.owed, self.held = self.owed + len(self.held), []
                if self.policy.abort_predicted is not None:
                    self._abort_predicted(range(len(self.version_of)))
        return records

    def _decode(self, phase_end: float, ready: list[int]) -> None:
        """Decode up to the next event (a request done, ``phase_end``, an age check, a replica done prefilling); the
        groups whose last request finished join ``ready``."""
        live = np.nonzero(self.alive & (self.replica >= 0))[0]
        if len(live) and not self.paused:
            running = np.bincount(self.replica[live], minlength=self.replicas)
            if running.max() > self.e.max_running_requests:
                raise SystemExit(
                    f"a replica would run {running.max()} requests, more than max_running_requests "
                    f"{self.e.max_running_requests}: this model does not queue them"
                )
            rate = self.per_request[running[self.replica[live]]] * (self.hold[self.replica[live]] <= self.now)
            moving = rate > 0
            to_go = self.left[live] - self.chunk_end[live]  # to the chunk's end (0: the completion's)
            until_done = (to_go[moving] / rate[moving]).min() if moving.any() else math.inf
        else:
            rate, until_done = None, math.inf
        routes_by_age = self.policy.name in ("capped", "migrate")
        wake = [until_done, phase_end - self.now, AGE_CHECK_S if routes_by_age else math.inf]
        wake += [h - self.now for h in self.hold if h > self.now]
        dt = max(0.0, min(wake))
        if dt == math.inf:
            raise RuntimeError("the model stalled: nothing decodes and the trainer waits")  # a bug of the model
        if rate is not None:
            self.left[live] -= rate * dt
            self.decoded_of += np.bincount(self.group[live], weights=rate * dt, minlength=len(self.decoded_of))
        self.now += dt
        if rate is not None:
            for i in live[self.left[live] - self.chunk_end[live] <= 1e-6]:
                if not self.alive[i]:  # its group was aborted as another of its completions finished
                    continue
                if self.policy.name == "length_aware":
                    self.dispatcher.finish(self.requests[i])
                    if self.left[i] > 1e-6:  # a chunk ended: its next one queues
                        self._submit(i)
                        continue
                    self.lengths.add(self.group[i], int(self.length[i]))
                self.alive[i] = False
                g = self.group[i]
                self.running_of[g] -= 1
                if self.running_of[g] == 0:
                    ready.append(g)
                    self.lengths.forget(g)
                elif self.policy.abort_predicted is not None:
                    self._abort_predicted([g])

    def _deadline(self, v: int) -> float:
        """When a group issued under version ``v`` is predicted to be too late to be trained: the end of the collect
        phase of version v + max_staleness, from the mean step so far (inf before two steps have ended)."""
        if len(self.served_at) < 3:
            return math.inf
        after = np.mean([self.served_at[k + 1] - self.collected_at[k] for k in range(1, len(self.served_at) - 1)])
        last = v + self.shape.staleness  # the last version whose step may take it
        if last < self.version:
            return -math.inf
        return self.served_at[-1] + (last + 1 - self.version) * self.step_s - float(after)

    @property
    def step_s(self) -> float:
        """The mean step so far, the fill's left out."""
        return float(np.diff(self.served_at[1:]).mean()) if len(self.served_at) >= 3 else math.inf

    def _abort_predicted(self, groups: Iterable[int]) -> None:
        """Abort each of ``groups`` predicted to outrun its window by more than ``abort_predicted`` times the time left
        to it (the module's docstring), and order another."""
        tail_rate = self.per_request[max(1, self.policy.schedule.tail_running)]
        for g in groups:
            if self.running_of[g] <= 0 or g not in self.lengths.finished:
                continue
            deadline = self._deadline(self.version_of[g])
            if deadline == math.inf:
                continue
            members = np.nonzero((self.group == g) & self.alive)[0]
            predicted = self.lengths.predicted(g)
            left = np.maximum(predicted - (self.length[members] - self.left[members]), 0.0)
            running = np.bincount(self.replica[self.alive & (self.replica >= 0)], minlength=self.replicas)
            rate = np.where(
                self.replica[members] >= 0,
                np.maximum(self.per_request[running[np.maximum(self.replica[members], 0)]], tail_rate),
                tail_rate,
            )
            finish = self.now + float((left / rate).max()) * self.step_s / (self.step_s - self.sync_s)  # syncs pause it
            if finish > deadline + self.policy.abort_predicted * max(deadline - self.now, 0.0):
                self.cancel(g)
                self.drop(g)
                self.aborted += 1
                self.replace()

    def _at_sync(self, paused_at: float) -> None:
        p, s = self.policy, self.shape
        for g in range(len(self.version_of)):
            if self.running_of[g] <= 0:
                continue
            if p.abort_doomed and self.version - self.version_of[g] > s.staleness:
                self.cancel(g)
                self.drop(g)
                self.replace()
            elif p.restart_young_s > 0 and self.issued_at[g] >= paused_at - p.restart_young_s:
                self.restart(g)


def one(
    profile: Profile, shape: Shape, policy: Policy, seed: int, steps: int, recorded: list[np.ndarray] | None = None
) -> dict:
    loop = AsyncLoop(profile, shape, policy, seed, recorded)
    records = loop.run(steps)
    ends = [r["ended"] for r in records]
    measured = records[1:]  # the first step fills the pipeline, as in bench/simulation.py
    seconds = ends[-1] - ends[0]
    trained = sum(r["rollout/samples"] for r in measured)
    times = [
        step_times(
            profile,
            (shape.trainer_gpus, shape.engine_gpus),
            r["rollout/samples"],
            r["rollout/response_len_mean"],
            r["rollout/response_len_max"],
            shape.model_gb * 1e9,
            loop.in_flight * shape.samples,
            0 if loop.on_policy else shape.staleness,
        )
        for r in measured
    ]
    bound = bounds(times, trained, shape.groups)[f"{shape.mode}_tail"]
    rate = trained / seconds
    trained_tokens = sum(r["rollout/samples"] * r["rollout/response_len_mean"] for r in measured)
    guide = math.nan  # async's: the on-policy modes run a step's requests together
    if not loop.on_policy:
        guide, _ = one_concurrency_guide(
            profile,
            (shape.trainer_gpus, shape.engine_gpus),
            trained,
            trained_tokens,
            sum(r["rollout/response_len_max"] for r in measured),
            times,
            shape.staleness,
        )
    points = {fate: float(np.median(p)) if (p := loop.issue_points(fate)) else math.nan for fate in loop.fates}
    return {
        "rate": rate,
        "bound": bound,
        "ratio": rate / bound,
        "guide": guide / bound,
        "untrained": loop.untrained_share(),
        **{k: sum(t[k] for t in times) for k in ("T_gen", "T_tail", "T_train")},
        "dropped": loop.dropped,
        "aborted": loop.aborted,
        "point_trained": points["trained"],
        "point_dropped": points["dropped"],
        "longest": float(np.mean([r["rollout/response_len_max"] for r in measured])),
        "step_s": np.diff([0.0, *ends]),  # each step's, the first included
    }


def replayed_groups(run_dir: Path, shape: Shape) -> list[np.ndarray]:
    """``--lengths``: the groups ``run_dir``'s job recorded, in index order, each its responses' lengths. The run's
    groups must be the model's shape (``--samples``, ``--max-new-tokens``) and numbered 0, 1, ... with none missing, so
    that the model's k-th group is the job's."""
    try:
        records = sorted(read_lengths(run_dir), key=lambda r: r.group)
    except CalibrationError as e:
        raise SystemExit(f"--lengths: {e}") from e
    for i, r in enumerate(records):
        if r.group != i:
            raise SystemExit(
                f"--lengths: {run_dir} has no group {i} (next: {r.group}); the model replays a run's groups in "
                "index order, and a gap would shift every later one"
            )
        if len(r.lengths) != shape.samples or r.max_new_tokens != shape.max_new_tokens or r.episodes:
            raise SystemExit(
                f"--lengths: group {i} of {run_dir} has {len(r.lengths)} responses of at most {r.max_new_tokens} "
                f"tokens{' (an agentic group)' if r.episodes else ''}; the model's are --samples {shape.samples} and "
                f"--max-new-tokens {shape.max_new_tokens}, single requests"
            )
    return [np.array(r.lengths, dtype=float) for r in records]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=str(REPO / "bench" / "profiles" / "qwen3_30b_a3b_h100.yaml"))
    p.add_argument("--pool", default="32:96", help="trainer GPUs:engine GPUs")
    p.add_argument("--groups", type=int, default=96, help="groups a step trains (rollout.groups_per_step)")
    p.add_argument("--samples", type=int, default=8, help="completions a group (rollout.samples_per_prompt)")
    p.add_argument("--max-staleness", type=int, default=2, help="rollout.max_staleness")
    p.add_argument(
        "--mode", choices=("async", "sync", "periodic"), default="async", help="the loop modelled (see above)"
    )
    p.add_argument("--max-new-tokens", type=int, default=32768, help="responses are cut here")
    p.add_argument(
        "--model-gb", type=float, default=61.1, help="the weights a sync moves (Qwen3-30B-A3B in BF16: 61.1 GB)"
    )
    p.add_argument("--steps", type=int, default=10, help="trainer steps a run; the first is not measured")
    p.add_argument("--seeds", type=int, help="runs a policy, their means reported (default 3)")
    p.add_argument("--per-seed", action="store_true", help="a column of each seed's samples/s, seed 0 first")
    p.add_argument(
        "--lengths", type=Path, metavar="RUN_DIR", help="replay this run's recorded groups (see above), once"
    )
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}")
    p.add_argument(
        "--depth",
        type=float,
        nargs="+",
        default=[1.0],
        help="groups in flight, a multiple of groups x max(1, max staleness)",
    )
    p.add_argument(
        "--old-after", type=float, default=150.0, help="capped, migrate: seconds after which a request is old"
    )
    p.add_argument("--cap", type=int, default=8, help="capped, migrate: running requests of a replica holding old ones")
    p.add_argument(
        "--tail-share", type=float, default=1 / 6, help="migrate: the share of the replicas kept for old requests"
    )
    p.add_argument("--restart-young", type=float, nargs="+", default=[0.0], help="seconds (0: off); see above")
    p.add_argument("--abort-doomed", action="store_true", help="see above")
    p.add_argument("--oracle", action="store_true", help="length_aware; see above")
    p.add_argument("--hold-long", type=int, default=0, help="tokens (0: off); see above")
    p.add_argument(
        "--hold-on",
        choices=("drawn", "history"),
        default="drawn",
        help="--hold-long judges a group by its own longest completion (drawn), or by its prompt's one epoch before",
    )
    p.add_argument("--abort-predicted", type=float, metavar="M", help="length_aware, off without; see above")
    p.add_argument(
        "--correlations",
        type=float,
        nargs="+",
        help="the profile's engine.response_tokens.correlation replaced by each (default: the profile's)",
    )
    p.add_argument("--probes", type=int, default=1, help="length_aware: rollout.schedule.probes")
    p.add_argument(
        "--max-running", type=int, nargs="+", default=[0], help="length_aware: rollout.schedule.max_running, each"
    )
    p.add_argument(
        "--chunk-tokens", type=int, nargs="+", default=[0], help="length_aware: rollout.schedule.chunk_tokens, each"
    )
    p.add_argument(
        "--tail-tokens", type=int, nargs="+", default=[0], help="length_aware: rollout.schedule.tail_tokens, each"
    )
    p.add_argument("--tail-running", type=int, default=8, help="length_aware: rollout.schedule.tail_running")
    p.add_argument("--out", help="a markdown file the table is appended to (it is printed either way)")
    args = p.parse_args()
    base = Profile.load(args.profile)
    trainer_gpus, engine_gpus = (int(x) for x in args.pool.split(":"))
    shape = Shape(
        trainer_gpus,
        engine_gpus,
        args.groups,
        args.samples,
        args.max_staleness,
        args.max_new_tokens,
        args.model_gb,
        args.mode,
    )
    async_only = {
        "--depth": args.depth != [1.0],
        "--restart-young": args.restart_young != [0.0],
        "--abort-doomed": args.abort_doomed,
        "--abort-predicted": args.abort_predicted is not None,
        "--hold-long": bool(args.hold_long),
    }
    if args.mode != "async" and any(async_only.values()):
        asked = ", ".join(flag for flag, given in async_only.items() if given)
        raise SystemExit(f"{asked}: async mode only ({args.mode} mode issues a step's groups together at its sync)")
    recorded, seeds = None, args.seeds or 3
    correlations: list[float | None] = list(args.correlations or [base.engine.response_tokens.correlation])
    if args.lengths is not None:
        refused = {"--seeds": args.seeds is not None, "--correlations": bool(args.correlations)}
        refused["--hold-on history"] = args.hold_on == "history"  # a run records one epoch of a prompt
        if any(refused.values()):
            given = ", ".join(flag for flag, on in refused.items() if on)
            raise SystemExit(f"{given}: not with --lengths, which replays the run's own draw once")
        recorded, seeds, correlations = replayed_groups(args.lengths, shape), 1, [None]
    drawn = f"mean of {seeds} seeds" if recorded is None else f"the draw of {args.lengths} ({len(recorded)} groups)"
    optional = (("samples/s, seed by seed", args.per_seed), ("step seconds", recorded is not None))
    extra_columns = [column for column, shown in optional if shown]
    lines = [
        f"## {args.mode.capitalize()} loop, modelled: {base.name}, pool {args.pool}, {args.groups} x {args.samples} "
        f"samples per step, max staleness {args.max_staleness}, {args.steps} steps (the first not measured), {drawn}",
        "",
        "| correlation | policy | schedule (probes / max running / chunk / tail tokens / tail running) | depth | "
        "restart young (s) | abort doomed | abort predicted | samples/s (model) | "
        "the bound's T_gen / T_tail / T_train (s) | bound, tail counted | ratio | the guide's ratio | "
        "decoded, not trained | dropped as stale (aborted as predicted late) | "
        "longest trained | issue point, trained / dropped (median) |" + "".join(f" {c} |" for c in extra_columns),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(extra_columns),
    ]
    for name in args.policies.split(","):
        if name not in POLICIES:
            raise SystemExit(f"--policies: {name!r} is not one of {', '.join(POLICIES)}")
        if args.oracle and name != "length_aware":
            raise SystemExit(f"--oracle: length_aware only (its dispatcher is told the lengths), not {name}")
        if args.abort_predicted is not None and name != "length_aware":
            raise SystemExit(f"--abort-predicted: length_aware only (it predicts from finished siblings), not {name}")
    predicted = "-" if args.abort_predicted is None else f"{args.abort_predicted:g}"
    held = f", held from {args.hold_long} ({args.hold_on})" if args.hold_long else ""
    for rho, name, depth, young in itertools.product(
        correlations, args.policies.split(","), args.depth, args.restart_young
    ):
        profile = base
        if rho is not None:
            lengths = base.engine.response_tokens.model_copy(update={"correlation": rho})
            profile = base.model_copy(update={"engine": base.engine.model_copy(update={"response_tokens": lengths})})
        schedules = (
            itertools.product(args.max_running, args.chunk_tokens, args.tail_tokens)
            if name == "length_aware"
            else [(0, 0, 0)]
        )
        for max_running, chunk, tail in schedules:
            scheduled = ScheduleSection(
                policy="length_aware",
                probes=args.probes,
                chunk_tokens=chunk,
                max_running=max_running,
                tail_tokens=tail,
                tail_running=args.tail_running,
            )
            policy = Policy(
                name,
                depth,
                args.old_after,
                args.cap,
                args.tail_share,
                young,
                abort_doomed=args.abort_doomed,
                abort_predicted=args.abort_predicted,
                oracle=args.oracle,
                hold_long=args.hold_long,
                hold_on=args.hold_on,
                schedule=scheduled,
            )
            runs = [one(profile, shape, policy, seed, args.steps, recorded) for seed in range(seeds)]
            mean = {k: float(np.mean([r[k] for r in runs])) for k in runs[0] if k != "step_s"}
            schedule = (
                f"{args.probes} / {max_running} / {chunk} / {tail} / {args.tail_running}"
                if name == "length_aware"
                else "-"
            )
            by_seed = " " + " / ".join(f"{r['rate']:.4f}" for r in runs) + " |" if args.per_seed else ""
            steps = "" if recorded is None else " " + " / ".join(f"{t:.1f}" for t in runs[0]["step_s"]) + " |"
            correlation = "the run" if rho is None else f"{rho:g}"
            lines.append(
                f"| {correlation} | {name}{' (oracle)' if args.oracle else ''}{held} | {schedule} | {depth:g} | "
                f"{young:g} | "
                f"{'yes' if args.abort_doomed else 'no'} | "
                f"{predicted} | "
                f"{mean['rate']:.2f} | {mean['T_gen']:.0f} / {mean['T_tail']:.0f} / {mean['T_train']:.0f} | "
                f"{mean['bound']:.2f} | {mean['ratio']:.2f} | {mean['guide']:.2f} | {mean['untrained']:.2f} | "
                f"{mean['dropped']:.0f} ({mean['aborted']:.0f}) | "
                f"{mean['longest']:.0f} | {mean['point_trained']:.2f} / {mean['point_dropped']:.2f} |{by_seed}{steps}"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
