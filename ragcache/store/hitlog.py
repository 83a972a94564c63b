"""Hits counted in memory and written to SQL in batches: each entry's total and last access, and each
blob copy's count, which moves its eviction priority (ledger.py). A request's hits cost no SQL write
until 256 (tier, key) pairs are pending, or `write` is called (stats, flush, close)."""
from __future__ import annotations

import threading
from collections import Counter

from sqlalchemy import select

from ..database import Database
from ..meta import KVEntry, utcnow
from .ledger import Ledger

BATCH = 256  # pending (tier, key) pairs that trigger a write


class HitLog:
    def __init__(self, db: Database, books: dict[str, Ledger]):
        self.db, self.books = db, books
        self._pending: Counter[tuple[str, str]] = Counter()  # (tier, key) → hits not yet in SQL
        self._lock = threading.Lock()

    def record(self, tier: str, key: str) -> None:
        with self._lock:
            self._pending[tier, key] += 1
            due = len(self._pending) >= BATCH
        if due:
            self.write()

    def write(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, Counter()
        if not pending:
            return
        per_key, per_tier = Counter(), {}
        for (tier, key), n in pending.items():
            per_key[key] += n
            per_tier.setdefault(tier, Counter())[key] += n
        with self.db.session() as s:
            now = utcnow()
            for row in s.scalars(select(KVEntry).where(KVEntry.key.in_(list(per_key)))):
                row.hits += per_key[row.key]
                row.last_access = now
        for name, hits in per_tier.items():
            if name in self.books:
                self.books[name].touch(hits)
