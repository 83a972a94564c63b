"""A failing blob tier (Redis down, an I/O error) is not a request failure: every call into one goes
through `TierGuard.call`, which counts a fault, logs it once, and rests the tier `retry_s` seconds
(calls return FAILED meanwhile, without waiting on a dead server), then tries it again."""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter

FAILED = object()  # what a guarded call returns instead of raising
log = logging.getLogger("ragcache.store")


class TierGuard:
    def __init__(self, retry_s: float = 5.0):
        self.retry_s = retry_s
        self.errors: Counter[str] = Counter()  # tier → calls that raised
        self._down_until: dict[str, float] = {}  # tier → monotonic time before which it is skipped
        self._lock = threading.Lock()

    def call(self, tier, fn, *args):
        """fn(*args), or FAILED when `tier` is resting or the call raises."""
        if time.monotonic() < self._down_until.get(tier.name, 0.0):
            return FAILED
        try:
            out = fn(*args)
        except Exception as e:  # noqa: BLE001 — any fault of a cache tier: the request goes on without it
            with self._lock:
                self.errors[tier.name] += 1
                first = tier.name not in self._down_until
                self._down_until[tier.name] = time.monotonic() + self.retry_s
            if first:
                log.warning("%s tier failing (%s: %s): serving without it, retrying every %gs", tier.name,
                            type(e).__name__, e, self.retry_s)
            return FAILED
        if tier.name in self._down_until:
            with self._lock:
                self._down_until.pop(tier.name, None)
            log.warning("%s tier is back", tier.name)
        return out
