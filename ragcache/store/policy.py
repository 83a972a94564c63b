"""Eviction order within a tier: `lru`, or `gdsf` (Greedy-Dual-Size-Frequency, as RAGCache uses).

GDSF priority = clock + hits × recompute cost / size; the lowest goes first and the clock
rises to the evicted priority, so old popular entries age out. Pinned keys are skipped.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Iterable


class LRU:
    def __init__(self):
        self._order: OrderedDict[str, None] = OrderedDict()

    def touch(self, key: str, size: int, cost: float) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victim(self, skip: Iterable[str] = ()) -> str | None:
        skip = set(skip)
        return next((k for k in self._order if k not in skip), None)


class GDSF:
    def __init__(self):
        self.clock = 0.0
        self._hits: dict[str, int] = {}
        self._prio: dict[str, float] = {}
        self._heap: list[tuple[float, int, str]] = []  # stale entries are skipped lazily
        self._seq = itertools.count()

    def touch(self, key: str, size: int, cost: float) -> None:
        self._hits[key] = self._hits.get(key, 0) + 1
        prio = self.clock + self._hits[key] * cost / max(size, 1)
        self._prio[key] = prio
        heapq.heappush(self._heap, (prio, next(self._seq), key))
        if len(self._heap) > 4 * len(self._prio) + 64:  # drop stale heap items
            self._heap = [(p, s, k) for p, s, k in self._heap if self._prio.get(k) == p]
            heapq.heapify(self._heap)

    def remove(self, key: str) -> None:
        self._hits.pop(key, None)
        self._prio.pop(key, None)

    def victim(self, skip: Iterable[str] = ()) -> str | None:
        skip = set(skip)
        held = []
        found = None
        while self._heap:
            prio, seq, key = heapq.heappop(self._heap)
            if self._prio.get(key) != prio:
                continue  # stale
            if key in skip:
                held.append((prio, seq, key))
                continue
            found = key
            heapq.heappush(self._heap, (prio, seq, key))  # still present until remove()
            self.clock = prio
            break
        for item in held:
            heapq.heappush(self._heap, item)
        return found


POLICIES = {"lru": LRU, "gdsf": GDSF}


def make_policy(name: str):
    if name not in POLICIES:
        raise ValueError(f"eviction policy must be one of {', '.join(POLICIES)}")
    return POLICIES[name]()
