"""What every weight-sync transport shares: an engine client driven from the (synchronous) training
loop through an event loop of its own, in a thread."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from moerl.engines.client import EngineClient


@dataclass
class SyncStats:
    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0


class EngineLink:
    def __init__(self, urls: list[str], name: str):
        self.client = EngineClient(urls)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine):
        """Run a coroutine of the engine client on this object's event loop; its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def close(self) -> None:
        self.run(self.client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


class WeightSyncError(RuntimeError):
    """An engine's weights differ from the trainer's after a sync; the message names the tensor."""


def sync_weights(model, hf_config: dict, sync: "EngineLink | None", version: str, verify_rows: int = 0) -> SyncStats | None:
    """Collective over the trainer's ranks: all export, global rank 0 (holding ``sync``) pushes.

    With ``verify_rows``, every engine's copy of the first rows of every tensor is read back and
    compared bitwise with what was sent."""
    import torch

    from moerl.weight_sync.export import hf_named_tensors

    named = hf_named_tensors(model, hf_config)
    if sync is None:
        for _ in named:
            pass
        return None
    sent: list[tuple[str, torch.Tensor]] = []

    def recording():
        for name, tensor in named:
            if verify_rows:
                sent.append((name, tensor[:verify_rows].clone()))
            yield name, tensor

    stats = sync.push(recording(), version)
    for name, head in sent:
        for url, served in zip(sync.client.urls, sync.run(sync.client.weights_by_name(name, truncate_size=verify_rows))):
            if not torch.equal(torch.tensor(served, dtype=head.dtype), head):
                raise WeightSyncError(f"{url} serves a different {name} than the trainer sent (version {version})")
    return stats
