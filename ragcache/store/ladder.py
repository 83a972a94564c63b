"""The memory tiers of one process (gpu above cpu): decoded entries, each tier with its own eviction
order (lru or gdsf, in process), an evicted entry demoted one tier down. What falls off the bottom
goes to `spill(key, entry)` (the store persists a write-back entry there)."""
from __future__ import annotations

import threading
from collections import Counter
from typing import Callable

from .codec import StoredKV
from .policy import make_policy


def cost_of(entry: StoredKV) -> float:
    """What recomputing the entry costs: its measured prefill seconds, else its length in tokens."""
    return entry.cost_s if entry.cost_s is not None else float(entry.token_ids.numel())


class MemoryLadder:
    def __init__(self, tiers: list, policy: str, lock: threading.RLock, pinned: set[str], evictions: Counter,
                 spill: Callable[[str, StoredKV], None]):
        self.tiers, self._lock, self._pinned, self.evictions, self._spill = tiers, lock, pinned, evictions, spill
        self._policy = {t.name: make_policy(policy) for t in tiers}

    def holds(self, key: str) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def find(self, key: str) -> StoredKV | None:
        return next((t.get(key) for t in self.tiers if t.contains(key)), None)

    def admit(self, key: str, entry: StoredKV, below: int | None = None) -> None:
        """Into the tiers above index `below` (all of them by default)."""
        for tier in self.tiers[:below]:
            self.admit_one(tier, key, entry)

    def admit_one(self, tier, key: str, entry: StoredKV) -> bool:
        """Into one tier, making room; False when it does not fit (only pinned entries left)."""
        if entry.nbytes > tier.capacity_bytes():
            return False
        with self._lock:
            self._make_room(tier, entry.nbytes, key)
            if tier.used_bytes() + entry.nbytes > tier.capacity_bytes():
                return False  # pinned or not: pins never push a memory tier past its capacity
            tier.put(key, entry)
            self._policy[tier.name].touch(key, entry.nbytes, cost_of(entry))
            return True

    def touch(self, tier, key: str, entry: StoredKV) -> None:
        """A hit in `tier` (the caller holds the lock); a key evicted meanwhile is never re-ranked."""
        if tier.contains(key):
            self._policy[tier.name].touch(key, entry.nbytes, cost_of(entry))

    def _make_room(self, tier, incoming: int, incoming_key: str) -> None:
        """Evict (demote) unpinned entries until `incoming` bytes fit."""
        while True:
            with self._lock:
                if tier.used_bytes() + incoming <= tier.capacity_bytes():
                    return
                victim = self._policy[tier.name].victim(skip=self._pinned | {incoming_key})
                if victim is None:
                    return
                value = tier.get(victim)
                self._policy[tier.name].remove(victim)  # no other thread picks it now
                tier.delete(victim)
                self.evictions[tier.name] += 1
            self._demoted(tier, victim, value)

    def _demoted(self, tier, key: str, value: StoredKV) -> None:
        lower = self.tiers[self.tiers.index(tier) + 1 :]
        kept = any(t.contains(key) for t in lower) or bool(lower and self.admit_one(lower[0], key, value))
        if not kept:
            self._spill(key, value)

    def remove(self, key: str) -> None:
        with self._lock:
            for tier in self.tiers:
                self._policy[tier.name].remove(key)
                tier.delete(key)

    def empty(self, tier) -> int:
        """Every unpinned entry of `tier` demoted, as capacity pressure would; how many."""
        with self._lock:
            n = sum(k not in self._pinned for k in tier.keys())
        self._make_room(tier, tier.capacity_bytes() + 1, "")
        return n
