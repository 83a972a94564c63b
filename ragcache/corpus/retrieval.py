"""Retrieval over a namespace's two indexes, each a cache of SQL: FAISS (dense) and BM25 (lexical).

Every change to what a namespace can retrieve bumps its `index_versions` row, whichever process
made it; a search reads that number (one small SELECT) and re-syncs the index it uses when the
number moved: FAISS from the chunks' stored embeddings, BM25 from their texts (the title and heading
path line included). `hybrid` fuses the two rankings by reciprocal rank (`index.fusion`), each taken
`DEPTH` deep. The BM25 index lives in memory and is loaded by the first search that needs it.
"""
from __future__ import annotations

import threading

import numpy as np
from sqlalchemy import select

from index import rrf

from ..errors import UserError
from ..meta import Chunk

RETRIEVERS = ("dense", "bm25", "hybrid")
DEPTH = 50  # each ranking a hybrid search fuses holds at least this many (k × 4 when more)


class Retriever:
    def __init__(self, parts):
        self.p = parts
        self._synced: dict[tuple[str, str], int] = {}  # (index kind, namespace) → index version it holds
        self._lock = threading.Lock()

    def _indexes(self, kinds) -> dict:
        return {kind: self.p.index if kind == "dense" else self.p.lexical for kind in kinds}

    def refresh(self, namespace: str, kinds=("dense",)) -> None:
        """Re-sync the named indexes of the namespace that another process (or this one) changed."""
        version = self.p.db.index_version(namespace)
        stale = [kind for kind in kinds if self._synced.get((kind, namespace)) != version]
        if stale:
            self.sync(namespace, stale)

    def sync(self, namespace: str, kinds=None) -> int:
        """Make the indexes hold exactly the namespace's served done chunks (FAISS, and BM25 once loaded);
        returns the changes."""
        if kinds is None:
            kinds = ("dense", "bm25") if self.p.loaded("lexical") else ("dense",)
        db, changes = self.p.db, 0
        with self._lock:
            version = db.index_version(namespace)  # read first: a change after it re-syncs next time
            with db.session() as s:
                want = set(s.scalars(select(Chunk.id).where(  # staged chunks wait for their swap
                    Chunk.namespace == namespace, Chunk.state == "done", Chunk.staged.is_(False),
                    Chunk.embedding.is_not(None))))
            for kind, index in self._indexes(kinds).items():
                have = index.ids(namespace)
                extra, missing = np.asarray(sorted(have - want), dtype=np.int64), sorted(want - have)
                if len(extra):
                    index.remove(namespace, extra)
                for i in range(0, len(missing), 1000):
                    self._add(kind, index, namespace, missing[i : i + 1000])
                if kind == "dense" and (len(extra) or missing):
                    index.save(namespace)
                self._synced[(kind, namespace)] = version
                changes = max(changes, len(extra) + len(missing))
        return changes

    def _add(self, kind: str, index, namespace: str, ids: list[int]) -> None:
        column = Chunk.embedding if kind == "dense" else Chunk.text
        with self.p.db.session() as s:
            rows = dict(s.execute(select(Chunk.id, column).where(Chunk.id.in_(ids))).all())
        ids = [c for c in ids if rows.get(c) is not None]  # deleted since: the next sync sees it
        if not ids:
            return
        if kind == "dense":
            index.add(namespace, np.asarray(ids, dtype=np.int64),
                      np.stack([np.frombuffer(rows[c], dtype=np.float32) for c in ids]))
        else:
            index.add(namespace, ids, [rows[c] for c in ids])

    def remove(self, namespace: str, ids: list[int]) -> None:
        """Drop chunks this process deleted from its FAISS file and its BM25 index, if loaded, at once
        (other processes re-sync)."""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            return
        self.p.index.remove(namespace, ids)
        self.p.index.save(namespace)
        if self.p.loaded("lexical"):
            self.p.lexical.remove(namespace, ids)

    def ranked(self, query: str, namespace: str, k: int, retrieval: str) -> list[tuple[int, float]]:
        """The top-k chunk ids for `query`, best first, with the retriever's score (hybrid: fused)."""
        if retrieval not in RETRIEVERS:
            raise UserError(f"retrieval must be one of {', '.join(RETRIEVERS)}, not {retrieval!r}")
        kinds = ("dense", "bm25") if retrieval == "hybrid" else (retrieval,)
        self.refresh(namespace, kinds)
        depth = k if retrieval != "hybrid" else max(DEPTH, 4 * k)
        lists = []
        if "dense" in kinds:
            lists.append(self.p.index.search(namespace, self.p.embedder.embed([query])[0], depth))
        if "bm25" in kinds:
            lists.append(self.p.lexical.search(namespace, query, depth))
        return lists[0][:k] if len(lists) == 1 else rrf(lists, k)
