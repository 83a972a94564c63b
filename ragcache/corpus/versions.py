"""A changed document's next version: staged beside the one served until it is precomputed, then swapped.

Re-ingesting a document whose served chunks are retrievable (one of them done) stages the new chunks
(`chunks.staged`, the new text's hash and title on the document row) and keeps the old ones: the
indexes, retrieval and serving see only the served chunks meanwhile, so a query gets the old passages,
never none and never a mix. Once every staged chunk is done, `swap_ready` makes them the document's
and retires the old ones in one transaction that moves the namespace's index version, as a delete
does: every process's FAISS and BM25 drop the old chunks and take the new ones at their next search.
The precompute job swaps after each batch it commits and, at its end, whatever a killed run left
ready. A re-ingest meanwhile replaces the staged version (the last write wins); a delete takes both.
A staged chunk that fails for good keeps the old version served until `--retry-failed`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from ..database import Database
from ..meta import Chunk, bump_index_versions, in_batches, keys_in_use
from ..meta import Document as DocRow


@dataclass
class Swapped:
    documents: int = 0
    chunk_ids: list[int] = field(default_factory=list)  # the old chunks retired
    orphan_kv_keys: list[str] = field(default_factory=list)  # their KV entries no chunk names any more
    namespaces: set[str] = field(default_factory=set)


def lock_document(s: Session, doc_id: int) -> bool:
    """Hold the document's row until `s` commits (False: it is gone): an UPDATE that changes nothing, so
    PostgreSQL locks the row and SQLite takes its one write lock. What is read after it stays true until
    the commit; every writer of a document's chunks (ingest, swap, delete) takes it first: one order, no
    deadlock."""
    return s.execute(update(DocRow).where(DocRow.id == doc_id).values(text_hash=DocRow.text_hash)).rowcount == 1


def serves(s: Session, doc_id: int) -> bool:
    """Whether the document's served version has a retrievable chunk (one that is done)."""
    q = select(Chunk.id).where(Chunk.document_id == doc_id, Chunk.staged.is_(False), Chunk.state == "done")
    return s.scalar(q.limit(1)) is not None


def swap_ready(db: Database, namespace: str | None = None, chunk_ids: list[int] | None = None) -> Swapped:
    """Swap in every staged version whose chunks are all done: of the documents of `chunk_ids` (a batch
    just committed), else of `namespace`, else anywhere. One transaction per document."""
    with db.session() as s:
        q = select(Chunk.document_id).distinct().where(Chunk.staged)
        if namespace is not None:
            q = q.where(Chunk.namespace == namespace)
        parts = [q.where(Chunk.id.in_(part)) for part in in_batches(chunk_ids)] if chunk_ids is not None else [q]
        candidates = sorted({d for part in parts for d in s.scalars(part)})
    out = Swapped()
    for part in in_batches(candidates):
        with db.session() as s:  # a read: only a ready document takes a lock
            unfinished = set(s.scalars(select(Chunk.document_id).where(
                Chunk.document_id.in_(part), Chunk.staged, Chunk.state != "done")))
        for doc_id in part:
            if doc_id not in unfinished:
                _swap(db, doc_id, out)
    return out


def _swap(db: Database, doc_id: int, out: Swapped) -> None:
    with db.session() as s:
        if not lock_document(s, doc_id):
            return  # deleted meanwhile
        doc = s.get(DocRow, doc_id)  # read after the lock: a re-ingest meanwhile is seen
        states = set(s.scalars(select(Chunk.state).distinct().where(Chunk.document_id == doc_id, Chunk.staged)))
        if doc.staged_hash is None or states != {"done"}:
            return
        old = s.execute(select(Chunk.id, Chunk.kv_key).where(Chunk.document_id == doc_id,
                                                             Chunk.staged.is_(False))).all()
        s.execute(delete(Chunk).where(Chunk.document_id == doc_id, Chunk.staged.is_(False)))
        s.execute(update(Chunk).where(Chunk.document_id == doc_id, Chunk.staged).values(staged=False))
        doc.text_hash, doc.title, doc.staged_hash, doc.staged_title = doc.staged_hash, doc.staged_title, None, None
        bump_index_versions(s, [doc.namespace])
        keys = {k for _, k in old if k}
        out.orphan_kv_keys += sorted(keys - keys_in_use(s, keys))
        out.chunk_ids += [cid for cid, _ in old]
        out.documents += 1
        out.namespaces.add(doc.namespace)
