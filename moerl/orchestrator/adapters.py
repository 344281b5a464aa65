"""A LoRA run's adapters on the engines: the one new requests use, and the older ones still loaded until no request
uses them."""

from __future__ import annotations

import logging

from moerl.engines.client import EngineClient, EngineError

log = logging.getLogger("moerl.rollout")


class Adapters:
    """The adapter new requests use and its policy version (none: the base model, version 0), how many requests use
    each adapter, and the older ones still loaded on ``client``'s engines."""

    def __init__(self, client: EngineClient):
        self.client = client
        self.current: tuple[str | None, int] = (None, 0)
        self.users: dict[str, int] = {}
        self.retired: set[str] = set()

    def serve(self, adapter: str, version: int) -> None:
        """New requests use ``adapter`` (policy ``version``) from now on; the one they used is retired, unless it is the
        same one again (re-served after a verify passed an engine over)."""
        if self.current[0] not in (None, adapter):
            self.retired.add(self.current[0])
        self.current = (adapter, version)
        log.info("new requests use adapter %s (policy version %d)", *self.current)

    def acquire(self) -> tuple[str | None, int]:
        """The current adapter and its version, counted as used by one more request until :meth:`release`."""
        adapter = self.current[0]
        if adapter is not None:
            self.users[adapter] = self.users.get(adapter, 0) + 1
        return self.current

    def release(self, adapter: str | None) -> None:
        if adapter is not None:
            self.users[adapter] -= 1

    async def unload_if_retired(self, adapter: str | None) -> None:
        """Unload what no request uses, once a request that used the retired ``adapter`` has ended."""
        if adapter in self.retired:
            await self.unload_unused()

    async def unload_unused(self) -> None:
        # Picked one at a time: other requests finishing during an unload call this too, and each adapter
        # must leave ``retired`` before anyone awaits its unload.
        while unused := sorted(n for n in self.retired if not self.users.get(n)):
            self.retired.discard(unused[0])
            try:
                await self.client.unload_lora(unused[0])
            except EngineError as e:  # a replica that is down lost it anyway; one that restarts never had it
                log.warning("unloading adapter %s: %s", unused[0], e)
                continue
            log.info("unloaded adapter %s: no request uses it", unused[0])
