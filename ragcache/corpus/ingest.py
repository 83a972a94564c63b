"""Documents into SQL: new ones added, unchanged ones left alone, changed ones replaced.

Replacing a document removes its old chunks' rows, their index vectors and the KV entries
no other chunk still uses.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from sqlalchemy import delete, func, select

from ..meta import Chunk, Database, bump_index_versions
from ..meta import Document as DocRow
from .chunking import Document, chunk_document


@dataclass
class IngestReport:
    added: int = 0
    unchanged: int = 0
    replaced: int = 0
    chunks_added: int = 0
    chunks_removed: int = 0
    removed_chunk_ids: list[int] = field(default_factory=list)
    orphan_kv_keys: list[str] = field(default_factory=list)  # KV entries no chunk references any more
    errors: list[str] = field(default_factory=list)  # "file: why", one per file that could not be read

    def line(self) -> str:
        return (f"documents: added={self.added} unchanged={self.unchanged} replaced={self.replaced}; "
                f"chunks: added={self.chunks_added} removed={self.chunks_removed}"
                + (f"; files not read: {len(self.errors)}" if self.errors else ""))


def same_tokenizer(model) -> list[str]:
    """What a chunk row's `model` may hold for this model's tokenizer: its id, or (rows from before
    the tokenizer had its own id) this very model's fingerprint."""
    return [model.tokenizer_id, model.fingerprint]


def ingest_documents(db: Database, tokenizer, tokenizer_ids: list[str], docs: list[Document], namespace: str,
                     max_tokens: int, key_of=None) -> IngestReport:
    """`tokenizer_ids`: what chunks made by this tokenizer carry (the first is written); a document
    whose chunks another tokenizer made is re-tokenized even if its text is unchanged.
    `key_of(token_ids)`, when given, names the KV key a new chunk will have: a replaced document's
    entries that its new chunks will use again are kept (KV is keyed by content), not orphaned."""
    report, new_ids = IngestReport(), {}  # external id → its new chunks' token ids (the last version wins)
    tokenizer_id = tokenizer_ids[0]
    chunked = _chunk_changed(db, tokenizer, tokenizer_ids, docs, namespace, max_tokens)
    with db.session() as s:
        existing = {d.external_id: d for d in s.scalars(select(DocRow).where(DocRow.namespace == namespace))}
        foreign = set(s.scalars(select(Chunk.document_id).distinct().where(
            Chunk.namespace == namespace, Chunk.model.not_in(tokenizer_ids))))
        for doc in docs:
            row = existing.get(doc.external_id)
            if row is not None and row.text_hash == doc.text_hash and row.id not in foreign:
                report.unchanged += 1
                continue
            if row is not None:
                old = list(s.scalars(select(Chunk).where(Chunk.document_id == row.id)))
                report.removed_chunk_ids += [c.id for c in old]
                report.orphan_kv_keys += [c.kv_key for c in old if c.kv_key]
                report.chunks_removed += len(old)
                s.execute(delete(Chunk).where(Chunk.document_id == row.id))
                row.title, row.text_hash = doc.title, doc.text_hash
                report.replaced += 1
            else:
                row = DocRow(namespace=namespace, external_id=doc.external_id, title=doc.title,
                             text_hash=doc.text_hash)
                s.add(row)
                s.flush()
                existing[doc.external_id] = row
                report.added += 1
            specs = chunked.get(doc.external_id) or chunk_document(tokenizer, doc, max_tokens)  # changed since
            new_ids[doc.external_id] = [spec.token_ids for spec in specs]
            for spec in specs:
                s.add(Chunk(document_id=row.id, namespace=namespace, ordinal=spec.ordinal, text=spec.text,
                            heading=spec.heading or None, page=spec.page, n_tokens=len(spec.token_ids), token_ids=pack_ids(spec.token_ids),
                            model=tokenizer_id))
                report.chunks_added += 1
        s.flush()
        if report.removed_chunk_ids:
            bump_index_versions(s, [namespace])  # other processes drop the old chunks from their indexes
        if report.orphan_kv_keys:
            still_used = set(s.scalars(select(Chunk.kv_key).where(Chunk.kv_key.in_(report.orphan_kv_keys))))
            report.orphan_kv_keys = sorted(set(report.orphan_kv_keys) - still_used)
    if report.orphan_kv_keys and key_of is not None:  # after the commit: key_of may read SQL itself
        reused = {key_of(ids) for chunks in new_ids.values() for ids in chunks}
        report.orphan_kv_keys = sorted(set(report.orphan_kv_keys) - reused)
    return report


def _chunk_changed(db: Database, tokenizer, tokenizer_ids: list[str], docs: list[Document], namespace: str,
                   max_tokens: int) -> dict:
    """external id → chunks of each document that is new or changed, tokenized before the write transaction
    opens: SQLite's one writer lock is never held while thousands of documents tokenize."""
    with db.session() as s:
        known = dict(s.execute(select(DocRow.external_id, DocRow.text_hash).where(DocRow.namespace == namespace)).all())
        foreign = set(s.scalars(select(DocRow.external_id).join(Chunk, Chunk.document_id == DocRow.id).where(
            DocRow.namespace == namespace, Chunk.model.not_in(tokenizer_ids))))
    return {d.external_id: chunk_document(tokenizer, d, max_tokens) for d in docs
            if known.get(d.external_id) != d.text_hash or d.external_id in foreign}


def pack_ids(token_ids) -> bytes:
    """Token ids as a chunk row stores them: int32 bytes."""
    return np.asarray(token_ids, np.int32).tobytes()


def unpack_ids(stored: bytes) -> torch.Tensor:
    """A chunk row's token ids → (n,) int64."""
    return torch.from_numpy(np.frombuffer(stored, np.int32).astype(np.int64))


def corpus_counts(db: Database, namespace: str | None = None) -> dict[str, int]:
    """Chunks per precompute state."""
    with db.session() as s:
        q = select(Chunk.state, func.count()).group_by(Chunk.state)
        if namespace is not None:
            q = q.where(Chunk.namespace == namespace)
        return dict(s.execute(q).all())
