"""A byte-bounded LRU cache of prefilled KV states, shared by `sample` and `compute_logprobs`.

An entry is one token sequence that was prefilled: its KV for every layer and, when the model's
logits are its output head applied to the last hidden state, that hidden state per position (so a
later call that wants log-probs of the cached positions gets them from one head matmul instead of a
prefill). Entries are keyed by `(adapter name or None, weights key, namespace)`: the weights key holds
the adapter's weight version and a fingerprint of the tensors behind it (see `TorchSampler.cache_key`),
so KV computed under other weights is never reused, and a tenant, whose adapter names are its own,
never reads another tenant's KV. The namespace (None: the shared one) separates callers that must not
share KV even on the same weights: a server's inflight sampling sessions each have their own.

Lookup is the longest common prefix with any entry of the same key (a linear scan per key: the
budget keeps the entry count small). Storing a sequence drops the same key's entries that are strict
prefixes of it: every lookup they would answer, the longer entry answers as well. Sequences that
share a prefix but then differ each hold their own copy of it (no radix tree: simpler, and the
budget bounds the waste).

Prompts with images are never stored nor looked up: their rope positions depend on the whole prompt
(see vision.py), so a text prefix's KV is not a prefix of theirs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

CacheKey = tuple  # (adapter name or None, weights key, namespace or None)


@dataclass
class PrefixCacheStats:
    """Counters since the sampler was built. A hit is a prompt whose prefill reused cached KV."""

    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    bytes_held: int = 0
    entries: int = 0
    evictions: int = 0  # entries dropped to stay under the byte budget
    invalidations: int = 0  # entries dropped because their adapter's weights changed or it left
    budget_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class CacheEntry:
    tokens: np.ndarray  # int64 [T]
    # every layer's keys and values (apart: their head dims may differ, e.g. multi-head latent attention)
    keys_N_H_T_D: torch.Tensor
    values_N_H_T_D: torch.Tensor
    hidden_T_E: torch.Tensor | None  # the head's input per position, or None
    nbytes: int = field(init=False)

    def __post_init__(self):
        tensors = [self.keys_N_H_T_D, self.values_N_H_T_D] + ([self.hidden_T_E] if self.hidden_T_E is not None else [])
        self.nbytes = self.tokens.nbytes + sum(t.numel() * t.element_size() for t in tensors)

    def __len__(self) -> int:
        return len(self.tokens)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    """`budget_bytes` <= 0: disabled (nothing stored, every lookup misses, no counting)."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = max(int(budget_bytes), 0)
        self._lru: OrderedDict[tuple, CacheEntry] = OrderedDict()  # (key, tokens) -> entry, oldest first
        self._by_adapter: dict[str | None, dict[CacheKey, set[tuple]]] = {}
        self._stats = PrefixCacheStats(budget_bytes=self.budget_bytes)

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def stats(self) -> PrefixCacheStats:
        held = sum(e.nbytes for e in self._lru.values())
        return PrefixCacheStats(**{**asdict(self._stats), "bytes_held": held, "entries": len(self._lru)})

    # ---- lookup ---------------------------------------------------------------------------------
    def lookup(self, key: CacheKey, tokens: list[int]) -> tuple[CacheEntry | None, int]:
        """(the entry sharing the longest prefix with `tokens`, that prefix's length) or (None, 0)."""
        if not self.enabled:
            return None, 0
        self._drop_stale(key)
        query = np.asarray(tokens, dtype=np.int64)
        best, best_len, best_id = None, 0, None
        for entry_id in self._by_adapter.get(key[0], {}).get(key, ()):
            entry = self._lru[entry_id]
            n = common_prefix(entry.tokens, query)
            if n > best_len:
                best, best_len, best_id = entry, n, entry_id
        if best_id is not None:
            self._lru.move_to_end(best_id)
        return best, best_len

    def record(self, reused: list[int]) -> None:
        """Count one prefill's prompts: each reused `reused[i]` cached tokens (0: a miss)."""
        for n in reused:
            if n > 0:
                self._stats.hits += 1
                self._stats.tokens_reused += n
            else:
                self._stats.misses += 1

    # ---- store ----------------------------------------------------------------------------------
    def store(self, key: CacheKey, tokens: list[int], keys_N_H_T_D, values_N_H_T_D, hidden_T_E) -> None:
        if not self.enabled:
            return
        entry = CacheEntry(np.asarray(tokens, dtype=np.int64), keys_N_H_T_D, values_N_H_T_D, hidden_T_E)
        if entry.nbytes > self.budget_bytes:
            return  # would evict everything and still not fit
        self._drop_stale(key)
        ids = self._by_adapter.setdefault(key[0], {}).setdefault(key, set())
        for other in [i for i in ids if len(self._lru[i]) < len(entry)]:
            if common_prefix(self._lru[other].tokens, entry.tokens) == len(self._lru[other]):
                self._remove(other)  # a strict prefix of the new entry: dominated
        entry_id = (key, tuple(tokens))
        if entry_id in self._lru:
            self._remove(entry_id)
        held = sum(e.nbytes for e in self._lru.values())
        while self._lru and held + entry.nbytes > self.budget_bytes:
            oldest = next(iter(self._lru))
            held -= self._lru[oldest].nbytes
            self._remove(oldest)
            self._stats.evictions += 1
        self._lru[entry_id] = entry
        self._by_adapter[key[0]].setdefault(key, set()).add(entry_id)

    # ---- invalidation ---------------------------------------------------------------------------
    def drop_adapter(self, adapter: str | None) -> None:
        """Forget every entry of `adapter` (new weights were installed, or it was removed)."""
        for ids in list(self._by_adapter.get(adapter, {}).values()):
            for entry_id in list(ids):
                self._remove(entry_id)
                self._stats.invalidations += 1
        self._by_adapter.pop(adapter, None)

    def clear(self) -> None:
        for adapter in list(self._by_adapter):
            self.drop_adapter(adapter)

    def _drop_stale(self, key: CacheKey) -> None:
        # The adapter's weights moved on (a new version, or its tensors changed in place): its older
        # entries, in every namespace, can never match again, so they go now rather than when the LRU
        # reaches them. Other namespaces on the same weights stay.
        for other in [k for k in self._by_adapter.get(key[0], {}) if k[1] != key[1]]:
            for entry_id in list(self._by_adapter[key[0]][other]):
                self._remove(entry_id)
                self._stats.invalidations += 1

    def _remove(self, entry_id: tuple) -> None:
        self._lru.pop(entry_id)
        key = entry_id[0]
        ids = self._by_adapter[key[0]][key]
        ids.discard(entry_id)
        if not ids:
            del self._by_adapter[key[0]][key]
