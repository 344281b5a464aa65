"""The length-aware schedule (``rollout.schedule.policy=length_aware``): which of the manager's waiting requests goes
next, and to which replica.

A group's completions share a prompt, and their lengths are correlated (the simulator's profiles model it:
:mod:`moerl.simulation`), so the first of them to finish say how long the others will run (Seer, arXiv 2511.14617).
Each completion is a request of its own (:class:`~moerl.orchestrator.groups.SampleRequests`); the dispatcher here
orders them:

1. continuations first (the next chunk of a completion cut at ``rollout.schedule.chunk_tokens``: its group waits on
   it), oldest first;
2. then each group's probes (its first ``probes`` completions), oldest first;
3. then the rest, longest predicted group first, a group's prediction being the longest of its finished completions
   (a group with none finished is predicted the median of the last finished completions of all groups, or
   ``max_new_tokens`` until enough have finished).

Each goes to the usable replica with the fewest predicted tokens left to decode among its running requests (a
continuation stays where its last chunk ran unless another replica has fewer): a request's prediction is its group's
less what it has decoded, at most a chunk (a tail request's: all of it). With ``max_running`` a replica runs at most
that many of the manager's requests and the rest wait here in that order; without, every request goes at once.

With ``tail_tokens``, a request whose completion is predicted to run that many tokens in all (its group's prediction
from finished completions, or twice what it has decoded if more: a log-normal length that has run well past its median
has about as far again to go) is a tail request. In async mode a long completion must end within its staleness
window, and a request decodes faster the fewer its replica runs (three times faster alone than among 128 on the
profiles' engines), so a tail request goes to the replica running the fewest, and a replica running one takes other
requests only while it runs fewer than ``tail_running``. With chunks a completion's tail is found as it decodes, and
its next chunk moves; a tail request is not cut again: its replica is kept light for it, so a cut would only add a
round trip and a prefill of its output to the completion its group waits on (in sync mode, the one its step waits on).
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from moerl.orchestrator.config import ScheduleSection

RECENT = 1000  # finished completions the typical length is the median of
TYPICAL_AFTER = 32  # finished completions before their median stands for a group with none finished


@dataclass
class GroupLengths:
    """The lengths of each live group's finished completions, and the prediction made from them."""

    max_new_tokens: int
    finished: dict[int, list[int]] = field(default_factory=dict)
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT))  # every group's, newest last
    typical: int | None = None  # their median, once there are enough

    def predicted(self, group: int) -> int:
        """The tokens a completion of ``group`` is predicted to decode: the longest of its finished siblings, else the
        typical completion's (the median of the last ``RECENT``), else ``max_new_tokens``."""
        known = self.known(group)
        return self.max_new_tokens if known is None else known

    def known(self, group: int) -> int | None:
        """What finished completions say ``group``'s will decode (None: too few have finished to say)."""
        done = self.finished.get(group)
        return max(done) if done else self.typical

    def add(self, group: int, length: int) -> None:
        self.finished.setdefault(group, []).append(length)
        self.recent.append(length)
        if len(self.recent) >= TYPICAL_AFTER:
            self.typical = int(statistics.median_low(self.recent))

    def forget(self, group: int) -> None:
        self.finished.pop(group, None)


@dataclass
class Request:
    """One request of a completion, waiting for a replica or running on one."""

    group: int
    probe: bool  # one of its group's first completions
    decoded: int = 0  # tokens its completion decoded in earlier chunks (>0: a continuation)
    last: str | None = None  # the replica its completion's last chunk ran on
    order: int = 0  # when it began waiting
    predicted_left: float = 0.0  # what it counts for on its replica while it runs
    tail: bool = False  # a tail request (see tail_tokens), as Dispatcher.asked found it

    def rank(self, lengths: GroupLengths) -> tuple[int, int, int]:
        """Its place in the queue, first lowest: continuations, probes, then the rest longest predicted first; oldest
        first within each."""
        if self.decoded:
            return 0, 0, self.order
        if self.probe:
            return 1, 0, self.order
        return 2, -lengths.predicted(self.group), self.order


class Dispatcher:
    """Hands the manager's requests to replicas as :mod:`this module <moerl.orchestrator.scheduling>` says.
    ``usable``: the replicas requests may go to now (the client's health); ``schedule``: its bounds (max_running,
    chunk_tokens, tail_tokens, tail_running: :class:`~moerl.orchestrator.config.ScheduleSection`). A request is sized
    by :meth:`asked`, then run in :meth:`slot`."""

    def __init__(self, usable: Callable[[], list[str]], lengths: GroupLengths, schedule: ScheduleSection):
        self.usable, self.lengths, self.schedule = usable, lengths, schedule
        self.running: dict[str, list[Request]] = {}
        self.waiting: dict[int, tuple[Request, Callable[[str | None], bool]]] = {}
        self._orders = itertools.count()

    def predicted_left(self, request: Request) -> float:
        left = max(self.lengths.predicted(request.group) - request.decoded, 1)
        chunk = self.schedule.chunk_tokens
        return min(left, chunk) if chunk and not request.tail else left

    def asked(self, request: Request, budget: int) -> int:
        """The tokens ``request`` may decode of the ``budget`` its completion has left: at most ``chunk_tokens``,
        unless it is a tail request (decided here, before it is submitted, from what is known now)."""
        s = self.schedule
        request.tail = bool(s.tail_tokens) and self.predicted_total(request) >= s.tail_tokens
        return min(budget, s.chunk_tokens) if s.chunk_tokens and not request.tail else budget

    def predicted_total(self, request: Request) -> int:
        """The tokens ``request``'s completion is predicted to decode in all, from what has finished and what it has
        decoded (0 with neither: the ``max_new_tokens`` that orders groups with nothing finished is no evidence)."""
        return max(self.lengths.known(request.group) or 0, 2 * request.decoded)

    def load(self, url: str) -> float:
        """Tokens the requests running on ``url`` are predicted to decode still (as predicted when each began)."""
        return sum(r.predicted_left for r in self.running.get(url, ()))

    def submit(self, request: Request, start: Callable[[str | None], bool]) -> None:
        """Queue ``request``; ``start`` is called with its replica (None: none is usable) when its turn comes, and
        returns whether it was still wanted (False: its waiter went, and it takes no slot)."""
        request.order = next(self._orders)
        self.waiting[request.order] = (request, start)
        self._dispatch()

    def withdraw(self, request: Request) -> None:
        """``request`` no longer waits (its waiter was cancelled)."""
        self.waiting.pop(request.order, None)

    def finish(self, request: Request) -> None:
        """``request`` ran on its replica and ended: its slot goes to the next waiting."""
        assert request.last is not None, "a request that ran has a replica"
        self.running[request.last].remove(request)
        self._dispatch()

    @asynccontextmanager
    async def slot(self, request: Request) -> AsyncIterator[str | None]:
        """The replica ``request`` runs on (None: none is usable; the client then finds that out itself), held until
        the block ends."""
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

        def start(url: str | None) -> bool:
            if future.done():  # cancelled while it waited
                return False
            future.set_result(url)
            return True

        self.submit(request, start)
        try:
            url = await future
        except asyncio.CancelledError:
            self.withdraw(request)
            if future.done() and not future.cancelled() and future.result() is not None:
                self.finish(request)  # given a replica just as it was cancelled
            raise
        try:
            yield url
        finally:
            if url is not None:
                self.finish(request)

    def _free(self, urls: list[str]) -> list[str]:
        bound = self.schedule.max_running
        if not bound:
            return urls
        return [u for u in urls if len(self.running.get(u, ())) < bound]

    def _place(self, request: Request, free: list[str]) -> str | None:
        """The replica of ``free`` that ``request`` goes to (None: none of them takes it now)."""
        s = self.schedule
        if request.tail:
            return min(free, key=lambda u: (len(self.running.get(u, ())), u != request.last))
        if s.tail_tokens:
            free = [u for u in free if not self._holds_tail(u) or len(self.running[u]) < s.tail_running]
        return min(free, key=lambda u: (self.load(u), u != request.last), default=None)

    def _holds_tail(self, url: str) -> bool:
        return any(r.tail for r in self.running.get(url, ()))

    def _dispatch(self) -> None:
        """Start waiting requests, first in order first, while a replica has room for the first."""
        while self.waiting:
            usable = self.usable()
            free = self._free(usable)
            if usable and not free:
                return
            order, (request, start) = min(self.waiting.items(), key=lambda item: item[1][0].rank(self.lengths))
            if not usable:
                del self.waiting[order]
                start(None)
                continue
            url = self._place(request, free)
            if url is None:
                return
            del self.waiting[order]
            if start(url):
                request.predicted_left = self.predicted_left(request)
                self.running.setdefault(url, []).append(request)
                request.last = url
