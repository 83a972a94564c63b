"""The SQL side of one blob store (a host's disk directory, a deployment's Redis): which entries it
holds, with what checksum, how many bytes it uses, and which entry it gives up first.

Every process writing to the store reads and writes the same rows, so N workers share one
capacity instead of each counting from its own snapshot, and a process only ever judges the
copies of stores it can see. A put reserves its bytes first (a copy row with no checksum yet),
writes the blob, then commits the checksum; a crash in between leaves a row that `sweep` finds
by itself at the next start, so start-up costs the crashed puts, not the number of entries.

Eviction order per store: `lru` (priority = last access) or `gdsf` (clock + hits × measured
prefill cost / bytes; the clock rises to each evicted priority, so old favourites age out).
"""
from __future__ import annotations

import time
from collections import Counter
from datetime import timedelta

from sqlalchemy import delete, exists, func, inspect, select, text, update
from sqlalchemy.exc import IntegrityError

from ..database import Database
from ..meta import BlobStore, KVCopy, KVEntry, Pin, utcnow


def gdsf_priority(clock: float, hits: int, cost: float, size: int) -> float:
    return clock + hits * cost / max(size, 1)


class Ledger:
    def __init__(self, db: Database, store_id: str, policy: str = "lru"):
        self.db, self.id, self.policy = db, store_id, policy
        ensure_store(db, store_id)

    def _priority(self, clock: float, hits: int, cost: float, size: int) -> float:
        return time.time() if self.policy == "lru" else gdsf_priority(clock, hits, cost, size)

    def reserve(self, key: str, nbytes: int, capacity: int, n_tokens: int, kv_dtype: str, cost: float,
                pinned: bool) -> bool:
        """Room for `nbytes` more (less a copy this replaces) and a copy row being written; False: full."""
        for attempt in range(3):
            try:
                with self.db.session() as s:
                    return self._reserve(s, key, nbytes, capacity, n_tokens, kv_dtype, cost, pinned)
            except IntegrityError:  # another process reserved the same key or entry at the same time
                if attempt == 2:
                    raise
        return False

    def _reserve(self, s, key, nbytes, capacity, n_tokens, kv_dtype, cost, pinned) -> bool:
        row = s.get(KVCopy, (key, self.id), with_for_update=True)
        delta = nbytes - (row.bytes if row is not None else 0)
        grow = update(BlobStore).where(BlobStore.id == self.id).values(
            used_bytes=BlobStore.used_bytes + delta, entries=BlobStore.entries + int(row is None))
        if delta > 0:
            grow = grow.where(BlobStore.used_bytes + delta <= capacity)
        if not s.execute(grow).rowcount:
            return False
        clock = s.scalar(select(BlobStore.clock).where(BlobStore.id == self.id))
        priority = self._priority(clock, 1, cost, nbytes)
        if row is None:
            s.add(KVCopy(key=key, store=self.id, bytes=nbytes, checksum=None, cost=cost, hits=1, priority=priority))
        else:
            row.bytes, row.checksum, row.cost, row.priority, row.written = nbytes, None, cost, priority, utcnow()
        entry = s.get(KVEntry, key)
        if entry is None:
            s.add(KVEntry(key=key, n_tokens=n_tokens, kv_dtype=kv_dtype, cost_s=cost, pinned=pinned))
        else:
            entry.pinned = entry.pinned or pinned
        s.flush()
        return True

    def commit(self, key: str, csum: str) -> None:
        """The blob is written: the copy is served from now on."""
        with self.db.session() as s:
            s.execute(update(KVCopy).where(KVCopy.key == key, KVCopy.store == self.id).values(checksum=csum))

    def drop(self, key: str, evicted: bool = False) -> bool:
        """The copy row gone and its bytes released (once, whoever else drops it too); the entry row
        too once no store holds a copy. False when there was no copy."""
        with self.db.session() as s:
            row = s.get(KVCopy, (key, self.id), with_for_update=True)
            if row is None:
                return False
            values = dict(used_bytes=BlobStore.used_bytes - row.bytes, entries=BlobStore.entries - 1)
            if evicted and self.policy == "gdsf":
                values["clock"] = func.greatest(BlobStore.clock, row.priority) if not self.db.is_sqlite \
                    else func.max(BlobStore.clock, row.priority)
            s.execute(update(BlobStore).where(BlobStore.id == self.id).values(**values))
            s.delete(row)
            s.flush()
            gone = s.execute(delete(KVEntry).where(KVEntry.key == key, ~exists().where(KVCopy.key == key))).rowcount
            if gone:  # its pins no longer count against any quota
                s.execute(delete(Pin).where(Pin.key == key))
            return True

    def victims(self, n: int, skip: set[str]) -> list[str]:
        """Up to `n` finished, unpinned copies, the lowest priority first."""
        q = (select(KVCopy.key).join(KVEntry, KVEntry.key == KVCopy.key)
             .where(KVCopy.store == self.id, KVCopy.checksum.is_not(None), ~KVEntry.pinned)
             .order_by(KVCopy.priority).limit(n + len(skip)))
        with self.db.session() as s:
            return [k for k in s.scalars(q) if k not in skip][:n]

    def touch(self, hits: Counter[str]) -> None:
        """Hits since the last call: each copy's count and eviction priority move up."""
        with self.db.session() as s:
            clock = s.scalar(select(BlobStore.clock).where(BlobStore.id == self.id)) or 0.0
            for row in s.scalars(select(KVCopy).where(KVCopy.store == self.id, KVCopy.key.in_(list(hits)))):
                row.hits += hits[row.key]
                row.priority = self._priority(clock, row.hits, row.cost, row.bytes)

    def used(self) -> tuple[int, int]:
        """(bytes, entries) held now."""
        with self.db.session() as s:
            row = s.get(BlobStore, self.id)
            return (row.used_bytes, row.entries) if row is not None else (0, 0)

    def keys(self, unpinned: bool = False) -> list[str]:
        q = select(KVCopy.key).where(KVCopy.store == self.id)
        if unpinned:
            q = q.join(KVEntry, KVEntry.key == KVCopy.key).where(~KVEntry.pinned)
        with self.db.session() as s:
            return list(s.scalars(q))

    def sweep(self, grace_s: float) -> list[str]:
        """Copies still unwritten `grace_s` after their reservation (a put that died): rows dropped,
        keys returned so the caller deletes whatever part of the blob was written."""
        with self.db.session() as s:
            stale = list(s.scalars(select(KVCopy.key).where(
                KVCopy.store == self.id, KVCopy.checksum.is_(None),
                KVCopy.written < utcnow() - timedelta(seconds=grace_s))))
        return [k for k in stale if self.drop(k)]


def ensure_store(db: Database, store_id: str, token: str = "") -> str:
    """The store's row (created once, by whichever process comes first); its token."""
    with db.session() as s:
        row = s.get(BlobStore, store_id)
        if row is not None:
            return row.token
        try:
            with s.begin_nested():
                s.add(BlobStore(id=store_id, token=token))
        except IntegrityError:
            pass
    with db.session() as s:
        return s.get(BlobStore, store_id).token


def copies_of(db: Database, key: str, stores: list[str]) -> dict[str, tuple[str, float]]:
    """store → (checksum, recompute cost) of each finished copy of `key` among `stores`."""
    with db.session() as s:
        rows = s.execute(select(KVCopy.store, KVCopy.checksum, KVCopy.cost).where(
            KVCopy.key == key, KVCopy.store.in_(stores), KVCopy.checksum.is_not(None))).all()
    return {store: (csum, cost) for store, csum, cost in rows}


def adopt_legacy(db: Database, store_id: str, present) -> int:
    """Once, after the schema-4 upgrade: the disk copies the old single-host rows listed become this
    disk store's (those `present(key)` finds); entries left with no copy are dropped. The first disk
    store opened adopts them. Returns how many were adopted."""
    with db.session() as s:
        if not inspect(s.connection()).has_table("legacy_disk_copies"):
            return 0
        if not db.is_sqlite:
            s.execute(text("LOCK TABLE legacy_disk_copies"))  # a second process waits, then finds it gone
        rows = s.execute(text("SELECT l.key, l.bytes, l.checksum, e.n_tokens FROM legacy_disk_copies l "
                              "JOIN kv_entries e ON e.key = l.key")).all()
        kept = [r for r in rows if present(r[0])]
        s.add_all(KVCopy(key=k, store=store_id, bytes=b, checksum=c, cost=float(n), hits=1, priority=time.time())
                  for k, b, c, n in kept)
        s.flush()
        s.execute(update(BlobStore).where(BlobStore.id == store_id).values(
            used_bytes=BlobStore.used_bytes + sum(r[1] for r in kept), entries=BlobStore.entries + len(kept)))
        s.execute(delete(KVEntry).where(~exists().where(KVCopy.key == KVEntry.key)))
        s.execute(text("DROP TABLE legacy_disk_copies"))
        return len(kept)
