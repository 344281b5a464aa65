"""Which engine replicas may take requests: every replica's health state and how it changes.

A replica is ``healthy`` (takes requests), ``suspect`` (a request to it failed in transport or ran past its
deadline: it takes none until a probe says more), ``dead`` (``/health`` failed ``failures_to_dead`` probes in a
row, or its process exited), ``restarting`` (its process is being started again) or ``stale`` (it answers, but
does not hold the policy the others serve: it takes requests again only once it reports that weight version).
Requests go to healthy replicas only, so a hung replica (alive, not answering) is caught by its requests'
deadlines and taken out of rotation like a crashed one. Every change is logged with the replica and the reason.
A replica paused (its /health fails, it answers /model_info) is not down: waits for one are not cut short
(:class:`Probes`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

log = logging.getLogger("moerl.engines")


class State(StrEnum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    DEAD = "dead"
    RESTARTING = "restarting"
    STALE = "stale"


def names_a_policy(weight_version: str) -> bool:
    """Whether a full-weight job's sync could have left ``weight_version``: it names each policy by its step number.
    A replica restarted on the base model reports what it started with (SGLang: "default")."""
    return weight_version.isdecimal()


@dataclass
class Replica:
    url: str
    state: State = State.HEALTHY
    failed_probes: int = 0  # consecutive /health failures since it was last seen answering
    reason: str = ""  # why it left the healthy state


@dataclass
class ReplicaHealth:
    """The health table of a set of replicas (one per client)."""

    urls: list[str]
    failures_to_dead: int = 3
    replicas: dict[str, Replica] = field(init=False)
    # What the last weight sync reached, which a replica out of rotation must hold to come back: the weight version
    # it left (None: not known yet, or a LoRA run, whose base weights keep theirs) and the engines (None: all).
    served: str | None = None
    synced: set[str] | None = None
    # Per replica, how many times what it holds changed in this table's view (a sync reached it, or it lost what
    # the syncs left): an answer read against an older count may describe the replica as it was before.
    epochs: dict[str, int] = field(init=False)
    # Per replica, how many times it lost what the syncs left (restarted, dead, or found serving something else):
    # the trainer reads losses from these counts, which no sequence of states between two reports can hide.
    losses: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.replicas = {url: Replica(url) for url in self.urls}
        self.epochs = dict.fromkeys(self.urls, 0)
        self.losses = dict.fromkeys(self.urls, 0)

    def usable(self) -> list[str]:
        return [url for url, r in self.replicas.items() if r.state is State.HEALTHY]

    def state(self, url: str) -> State:
        return self.replicas[url].state

    def set(self, url: str, state: State, reason: str) -> None:
        replica = self.replicas[url]
        if replica.state is state:
            return
        level = logging.INFO if state is State.HEALTHY else logging.WARNING
        log.log(level, "engine %s: %s -> %s (%s)", url, replica.state.value, state.value, reason)
        replica.state, replica.reason = state, reason
        if state is State.HEALTHY:
            replica.failed_probes = 0

    def request_failed(self, url: str, reason: str) -> None:
        """A request to ``url`` failed in transport or past its deadline."""
        if self.replicas[url].state is State.HEALTHY:
            self.set(url, State.SUSPECT, reason)

    def restarted(self, url: str) -> None:
        """The job started ``url``'s process again: it holds what it started from (the base weights, no adapter), so
        once it answers it is stale until a weight sync reaches it."""
        self.set(url, State.RESTARTING, "the job started its process again")
        self._forget(url)

    def lost_policy(self, url: str, reason: str, epoch: int) -> None:
        """A request sent when ``url``'s epoch was ``epoch`` found it without what the syncs left there (an answer
        under a weight version no sync gave, an adapter it no longer holds): its process restarted between two
        probes, or after the request chose it. Unless a sync has reached it since (the answer predates that)."""
        if self.epochs[url] == epoch:
            self.set(url, State.STALE, reason)
            self._forget(url)

    def foreign_version(self, versions: Iterable[str]) -> str | None:
        """The first of these weight ``versions`` (of a replica's answer) that no weight sync of this job names
        (:func:`names_a_policy`), None if there is none. Not known (LoRA runs, a client outside a job): None."""
        if self.served is None:
            return None
        return next((v for v in versions if not names_a_policy(v)), None)

    def _forget(self, url: str) -> None:
        """``url`` holds none of what the syncs left: it is stale until the next one reaches it."""
        self.epochs[url] += 1
        self.losses[url] += 1
        if self.synced is not None:
            self.synced.discard(url)

    def sync_reached(self, version: str | None, engines: list[str], also: bool = False) -> None:
        """A weight sync left ``version`` on ``engines``; a healthy replica it missed (it answered too late for the
        sync) holds the previous policy. ``also``: it brought them the policy the last sync left (a catch-up), which
        those that sync reached still hold."""
        for url in engines:
            self.epochs[url] += 1
        if also and self.synced is not None:
            self.synced |= set(engines)
            return
        self.served, self.synced = version, set(engines)
        for url in self.usable():
            if url not in self.synced:
                self.set(url, State.STALE, "the last weight sync did not reach it")

    def probed(self, url: str, answered: bool, version: str | None) -> None:
        """A /health probe of a replica out of rotation: ``answered`` and, if so, the weight ``version`` it reports.
        It is back once the last sync reached it and it reports what that sync left."""
        replica = self.replicas[url]
        if not answered:
            replica.failed_probes += 1
            if replica.state in (State.SUSPECT, State.STALE) and replica.failed_probes >= self.failures_to_dead:
                self.set(url, State.DEAD, f"/health failed {replica.failed_probes} times in a row")
                # it may come back restarted by someone else (an engine given by URL), holding nothing
                self._forget(url)
            return
        replica.failed_probes = 0
        if self.synced is not None and url not in self.synced:
            self.set(url, State.STALE, "up, but the last weight sync did not reach it")
        elif self.served is None or version == self.served:
            self.set(url, State.HEALTHY, f"answers and serves weight version {version}")
        else:  # a sync reached it, and it serves something else now: restarted unseen (an engine given by URL)
            self.set(url, State.STALE, f"answers but serves weight version {version}, not {self.served}")
            self._forget(url)


class Probed(Protocol):
    """What :class:`Probes` asks of an :class:`~moerl.engines.client.EngineClient` (which imports this module)."""

    urls: list[str]
    health: ReplicaHealth

    async def probe_out_of_rotation(self) -> None: ...

    async def healthy(self, paused: bool = False) -> list[bool]: ...


class Probes:
    """The probes of ``client``'s replicas out of rotation, made at most once per ``interval_s`` however many callers
    ask. Awaited, it says whether none is usable because one is paused: its /health fails (SGLang's waits on a paused
    scheduler) yet it answers /model_info, as colocated replicas do while the trainer trains. As the ``meanwhile`` of
    :meth:`~moerl.engines.client.EngineClient.until_usable` it keeps such a wait, however long, from counting as the
    replicas being down."""

    def __init__(self, client: Probed, interval_s: float):
        self.client, self.interval_s = client, interval_s
        self._probing, self._probed_at = asyncio.Lock(), -math.inf
        self._paused = False  # what the last probe found

    async def __call__(self) -> bool:
        async with self._probing:
            if time.monotonic() - self._probed_at >= self.interval_s:
                await self.client.probe_out_of_rotation()
                self._paused = await self._paused_with_none_usable()
                self._probed_at = time.monotonic()
            return self._paused

    async def _paused_with_none_usable(self) -> bool:
        health = self.client.health
        if health.usable():
            return False
        # /model_info of each: a replica that answers it and failed its last /health probe is paused, not down (one
        # that answered /health is back, or stale until a weight sync reaches it)
        answers = await self.client.healthy(paused=True)
        return any(up and health.replicas[url].failed_probes for url, up in zip(self.client.urls, answers, strict=True))


class SameAnswer:
    """A run's requests that the engines answer, every one of them, with the same server error (a 5xx and its message:
    a feature the server cannot serve, a model it cannot run), nothing served between. Each such failure looks like a
    replica's: it is re-issued elsewhere, the replica is back at its next /health, and a prompt dropped after its
    retries is replaced by the next, which fails the same way, for ever. :meth:`failed` says when it is the run's end
    instead: ``bound`` failures in a row (a prompt's retries on every replica) with one message, from every replica."""

    def __init__(self, urls: Iterable[str], bound: int):
        self.urls, self.bound = set(urls), bound
        self.message: str | None = None
        self.count = 0
        self.seen: set[str] = set()

    def served(self) -> None:
        self.message, self.count, self.seen = None, 0, set()

    def failed(self, url: str, status: int | None, message: str) -> bool:
        """A request to ``url`` failed with ``status`` (None: in transport, no answer) and ``message``; whether every
        replica has now answered the same error past the bound."""
        if status is None or status < 500:  # not the same error answered: the streak starts again
            self.served()
            return False
        if message != self.message:
            self.message, self.count, self.seen = message, 0, set()
        self.count += 1
        self.seen.add(url)
        return self.count >= self.bound and self.seen >= self.urls
