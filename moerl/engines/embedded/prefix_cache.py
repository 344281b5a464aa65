"""The engine's prefix cache: what SGLang's radix cache does, for the embedded and simulated engines.

A prefill reuses the keys and values (and the routing recorded with them) of the longest prefix an earlier request
left, within the same namespace: SGLang's ``extra_key`` and ``cache_salt`` and the request's LoRA adapter. A client
that salts each request with the policy version it starts under gets no KV computed under other weights. What is
reused is what was computed then, routing included, as SGLang returns it; a retract or a flush drops it, and the
prefix is computed again under the weights live at that time.

Entries are whole token sequences (a prompt once prefilled, a request's fed tokens once it finishes), least recently
used first out once they hold more than the capacity's tokens. A match scans the namespace's entries: a few hundred
at most at the capacities an embedded engine serves, each compared in one vector operation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

Namespace = tuple[str | None, str | None, str | None]  # (extra_key, cache_salt, LoRA adapter)
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer [1, kv_heads, tokens, head_dim]


@dataclass
class CachedPrefix:
    tokens: np.ndarray  # int64 [n]
    kv: KV | None  # None: a simulated engine's, which computes nothing
    routing: torch.Tensor | None  # int32 [n, num_layers, topk]: what each position routed to when its KV was computed

    def kv_upto(self, length: int) -> KV:
        assert self.kv is not None, "a simulated engine's entry holds no KV"
        return [(k[:, :, :length], v[:, :, :length]) for k, v in self.kv]


class PrefixCache:
    def __init__(self, capacity_tokens: int):
        """``capacity_tokens``: what the entries hold at most, together (0: nothing is cached)."""
        self.capacity = capacity_tokens
        self.entries: OrderedDict[tuple[Namespace, int], CachedPrefix] = OrderedDict()  # least recently used first
        self.tokens = 0
        self._next_id = 0

    def match(self, namespace: Namespace, token_ids: list[int], limit: int) -> tuple[int, CachedPrefix | None]:
        """The longest cached prefix of ``token_ids`` in ``namespace``, at most ``limit`` tokens: (its length, the entry
        holding it), or (0, None)."""
        if limit <= 0 or not self.entries:
            return 0, None
        query = np.asarray(token_ids[:limit], dtype=np.int64)
        best, found, key = 0, None, None
        for (space, ident), entry in self.entries.items():
            if space != namespace:
                continue
            n = min(len(entry.tokens), len(query))
            differs = np.flatnonzero(entry.tokens[:n] != query[:n])
            common = int(differs[0]) if differs.size else n
            if common > best:
                best, found, key = common, entry, (space, ident)
        if key is not None:
            self.entries.move_to_end(key)
        return best, found

    def takes(self, length: int) -> bool:
        """Whether a sequence of ``length`` tokens would be kept (worth computing its entry for)."""
        return 0 < length <= self.capacity

    def insert(
        self, namespace: Namespace, token_ids: list[int], kv: KV | None = None, routing: torch.Tensor | None = None
    ) -> None:
        """Keep ``token_ids`` (with their KV and routing) in ``namespace``. An entry the new one extends is replaced by
        it; one that already holds the whole sequence is only marked used."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        if not self.takes(len(tokens)):
            return
        for (space, ident), entry in list(self.entries.items()):
            if space != namespace:
                continue
            n = min(len(entry.tokens), len(tokens))
            if np.array_equal(entry.tokens[:n], tokens[:n]):
                if len(entry.tokens) >= len(tokens):
                    self.entries.move_to_end((space, ident))
                    return
                self._drop((space, ident))
        self.entries[(namespace, self._next_id)] = CachedPrefix(tokens, kv, routing)
        self._next_id += 1
        self.tokens += len(tokens)
        while self.tokens > self.capacity:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: tuple[Namespace, int]) -> None:
        self.tokens -= len(self.entries.pop(key).tokens)

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0
