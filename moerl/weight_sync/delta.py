"""Weight sync that sends only what changed (``sync.delta``): each Hub tensor is compared, bit for bit, with the one the
engines hold (the last push, kept on global rank 0's host), and goes out as the changed elements' positions and values,
or a bitmask and values, whichever is smaller, or whole where over half of it changed
(:func:`moerl.engines.delta.encode`).
With FP8 engines the comparison is of the quantized tensors: a changed weight can move its whole block's scale.

SGLang 0.5.23 has no route for a delta: the buckets go to ``/update_weights_from_tensor`` with ``load_format`` naming
moerl's weight loader (:data:`moerl.engines.delta.LOAD_FORMAT`, registered with ``--custom-weight-loader``), which
writes the changed elements where the model's own ``load_weights`` would have written them, so that the engine holds
bitwise what a full push gives. The bytes travel inside the request (a pickle of the tensors' own bytes), so engines
on other hosts take them as well.

A push is whole (every tensor sent in full) where an engine may not hold the last push: the first push of a resumed
run, an engine started again or come back since, one an update passed over. Like the disk sync, the model is gathered
a layer at a time on global rank 0 (:class:`~moerl.megatron.weights.Gather`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from moerl.checkpoint.hf import HFReader
from moerl.engines.delta import LOAD_FORMAT, encode, inline_payload
from moerl.errors import ConfigError, EnginesDown
from moerl.fp8 import FP8, SCALE_SUFFIX
from moerl.megatron.weights import Gather
from moerl.weight_sync.base import EngineCall, FullWeightSync, SyncStats, reported_dtype
from moerl.weight_sync.broadcast import buckets
from moerl.weight_sync.export import hf_layers

log = logging.getLogger("moerl.sync")


@dataclass
class DeltaStats(SyncStats):
    elements: int = 0  # elements of the policy compared
    changed: int = 0  # of them, those whose bits changed since the engines' version
    full_bytes: int = 0  # what a full push of the same tensors would have sent
    whole: bool = False  # every tensor sent in full (engines that may not hold the last push)

    def strategy_metrics(self) -> dict[str, float]:
        return {
            "sync/changed_fraction": self.changed / self.elements if self.elements else 0.0,
            "sync/sent_fraction": self.bytes / self.full_bytes if self.full_bytes else 0.0,
            "sync/whole": float(self.whole),
        }


class DeltaSync(FullWeightSync):
    def __init__(
        self,
        urls: list[str] | None,
        served_dir: str | Path | None,
        bucket_bytes: int = 512 << 20,
        pause: str = "abort",
        flush_cache: bool = True,
    ):
        """``urls``: the engines, on global rank 0 (None elsewhere); ``served_dir``: the HF directory they start from,
        on rank 0 (what they hold before the first push); ``pause``, ``flush_cache``: see
        :class:`~moerl.weight_sync.base.FullWeightSync`."""
        super().__init__(urls, "moerl-delta-sync", pause, flush_cache)
        self.served_dir = served_dir
        self.bucket_bytes = bucket_bytes
        self.last: dict[str, torch.Tensor] = {}  # rank 0: the last push on the host, by Hub name
        self.version: str | None = None  # rank 0: its version
        self.holders: set[str] = set()  # rank 0: the engines that hold it
        self.tp_sizes: dict[str, int] = {}  # rank 0: each engine's tensor-parallel size: the payload's entries
        # rank 0: the dtype every engine computes in, which pushed tensors are cast to before they are compared (a
        # trainer's fp32 step moves nearly every element, far fewer of their bf16 values); None: not known, not cast
        self.served_dtype: torch.dtype | None = None

    def connect(self) -> None:
        """Rank 0: each engine's tensor-parallel size and the dtype they compute in; an SGLang server without moerl's
        loader (one given by URL, started by hand) is refused, since it would die on the first push."""
        if self.link is None:
            return
        client = self.link.client
        infos = self.link.run(client.server_info())
        for url, info in zip(client.urls, infos, strict=True):
            loaders = info.get("custom_weight_loader")
            if loaders is not None and LOAD_FORMAT not in loaders:
                raise ConfigError(
                    f"sync.delta=true: {url} was started without moerl's weight loader; start it with "
                    f"--custom-weight-loader {LOAD_FORMAT} and moerl importable (moerl engines does both), or set "
                    "sync.delta=false"
                )
        self.tp_sizes = {url: int(info.get("tp_size", 1)) for url, info in zip(client.urls, infos, strict=True)}
        dtypes = {reported_dtype(str(info.get("dtype", "auto"))) for info in infos}
        self.served_dtype = dtypes.pop() if len(dtypes) == 1 else None

    def start(self, trainer, engines_hold_it: bool) -> None:
        """Engines started here hold the directory they started from: read on rank 0 as they hold it, it is the first
        push's baseline (the trainer's weights may round otherwise into the engines' dtype); any other start pushes
        every tensor."""
        if not engines_hold_it:
            self.push_policy(trainer)
            return
        if self.link is None:
            return
        assert self.served_dir is not None, "rank 0 is given the engines' directory"
        reader = HFReader(self.served_dir)
        self.last = {name: self.as_served(name, reader.get(name)) for name in sorted(reader.names())}
        self.link.run(self.link.client.set_weight_version(str(trainer.version)))
        self.version, self.holders = str(trainer.version), set(self.link.client.urls)

    def layers(self, model, hf_config: dict):
        """Collective: the policy's Hub tensors as the engines hold them, a weight layer at a time, on rank 0."""
        if self.gather is None:
            self.gather = Gather(model)
        return hf_layers(self.gather, hf_config, self.quantization)

    def push_model(self, model, hf_config: dict, version: str) -> SyncStats | None:
        """Collective: each weight layer gathered on rank 0, which encodes it against the last push and sends it in
        buckets of at most ``bucket_bytes`` on the wire."""
        layers = self.layers(model, hf_config)
        if self.link is None:
            for _ in layers:  # the gathers are collective
                pass
            return None
        client = self.link.client
        chosen = set(client.targets)
        stats, start = DeltaStats(), time.perf_counter()
        stats.whole = not chosen <= self.holders or bool(chosen & self.may_be_new)
        self.may_be_new -= chosen
        failure: Exception | None = None
        try:
            self.on_engines(lambda c: c.begin_weight_update(), EngineCall.ONCE_ON_CHOSEN)
        except Exception as e:  # noqa: BLE001 - raised once every gather is done
            failure = e
        for layer in layers:  # to the end, whatever fails: the gathers are collective
            if failure is not None:
                continue
            encodings: list[list[tuple[str, torch.Tensor]]] = []
            for name, tensor in layer:
                current = self.as_served(name, tensor)
                encoding = encode(name, None if stats.whole else self.last.get(name), current)
                stats.elements += encoding.numel
                stats.changed += encoding.changed
                stats.full_bytes += encoding.full_bytes
                encodings.append(encoding.named)
                self.last[name] = current
            del layer
            try:
                for bucket in whole_encodings(encodings, self.bucket_bytes):
                    self.post(bucket)
                    stats.add(bucket)
            except Exception as e:  # noqa: BLE001 - raised once every gather is done
                failure = e
        if failure is not None:
            # The engines may hold part of this push, and the baseline is part-updated: the next push is whole.
            self.holders = set()
            self.link.run(client.end_sessions(client.targets))
            if not isinstance(failure, EnginesDown):
                raise failure
            log.warning("delta push of version %s reached no engine: %s", version, failure)  # see TensorSync
            return stats
        self.on_engines(lambda c: c.end_weight_update(), EngineCall.ONCE_ON_CHOSEN)
        self.on_engines(lambda c: c.set_weight_version(version), EngineCall.REPEATED_ON_CHOSEN)
        # A catch-up brings the engines it reaches to the version the others hold; an update leaves out those it passed.
        self.holders = self.holders | set(client.targets) if version == self.version else set(client.targets)
        self.version = version
        stats.seconds = time.perf_counter() - start
        return stats

    def as_served(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0: a host copy of its own of the Hub tensor ``name`` in the dtype the engines hold it in (an FP8 weight
        and its fp32 scales as they are): what the engine's loader would cast it to, so nothing is lost."""
        keep = self.served_dtype is None or tensor.dtype == FP8 or name.endswith(SCALE_SUFFIX)
        return tensor.detach().to("cpu", dtype=tensor.dtype if keep else self.served_dtype, copy=True)

    def post(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Rank 0: one bucket to every chosen engine, each of its TP ranks the same bytes (each rank's loader takes
        its own share of each tensor)."""
        payload = inline_payload(bucket)
        self.on_engines(
            lambda client: client.update_weights_from_tensor(
                lambda url: [payload] * self.tp_sizes.get(url, 1), LOAD_FORMAT, flush_cache=self.flush_cache
            ),
            EngineCall.ONCE_ON_CHOSEN,
        )


def whole_encodings(
    encodings: list[list[tuple[str, torch.Tensor]]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of at most ``bucket_bytes`` of the tensors' encodings, each encoding whole in one bucket (a larger one
    alone): the engine's loader decodes a bucket by itself, and a delta's parts apart would not decode."""
    sent = [named for named in encodings if named]  # an unchanged tensor sends nothing
    for bucket in buckets(sent, bucket_bytes, lambda named: sum(t.nbytes for _, t in named)):
        yield [pair for named in bucket for pair in named]
