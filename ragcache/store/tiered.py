"""TieredStore: memory tiers (gpu, cpu) over blob tiers (disk, redis), metadata rows in SQL.

- lookup walks the tiers top-down and promotes a hit into the memory tiers;
- put is write-through by default (blob tiers first, durable, then the SQL row: two-phase),
  or write-back (memory only until evicted or flushed);
- eviction (lru or gdsf, per tier) demotes: evicted from CPU, still on disk; pinned entries
  are never evicted, and no tier goes over its capacity for an unpinned entry;
- every blob is checked against the row's checksum on load; a bad or missing blob is dropped,
  counted, and reported as a miss so the caller recomputes it;
- a blob tier that fails (Redis down, an I/O error) is not a request failure: the fault is
  counted, logged once, and the tier skipped for `retry_s` seconds; a load from it is a miss
  (its blobs are not judged: they may be fine), a put lands in the tiers that work.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from sqlalchemy import delete, select

from ..meta import Database, KVEntry, utcnow
from .codec import CorruptBlob, StoredKV, checksum, from_bytes, to_bytes
from .faults import FAILED as _FAILED
from .faults import TierGuard
from .policy import make_policy
from .tier import Tier

_FLAG = {"disk": "on_disk", "redis": "in_redis"}
log = logging.getLogger("ragcache.store")


class StoreFull(Exception):
    """A durable tier has no room even after evicting every unpinned entry."""


class StoreError(Exception):
    """No blob tier could take an entry that had to be durable."""


@dataclass
class Hit:
    entry: StoredKV
    tier: str  # where it came from: gpu, cpu, disk, redis


class TieredStore:
    def __init__(self, db: Database, memory_tiers: list[Tier], blob_tiers: list[Tier], policy: str = "lru",
                 write_back: bool = False, orphan_grace_s: float = 60.0, retry_s: float = 5.0):
        if not blob_tiers and not write_back:
            raise ValueError("write-through needs at least one blob tier (disk or redis)")
        self.db, self.memory, self.blobs = db, memory_tiers, blob_tiers
        self.tiers = memory_tiers + blob_tiers
        self.write_back = write_back
        self._policy = {t.name: make_policy(policy) for t in self.tiers}
        self._lock = threading.RLock()
        self._pinned: set[str] = set()
        self._dirty: set[str] = set()  # write-back entries with no durable blob yet
        self._pending_hits: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self.evictions: Counter[str] = Counter()
        self.corrupt: Counter[str] = Counter()
        self.guard = TierGuard(retry_s)
        self._io = self.guard.call
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-load")
        self.recover(orphan_grace_s)

    # ---- writes ------------------------------------------------------------------------------

    def put(self, key: str, entry: StoredKV, *, pinned: bool = False, durable: bool = False,
            best_effort: bool = False) -> bool:
        """Store `entry`; `durable` persists it now even under write-back (the precompute job's promise).

        A blob tier that is full or failing raises (StoreFull, StoreError), unless `best_effort`: then
        the entry lands where it can and False says it is not durable (a request's chunk: served anyway).
        """
        with self._lock:
            if pinned:
                self._pinned.add(key)
            deferred = self.write_back and not durable
            if deferred:
                self._dirty.add(key)
        try:
            if not deferred:
                self._persist(key, entry)
        except Exception as e:  # noqa: BLE001 — best effort: any fault of any tier, the entry still serves
            if not best_effort:
                raise
            self._admit(key, entry)
            log.debug("%s not stored durably: %s", key, e)
            return False
        self._admit(key, entry)
        if deferred and not any(t.contains(key) for t in self.memory):
            self._persist(key, entry)  # no memory tier took it: write back now or lose it
        return True

    def _persist(self, key: str, entry: StoredKV) -> None:
        """Blob into every blob tier that works (durable first), then the row: a row never lacks its blob."""
        blob = to_bytes(entry)
        csum = checksum(blob)
        stored, full = [], None
        for tier in self.blobs:
            try:
                self._make_room(tier, len(blob), key)
            except StoreFull as e:  # this tier is full of pinned entries; the others may take it
                full = e
                continue
            if self._io(tier, tier.put, key, blob) is not _FAILED:
                self._touch(tier, key, entry)
                stored.append(tier)
        if not stored:
            raise full or StoreError(f"no blob tier could store {key} ({', '.join(t.name for t in self.blobs)} "
                                     "failing)")
        with self.db.session() as s:
            row = s.get(KVEntry, key)
            if row is None:
                row = KVEntry(key=key, n_tokens=entry.token_ids.numel(), kv_dtype=entry.kv_dtype)
                s.add(row)
            row.bytes, row.checksum = len(blob), csum
            for tier in stored:
                setattr(row, _FLAG[tier.name], True)
            row.pinned = row.pinned or key in self._pinned
        with self._lock:
            self._dirty.discard(key)

    def _admit(self, key: str, entry: StoredKV, below: int | None = None) -> None:
        """Insert into the memory tiers above index `below` (all of them by default)."""
        for tier in self.memory[:below]:
            self._admit_one(tier, key, entry)

    def _admit_one(self, tier, key: str, entry: StoredKV) -> bool:
        """Into one memory tier, making room; False when it does not fit (only pinned entries left)."""
        if entry.nbytes > tier.capacity_bytes():
            return False
        with self._lock:
            self._make_room(tier, entry.nbytes, key)
            if tier.used_bytes() + entry.nbytes > tier.capacity_bytes():
                return False  # pinned or not: pins never push a memory tier past its capacity
            tier.put(key, entry)
            self._touch(tier, key, entry)
            return True

    def _touch(self, tier, key: str, entry: StoredKV) -> None:
        with self._lock:
            self._policy[tier.name].touch(key, entry.nbytes, float(entry.token_ids.numel()))

    def _make_room(self, tier, incoming: int, incoming_key: str) -> None:
        """Evict (demote) unpinned entries until `incoming` bytes fit."""
        while True:
            with self._lock:
                if tier.used_bytes() + incoming <= tier.capacity_bytes():
                    return
                victim = self._policy[tier.name].victim(skip=self._pinned | {incoming_key})
                if victim is None:
                    if tier.holds_blobs and incoming_key not in self._pinned:
                        raise StoreFull(f"{tier.name} tier is full of pinned entries")
                    return
                self._policy[tier.name].remove(victim)  # no other thread picks it now
            self._evict(tier, victim)

    def _evict(self, tier, key: str) -> None:
        """`key` out of `tier` (bookkeeping under the lock, blob I/O outside it), then demoted."""
        with self._lock:
            value = None if tier.holds_blobs else tier.get(key)  # a blob is not read to be dropped
            self._policy[tier.name].remove(key)
            if not tier.holds_blobs:
                tier.delete(key)
            self.evictions[tier.name] += 1
        if tier.holds_blobs:
            self._io(tier, tier.delete, key)
        self._demoted(tier, key, value)

    def _demoted(self, tier, key: str, value) -> None:
        """After `key` left `tier`: keep it one level down, or record that it is gone from there."""
        if not tier.holds_blobs:
            lower = self.memory[self.memory.index(tier) + 1 :]
            kept = any(t.contains(key) for t in lower) or bool(lower and self._admit_one(lower[0], key, value))
            if not kept and key in self._dirty:
                self._persist(key, value)
            return
        with self.db.session() as s:
            row = s.get(KVEntry, key)
            if row is not None:
                setattr(row, _FLAG[tier.name], False)
                if not row.on_disk and not row.in_redis:
                    s.delete(row)

    def _forget(self, tier, key: str) -> None:
        with self._lock:
            self._policy[tier.name].remove(key)
        if tier.holds_blobs:
            self._io(tier, tier.delete, key)
        else:
            tier.delete(key)

    def flush(self) -> None:
        """Write-back entries made durable; pending hit counts written to their rows."""
        for key in list(self._dirty):
            entry = next((t.get(key) for t in self.memory if t.contains(key)), None)
            if entry is not None:
                self._persist(key, entry)
        self._write_hits()

    def _write_hits(self) -> None:
        with self._lock:
            pending, self._pending_hits = self._pending_hits, Counter()
        if pending:
            now = utcnow()
            with self.db.session() as s:
                for row in s.scalars(select(KVEntry).where(KVEntry.key.in_(list(pending)))):
                    row.hits += pending[row.key]
                    row.last_access = now

    # ---- reads -------------------------------------------------------------------------------

    def get(self, key: str) -> Hit | None:
        for i, tier in enumerate(self.memory):
            entry = tier.get(key)
            if entry is None:
                self.misses[tier.name] += 1
                continue
            self._record_hit(tier, key, entry)
            self._admit(key, entry, below=i)  # promote into the tiers above
            return Hit(entry, tier.name)
        with self.db.session() as s:
            row = s.get(KVEntry, key)
            expected = None if row is None else (row.checksum, {t: getattr(row, f) for t, f in _FLAG.items()})
        if expected is None:
            for tier in self.blobs:
                self.misses[tier.name] += 1
            return None
        csum, present = expected
        for tier in self.blobs:
            if not present.get(tier.name):
                self.misses[tier.name] += 1
                continue
            entry = self._load_blob(tier, key, csum)
            if entry is None:
                self.misses[tier.name] += 1
                continue
            self._record_hit(tier, key, entry)
            self._admit(key, entry)
            return Hit(entry, tier.name)
        return None

    def get_many(self, keys: list[str]) -> list[Hit | None]:
        """A request's chunks, loaded concurrently (disk and Redis reads overlap)."""
        return list(self._pool.map(self.get, keys))

    def _load_blob(self, tier, key: str, csum: str) -> StoredKV | None:
        blob = self._io(tier, tier.get, key)
        if blob is _FAILED:
            return None  # the tier is failing, not the blob: keep it
        if blob is not None:
            try:
                if checksum(blob) != csum:
                    raise CorruptBlob(f"checksum mismatch for {key} in {tier.name}")
                return from_bytes(blob)
            except CorruptBlob:
                with self._lock:
                    self.corrupt[tier.name] += 1
        self._forget(tier, key)  # missing or bad: drop it, never serve it
        self._demoted(tier, key, None)
        return None

    def _record_hit(self, tier, key: str, entry: StoredKV) -> None:
        with self._lock:
            self.hits[tier.name] += 1
            self._pending_hits[key] += 1
            if tier.holds_blobs or tier.contains(key):  # not evicted meanwhile: never re-rank a gone key
                self._touch(tier, key, entry)
            due = len(self._pending_hits) >= 256
        if due:
            self._write_hits()

    def contains(self, key: str) -> bool:
        if any(t.contains(key) for t in self.memory):
            return True
        with self.db.session() as s:
            return s.get(KVEntry, key) is not None

    # ---- management --------------------------------------------------------------------------

    def delete(self, key: str) -> None:
        with self._lock:
            self._pinned.discard(key)
            self._dirty.discard(key)
        for tier in self.tiers:
            self._forget(tier, key)
        with self.db.session() as s:
            s.execute(delete(KVEntry).where(KVEntry.key == key))

    def recover(self, orphan_grace_s: float = 60.0) -> dict[str, int]:
        """At start: rows whose blob is gone are repaired, blobs without a row are removed."""
        fixed = Counter()
        listed = {t.name: self._io(t, t.keys) for t in self.blobs}  # one listing a tier, not one call a row
        reachable = [t for t in self.blobs if listed[t.name] is not _FAILED]  # judge only tiers we can see
        held = {t.name: set(listed[t.name]) for t in reachable}
        with self.db.session() as s:
            rows = list(s.scalars(select(KVEntry)))
            for row in rows:
                for tier in reachable:
                    flag = _FLAG[tier.name]
                    if getattr(row, flag) and row.key not in held[tier.name]:
                        setattr(row, flag, False)
                        fixed["missing_blob"] += 1
                if row.pinned:
                    self._pinned.add(row.key)
                if not row.on_disk and not row.in_redis:
                    s.delete(row)
                    fixed["dropped_row"] += 1
            known = {r.key: (r.bytes, float(r.n_tokens)) for r in rows if r.on_disk or r.in_redis}
        for tier in reachable:
            if hasattr(tier, "sweep"):
                fixed["orphan_blob"] += tier.sweep(set(known), orphan_grace_s)
            for key in listed[tier.name]:  # in the tier's own order: ties rank as they did
                if key in known:  # ranked as a put ranks it: size and recompute cost
                    self._policy[tier.name].touch(key, *known[key])
        return dict(fixed)

    def where(self, key: str) -> list[str]:
        """The tiers that hold `key` now (blob tiers by their metadata row)."""
        tiers = [t.name for t in self.memory if t.contains(key)]
        with self.db.session() as s:
            row = s.get(KVEntry, key)
        if row is not None:
            tiers += [t.name for t in self.blobs if getattr(row, _FLAG[t.name])]
        return tiers

    def is_pinned(self, key: str) -> bool:
        return key in self._pinned

    def set_pinned(self, key: str, pinned: bool) -> None:
        """Pinned entries are never evicted; the mark is kept on the row, so it survives a restart."""
        with self._lock:
            (self._pinned.add if pinned else self._pinned.discard)(key)
        with self.db.session() as s:
            row = s.get(KVEntry, key)
            if row is not None:
                row.pinned = pinned

    def evict(self, key: str) -> bool:
        """Drop an unpinned entry from every tier (the next request recomputes it); False if pinned."""
        if key in self._pinned:
            return False
        self.delete(key)
        return True

    def evict_tier(self, name: str) -> int:
        """Empty one tier of its unpinned entries, demoting as capacity pressure would."""
        tier = next((t for t in self.tiers if t.name == name), None)
        if tier is None:
            raise KeyError(name)
        keys = self._io(tier, tier.keys) if tier.holds_blobs else tier.keys()
        if keys is _FAILED:
            raise StoreError(f"the {name} tier cannot be reached")
        n = 0
        for key in [k for k in keys if k not in self._pinned]:
            self._evict(tier, key)
            n += 1
        return n

    def health(self) -> dict[str, bool]:
        """tier → reachable now."""
        return {t.name: not t.holds_blobs or self._io(t, t.ping) is not _FAILED for t in self.tiers}

    def stats(self) -> dict:
        self._write_hits()
        return {
            "tiers": [{"name": t.name, "entries": self._entries(t),
                       "used_bytes": t.used_bytes(), "capacity_bytes": t.capacity_bytes(), "hits": self.hits[t.name],
                       "misses": self.misses[t.name], "evictions": self.evictions[t.name],
                       "corrupt": self.corrupt[t.name], "errors": self.guard.errors[t.name]} for t in self.tiers],
            "corrupt_dropped": sum(self.corrupt.values()),
            "pinned": len(self._pinned),
        }

    def _entries(self, tier) -> int:
        keys = self._io(tier, tier.keys) if tier.holds_blobs else tier.keys()
        return 0 if keys is _FAILED else len(keys)

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)
