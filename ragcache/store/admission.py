"""Which chunks computed at query time (misses) enter the blob tiers (RAGCACHE_ADMISSION):

    all          every one, as before (and as `precompute` always does: it stores what it is told to)
    second-use   one that is used a second time within the last `window` distinct chunks used: a
                 one-hit wonder (most chunks of real traces, Mooncake: over half) costs a few bytes
                 of bookkeeping here, never a disk or Redis write nor the eviction of a useful entry

    adm = Admission("second-use", window=100_000)
    adm.on_miss(key)   # True: store it durably; False: memory tiers only, remembered as declined
    adm.on_hit(key)    # True: a declined chunk used again (a memory hit): store it durably now

Eviction stays the tiers' (lru or gdsf); this decides only what is written. Thread-safe.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

POLICIES = ("all", "second-use")


class Admission:
    def __init__(self, policy: str = "all", window: int = 100_000):
        if policy not in POLICIES:
            raise ValueError(f"admission must be one of {', '.join(POLICIES)}")
        self.policy, self.window = policy, window
        self._recent: OrderedDict[str, bool] = OrderedDict()  # key → declined; the last `window` keys used
        self._lock = threading.Lock()

    def _use(self, key: str) -> bool | None:
        """Record a use of `key` (the caller holds the lock); its state before: None if unseen in the window,
        else whether it was declined."""
        before = self._recent.pop(key, None)
        self._recent[key] = bool(before)
        while len(self._recent) > self.window:
            self._recent.popitem(last=False)
        return before

    def on_miss(self, key: str) -> bool:
        """A chunk just computed for a request: True when it goes to the blob tiers."""
        if self.policy == "all":
            return True
        with self._lock:
            admit = self._use(key) is not None  # seen within the window: this is at least its second use
            self._recent[key] = not admit
            return admit

    def on_hit(self, key: str) -> bool:
        """A chunk served from a tier: True when it was declined before and is now used again."""
        if self.policy == "all":
            return False
        with self._lock:
            declined = self._use(key) is True
            self._recent[key] = False
            return declined
