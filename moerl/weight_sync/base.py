"""What every weight-sync transport shares: an engine client driven from the (synchronous) training
loop through an event loop of its own, in a thread."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import numpy as np

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
    """An engine does not serve the trainer's weights after a sync; the message names the engine."""


def sync_weights(model, hf_config: dict, sync: "EngineLink | None", version: str) -> SyncStats | None:
    """Collective over the trainer's ranks: all export, global rank 0 (holding ``sync``) pushes."""
    from moerl.weight_sync.export import hf_named_tensors

    named = hf_named_tensors(model, hf_config)
    if sync is None:
        for _ in named:
            pass
        return None
    return sync.push(named, version)


PROBE_TOKENS = 64


def probe_ids(vocab_size: int) -> list[int]:
    """A fixed prompt that touches many rows of the embedding and many experts."""
    return [(7919 * i + 17) % vocab_size for i in range(PROBE_TOKENS)]


def verify_engines(model, hf_config: dict, sync: "EngineLink | None", version: str | None, tolerance: float,
                   lora_path: str | None = None) -> dict[str, float] | None:
    """Collective over the trainer's ranks: check that every engine serves what the trainer holds.

    Each engine must report ``version`` (unless None); engines that checksum their weights (SGLang's /weights_checker)
    must agree with each other; and each engine's log-probs of a fixed probe (``lora_path``: through that
    adapter) must be within ``tolerance`` (mean |delta|) of the trainer's own forward of it. The probe is
    a generation request: call it after the engines resume. Returns the worst deltas (on global rank 0)."""
    import torch
    import torch.distributed as dist

    from moerl.megatron.forward import forward_logits

    ids = probe_ids(hf_config["vocab_size"])
    logits = forward_logits(model, torch.tensor([ids]))
    ours = None if logits is None else torch.log_softmax(logits[0, :-1].float(), -1).gather(1, torch.tensor(ids[1:])[:, None].to(logits.device))[:, 0].cpu()
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, ours)  # PROBE_TOKENS floats from each rank: the last stage's are the answer
    if sync is None:
        return None
    ours = next(t for t in held if t is not None).numpy()
    served_versions = sync.run(sync.client.weight_versions()) if version is not None else []
    for url, served in zip(sync.client.urls, served_versions):
        if served != version:
            raise WeightSyncError(f"{url} serves weight version {served!r}, not {version!r}")
    checksums = {c for c in sync.run(sync.client.weight_checksums()) if c is not None}
    if len(checksums) > 1:
        raise WeightSyncError(f"the engines hold different weights after the update to version {version}: {sorted(checksums)}")
    worst = {"sync/verify_mean_abs_delta": 0.0, "sync/verify_max_abs_delta": 0.0}
    for url, theirs in zip(sync.client.urls, sync.run(sync.client.prompt_logprobs(ids, lora_path))):
        delta = np.abs(theirs - ours)
        if delta.mean() > tolerance:
            raise WeightSyncError(f"{url} does not serve the trainer's weights (version {version}): its log-probs of the probe "
                                  f"differ by {delta.mean():.3g} on average (max {delta.max():.3g}), tolerance {tolerance:g}")
        worst = {"sync/verify_mean_abs_delta": max(worst["sync/verify_mean_abs_delta"], float(delta.mean())),
                 "sync/verify_max_abs_delta": max(worst["sync/verify_max_abs_delta"], float(delta.max()))}
    return worst
