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
   (a group with none finished is predicted to run to ``max_new_tokens``).

Each goes to the usable replica with the fewest predicted tokens left to decode among its running requests (a
continuation stays where its last chunk ran unless another replica has fewer): a request's prediction is its group's
less what it has decoded, at most a chunk. With ``max_running`` a replica runs at most that many of the manager's
requests and the rest wait here in that order; without, every request goes at once.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field


@dataclass
class GroupLengths:
    """The lengths of each live group's finished completions, and the prediction made from them."""

    max_new_tokens: int
    finished: dict[int, list[int]] = field(default_factory=dict)

    def predicted(self, group: int) -> int:
        """The tokens a completion of ``group`` is predicted to decode: the longest of its finished siblings, else
        ``max_new_tokens``."""
        done = self.finished.get(group)
        return max(done) if done else self.max_new_tokens

    def add(self, group: int, length: int) -> None:
        self.finished.setdefault(group, []).append(length)

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
    ``usable``: the replicas requests may go to now (the client's health); ``max_running``: requests of the manager's
    a replica runs at once (0: no bound); ``chunk_tokens``: the most one request decodes (0: no cut)."""

    def __init__(
        self, usable: Callable[[], list[str]], lengths: GroupLengths, max_running: int = 0, chunk_tokens: int = 0
    ):
        self.usable, self.lengths = usable, lengths
        self.max_running, self.chunk_tokens = max_running, chunk_tokens
        self.running: dict[str, list[Request]] = {}
        self.waiting: dict[int, tuple[Request, asyncio.Future[str | None]]] = {}
        self._orders = itertools.count()

    def predicted_left(self, request: Request) -> float:
        left = max(self.lengths.predicted(request.group) - request.decoded, 1)
        return min(left, self.chunk_tokens) if self.chunk_tokens else left

    def load(self, url: str) -> float:
        """Tokens the requests running on ``url`` are predicted to decode still (as predicted when each began)."""
        return sum(r.predicted_left for r in self.running.get(url, ()))

    @asynccontextmanager
    async def slot(self, request: Request) -> AsyncIterator[str | None]:
        """The replica ``request`` runs on (None: none is usable; the client then finds that out itself), held until
        the block ends."""
        request.order = next(self._orders)
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self.waiting[request.order] = (request, future)
        self._dispatch()
        try:
            url = await future
        except asyncio.CancelledError:
            self.waiting.pop(request.order, None)
            if future.done() and not future.cancelled() and future.result() is not None:
                self._leave(request)  # given a replica just as it was cancelled
            raise
        try:
            yield url
        finally:
            if url is not None:
                self._leave(request)

    def _leave(self, request: Request) -> None:
        assert request.last is not None, "a request that ran has a replica"
        self.running[request.last].remove(request)
        self._dispatch()

    def _free(self, urls: list[str]) -> list[str]:
        if not self.max_running:
            return urls
        return [u for u in urls if len(self.running.get(u, ())) < self.max_running]

    def _dispatch(self) -> None:
        """Start waiting requests, first in order first, while a replica has room."""
        while self.waiting:
            usable = self.usable()
            free = self._free(usable)
            if usable and not free:
                return
            order, (request, future) = min(self.waiting.items(), key=lambda item: item[1][0].rank(self.lengths))
            del self.waiting[order]
            if future.done():  # cancelled while it waited
                continue
            if not usable:
                future.set_result(None)
                continue
            url = min(free, key=lambda u: (self.load(u), u != request.last))
            request.predicted_left = self.predicted_left(request)
            self.running.setdefault(url, []).append(request)
            request.last = url
            future.set_result(url)
