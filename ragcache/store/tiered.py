"""TieredStore: memory tiers (gpu, cpu) over blob tiers (disk, redis), metadata rows in SQL.

- lookup walks the tiers top-down and promotes a hit into the memory tiers;
- put is write-through by default (bytes reserved in the blob store's ledger, blob written, its
  checksum committed: a served copy always has its blob), or write-back (memory only until
  evicted or flushed);
- eviction (lru or gdsf, per tier; blob tiers in SQL, shared by every process that writes them)
  demotes: evicted from CPU, still on disk; pinned entries are never evicted, and no tier goes
  over its capacity, for a pinned entry neither (pins.py keeps each namespace's pins in a quota);
- blob tiers are stores with their own rows (kv_copies): a host's disk, the deployment's Redis.
  A process judges only the copies of its own stores, so another host's start or miss never
  touches this host's blobs;
- every blob is checked against its copy's checksum on load; a bad or missing blob is dropped,
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

from sqlalchemy import select

from blend.cores import one_core

from ..database import Database
from ..meta import KVEntry
from . import pins
from .codec import CorruptBlob, StoredKV, checksum, from_bytes, to_bytes
from .faults import FAILED as _FAILED
from .faults import TierGuard
from .hitlog import HitLog
from .ladder import MemoryLadder, cost_of
from .ledger import Ledger, adopt_legacy, copies_of
from .tier import StoreError, StoreFull, Tier

log = logging.getLogger("ragcache.store")


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
        self._books = {t.name: Ledger(db, t.store_id, policy) for t in blob_tiers}
        self._hit_log = HitLog(db, self._books)
        self._lock = threading.RLock()
        self._pinned: set[str] = set()
        self._dirty: set[str] = set()  # write-back entries with no durable blob yet
        self.hits: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self.evictions: Counter[str] = Counter()
        self.corrupt: Counter[str] = Counter()
        self.ladder = MemoryLadder(memory_tiers, policy, self._lock, self._pinned, self.evictions, self._spill)
        self.guard = TierGuard(retry_s)
        self._io = self.guard.call
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-load", initializer=one_core)
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
            self.ladder.admit(key, entry)
            log.debug("%s not stored durably: %s", key, e)
            return False
        self.ladder.admit(key, entry)
        if deferred and not self.ladder.holds(key):
            self._persist(key, entry)  # no memory tier took it: write back now or lose it
        return True

    def keep(self, key: str, entry: StoredKV) -> None:
        """In the memory tiers only (admission.py declined the blob tiers): once evicted, it is gone."""
        self.ladder.admit(key, entry)

    def _persist(self, key: str, entry: StoredKV) -> None:
        """Into every blob tier that works: bytes reserved, blob written, then its checksum committed."""
        blob = to_bytes(entry)
        csum, stored, full = checksum(blob), [], None
        for tier in self.blobs:
            book = self._books[tier.name]
            try:
                self._reserve(tier, key, entry, len(blob))
            except StoreFull as e:  # this tier is full of pinned entries; the others may take it
                full = e
                continue
            if self._io(tier, tier.put, key, blob) is _FAILED:
                book.drop(key)
                continue
            book.commit(key, csum)
            stored.append(tier)
        if not stored:
            raise full or StoreError(f"no blob tier could store {key} ({', '.join(t.name for t in self.blobs)} "
                                     "failing)")
        with self._lock:
            self._dirty.discard(key)

    def _reserve(self, tier, key: str, entry: StoredKV, nbytes: int) -> None:
        """Room for the blob in `tier`'s store, evicting its lowest-priority unpinned copies."""
        book, capacity, pinned = self._books[tier.name], tier.capacity_bytes(), key in self._pinned
        if nbytes > capacity:
            raise StoreFull(f"{key} ({nbytes} bytes) is larger than the whole {tier.name} tier")
        def reserved() -> bool:
            return book.reserve(key, nbytes, capacity, entry.token_ids.numel(), entry.kv_dtype, cost_of(entry), pinned)

        while not reserved():
            victims = book.victims(8, skip=self._pinned | {key})
            if not victims:
                raise StoreFull(f"{tier.name} tier is full of pinned entries")
            for victim in victims:  # one at a time: no more than the room needed
                self._evict_blob(tier, victim)
                if reserved():
                    return

    def _evict_blob(self, tier, key: str) -> None:
        if self._books[tier.name].drop(key, evicted=True):  # whoever drops the row frees the blob
            self._io(tier, tier.delete, key)
            with self._lock:
                self.evictions[tier.name] += 1

    def _spill(self, key: str, entry: StoredKV) -> None:
        """An entry that left the last memory tier: written now if it was waiting for write-back."""
        if key in self._dirty:
            self._persist(key, entry)

    def flush(self) -> None:
        """Write-back entries made durable; pending hit counts written to their rows."""
        for key in list(self._dirty):
            entry = self.ladder.find(key)
            if entry is not None:
                self._persist(key, entry)
        self._hit_log.write()

    # ---- reads -------------------------------------------------------------------------------

    def get(self, key: str) -> Hit | None:
        for i, tier in enumerate(self.memory):
            entry = tier.get(key)
            if entry is None:
                self.misses[tier.name] += 1
                continue
            self._record_hit(tier, key, entry)
            self.ladder.admit(key, entry, below=i)  # promote into the tiers above
            return Hit(entry, tier.name)
        found = copies_of(self.db, key, [t.store_id for t in self.blobs])
        for tier in self.blobs:
            copy = found.get(tier.store_id)
            entry = None if copy is None else self._load_blob(tier, key, copy[0])
            if entry is None:
                self.misses[tier.name] += 1
                continue
            entry.cost_s = copy[1]
            self._record_hit(tier, key, entry)
            self.ladder.admit(key, entry)
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
        if self._books[tier.name].drop(key):  # missing or bad: drop it, never serve it
            self._io(tier, tier.delete, key)
        return None

    def _record_hit(self, tier, key: str, entry: StoredKV) -> None:
        with self._lock:
            self.hits[tier.name] += 1
            if not tier.holds_blobs:
                self.ladder.touch(tier, key, entry)
        self._hit_log.record(tier.name, key)

    def contains(self, key: str) -> bool:
        return self.ladder.holds(key) or bool(
            copies_of(self.db, key, [t.store_id for t in self.blobs]))

    def where(self, key: str) -> list[str]:
        """The tiers that hold `key` now (blob tiers by their copies in SQL)."""
        found = copies_of(self.db, key, [t.store_id for t in self.blobs])
        return [t.name for t in self.memory if t.contains(key)] + [t.name for t in self.blobs if t.store_id in found]

    # ---- management --------------------------------------------------------------------------

    def delete(self, key: str) -> None:
        """`key` out of every tier of this process (another host's disk copies age out there)."""
        with self._lock:
            self._pinned.discard(key)
            self._dirty.discard(key)
        self.ladder.remove(key)
        for tier in self.blobs:
            if self._books[tier.name].drop(key):
                self._io(tier, tier.delete, key)

    def recover(self, orphan_grace_s: float = 60.0) -> dict[str, int]:
        """At start: puts that died are swept, pins reloaded. Costs the crashed puts and the pins,
        not the number of entries: no blob is listed or statted."""
        fixed = Counter()
        for tier in self.blobs:
            if hasattr(tier, "delete_partial"):
                fixed["adopted"] += adopt_legacy(self.db, tier.store_id, tier.contains)
            for key in self._books[tier.name].sweep(orphan_grace_s):
                self._io(tier, getattr(tier, "delete_partial", tier.delete), key)
                fixed["orphan_blob"] += 1
        with self.db.session() as s:
            self._pinned |= set(s.scalars(select(KVEntry.key).where(KVEntry.pinned)))
        return dict(fixed)

    def is_pinned(self, key: str) -> bool:
        return key in self._pinned

    def pin(self, namespace: str, keys: list[str], quota: int) -> set[str]:
        """Pin the stored ones of `keys` for `namespace`, within its `quota` of bytes (PinQuotaExceeded:
        none); which are pinned. Pinned entries are never evicted; the mark is in SQL, so it survives a
        restart and every process's eviction sees it."""
        done = pins.pin(self.db, namespace, keys, quota)
        with self._lock:
            self._pinned |= done
        return done

    def unpin(self, namespace: str, keys: list[str]) -> None:
        freed = pins.unpin(self.db, namespace, keys)
        with self._lock:
            self._pinned -= freed

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
        if tier.holds_blobs:
            keys = [k for k in self._books[name].keys(unpinned=True) if k not in self._pinned]
            for key in keys:
                self._evict_blob(tier, key)
            return len(keys)
        return self.ladder.empty(tier)

    def health(self) -> dict[str, bool]:
        """tier → reachable now."""
        return {t.name: not t.holds_blobs or self._io(t, t.ping) is not _FAILED for t in self.tiers}

    def stats(self) -> dict:
        self._hit_log.write()
        tiers = []
        for t in self.tiers:
            used, entries = self._books[t.name].used() if t.holds_blobs else (t.used_bytes(), len(t.keys()))
            tiers.append({"name": t.name, "entries": entries, "used_bytes": used, "capacity_bytes": t.capacity_bytes(),
                          "hits": self.hits[t.name], "misses": self.misses[t.name],
                          "evictions": self.evictions[t.name], "corrupt": self.corrupt[t.name],
                          "errors": self.guard.errors[t.name]})
        return {"tiers": tiers, "corrupt_dropped": sum(self.corrupt.values()), "pinned": len(self._pinned)}

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)

