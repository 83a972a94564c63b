"""The cache-admin role: which chunks are cached where, pins, evictions, per-tier statistics.

Chunks are named the way tenants know them (chunk ids or a document id, always within one
namespace); their store keys are what a request would look up now.
"""
from __future__ import annotations

from .corpus.ingest import unpack_ids
from .errors import NotFound


class CacheAdmin:
    def __init__(self, parts, corpus):
        self.p, self.corpus = parts, corpus

    def _keyed(self, namespace: str, chunk_ids: list[int] | None, doc_id: str | None) -> list[tuple[int, str, str]]:
        rows = self.corpus.chunk_rows(namespace, chunk_ids, doc_id)
        return [(cid, doc, self.p.kv_key_of(unpack_ids(ids), namespace)) for cid, doc, ids in rows]

    def lookup(self, namespace: str, chunk_ids: list[int] | None = None, doc_id: str | None = None) -> list[dict]:
        store = self.p.store
        out = []
        for cid, doc, key in self._keyed(namespace, chunk_ids, doc_id):
            tiers = store.where(key)
            out.append({"chunk_id": cid, "doc_id": doc, "cached": bool(tiers), "tiers": tiers,
                        "pinned": store.is_pinned(key)})
        return out

    def pin(self, namespace: str, chunk_ids: list[int] | None = None, doc_id: str | None = None,
            pinned: bool = True) -> list[dict]:
        """Mark (or unmark) the chunks' entries as never evicted, within the namespace's pin quota (over
        it: PinQuotaExceeded, a Conflict, and nothing pinned); a chunk not stored yet is not pinned (pin it once precomputed)."""
        keys = [key for _, _, key in self._keyed(namespace, chunk_ids, doc_id)]
        if pinned:
            self.p.store.pin(namespace, keys, self.pin_quota())
        else:
            self.p.store.unpin(namespace, keys)
        return self.lookup(namespace, chunk_ids, doc_id)

    def pin_quota(self) -> int:
        """Bytes one namespace may pin: RAGCACHE_PIN_QUOTA_BYTES, else a quarter of the smallest tier."""
        return self.p.settings.pin_quota_bytes or min(t.capacity_bytes() for t in self.p.store.tiers) // 4

    def evict(self, namespace: str, chunk_ids: list[int] | None = None, doc_id: str | None = None) -> dict:
        """Drop the chunks' KV from every tier (recomputed on next use); pinned ones stay."""
        evicted, pinned = [], []
        for cid, _, key in self._keyed(namespace, chunk_ids, doc_id):
            (evicted if self.p.store.evict(key) else pinned).append(cid)
        return {"evicted": evicted, "kept_pinned": pinned}

    def evict_tier(self, tier: str) -> dict:
        try:
            return {"tier": tier, "evicted": self.p.store.evict_tier(tier)}
        except KeyError:
            names = [t.name for t in self.p.store.tiers]
            raise NotFound(f"no tier {tier!r} here: this server has {', '.join(names)}") from None

    def stats(self) -> dict:
        return self.p.store.stats()
