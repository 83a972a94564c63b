"""Pins per namespace, inside a quota of bytes: one tenant cannot pin every tier full.

Only a stored entry (one with a blob copy, so with a size) can be pinned; a pin is counted at the
entry's largest copy. A request that would take the namespace past its quota pins nothing and says
so (`PinQuotaExceeded`). Pins of many keys are one transaction, their IN lists in batches that stay
under SQLite's variable limit (999 before 3.32, 32,766 since).
"""
from __future__ import annotations

from sqlalchemy import delete, func, select, text, update

from ..database import Database
from ..errors import Conflict
from ..meta import KVCopy, KVEntry, Pin, in_batches


class PinQuotaExceeded(Conflict):
    def __init__(self, namespace: str, needed: int, used: int, quota: int):
        super().__init__(f"pinning these chunks needs {needed} bytes more, and namespace {namespace!r} already pins "
                         f"{used} of its {quota} bytes (RAGCACHE_PIN_QUOTA_BYTES): unpin some first")


def pin(db: Database, namespace: str, keys: list[str], quota: int) -> set[str]:
    """Pin the stored ones of `keys` for `namespace`, all or none; which keys are pinned."""
    with db.session() as s:
        if not db.is_sqlite:  # one pin request per namespace at a time: no two pass the quota check together
            s.execute(text("SELECT pg_advisory_xact_lock(hashtext(:ns))"), {"ns": namespace})
        sizes, mine = {}, set()
        for part in in_batches(set(keys)):
            sizes.update(s.execute(select(KVCopy.key, func.max(KVCopy.bytes)).where(
                KVCopy.key.in_(part), KVCopy.checksum.is_not(None)).group_by(KVCopy.key)).all())
            mine |= set(s.scalars(select(Pin.key).where(Pin.namespace == namespace, Pin.key.in_(part))))
        new = {k: n for k, n in sizes.items() if k not in mine}
        used = int(s.scalar(select(func.coalesce(func.sum(Pin.bytes), 0)).where(Pin.namespace == namespace)))
        if used + sum(new.values()) > quota:
            raise PinQuotaExceeded(namespace, sum(new.values()), used, quota)
        s.add_all(Pin(namespace=namespace, key=k, bytes=n) for k, n in new.items())
        for part in in_batches(new):
            s.execute(update(KVEntry).where(KVEntry.key.in_(part)).values(pinned=True))
        return set(sizes)


def unpin(db: Database, namespace: str, keys: list[str]) -> set[str]:
    """`namespace`'s pins of `keys` dropped; which keys no namespace pins any more."""
    freed = set()
    with db.session() as s:
        for part in in_batches(set(keys)):
            s.execute(delete(Pin).where(Pin.namespace == namespace, Pin.key.in_(part)))
            still = set(s.scalars(select(Pin.key).where(Pin.key.in_(part))))
            free = [k for k in part if k not in still]
            s.execute(update(KVEntry).where(KVEntry.key.in_(free)).values(pinned=False))
            freed.update(free)
    return freed

