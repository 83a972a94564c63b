"""Done chunks whose KV key the settings now make differently: computed again under the new key while served.

A chunk's key names how its KV was made and kept: the model, what it was computed behind (`CHUNK_PREFILL` and the
namespace's lead), the KV dtype (`Parts.kv_key_of`). Change one of those and every done chunk's stored KV sits
under a key no request asks for, and precompute, which claims only pending chunks, would find nothing to do: each
chunk would be computed at its first miss, on a request's time. So the precompute job ends here: each such chunk's
KV is computed and stored under its new key, its row moved to that key only once the entry is durable, and an old
entry deleted once no chunk names it. The chunks stay `done` throughout (retrieval serves only done chunks), so a
request meanwhile gets the old key's miss at worst, never another chunk's KV.
"""
from __future__ import annotations

import logging

from sqlalchemy import select, update

from ..corpus.ingest import unpack_ids
from ..meta import Chunk, keys_in_use
from ..store import StoreFull

log = logging.getLogger("ragcache.precompute")
PAGE = 500  # rows read at a time: a corpus of 100K chunks is never held whole


def rekey(parts, namespace: str | None) -> int:
    """Recompute and store the KV of every done chunk (of `namespace`, or all) whose key the current settings
    make differently; returns how many rows moved to their new key."""
    moved, last, old_keys = 0, 0, set()
    while True:
        q = select(Chunk.id, Chunk.namespace, Chunk.token_ids, Chunk.kv_key).where(
            Chunk.state == "done", Chunk.kv_key.is_not(None), Chunk.id > last)
        with parts.db.session() as s:
            rows = s.execute((q if namespace is None else q.where(Chunk.namespace == namespace))
                             .order_by(Chunk.id).limit(PAGE)).all()
        if not rows:
            break
        last = rows[-1].id
        for cid, ns, ids_bytes, old in rows:
            ids = unpack_ids(ids_bytes)
            key = parts.kv_key_of(ids, ns)
            if key == old:
                continue
            try:
                if not parts.store.contains(key):  # the same text elsewhere, or a run killed midway, made it
                    _, kv = parts.prefill_for_store(ids, ns)
                    parts.store.put(key, kv, durable=True)
            except StoreFull:
                continue  # no tier has room: computed at its first miss, as an evicted chunk is
            except Exception as e:  # noqa: BLE001 — one chunk's failure leaves it to its first miss, stops nothing
                log.warning("chunk %s: its KV under the current settings failed (%s: %s)", cid, type(e).__name__, e)
                continue
            with parts.db.session() as s:
                moved += s.execute(update(Chunk).where(Chunk.id == cid, Chunk.kv_key == old)
                                   .values(kv_key=key)).rowcount
            old_keys.add(old)
    with parts.db.session() as s:
        orphans = old_keys - keys_in_use(s, old_keys)
    for key in sorted(orphans):
        parts.store.delete(key)
    return moved
