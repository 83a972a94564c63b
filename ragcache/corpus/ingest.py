"""Documents into SQL: new ones added, unchanged ones left alone, changed ones replaced or staged.

A changed document whose served chunks are retrievable keeps them: its new chunks are staged until
they are precomputed (`versions`); a staged version not yet swapped in is replaced by the next change.
Otherwise replacing removes the old chunks' rows, their index vectors and the KV entries no other
chunk still uses.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from sqlalchemy import delete, func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..database import Database
from ..meta import Chunk, bump_index_versions, keys_in_use
from ..meta import Document as DocRow
from .chunking import Document, chunk_document, chunk_documents
from .versions import lock_document, serves

_SLICE = 500  # external ids a lookup: under every database's bound on bound parameters


@dataclass
class IngestReport:
    added: int = 0
    unchanged: int = 0
    replaced: int = 0
    staged: int = 0  # of the replaced, those served as before until their new chunks are precomputed
    chunks_added: int = 0
    chunks_removed: int = 0
    removed_chunk_ids: list[int] = field(default_factory=list)
    orphan_kv_keys: list[str] = field(default_factory=list)  # KV entries no chunk references any more
    new_token_ids: list[list[int]] = field(default_factory=list)  # the new chunks', where there are orphans
    errors: list[str] = field(default_factory=list)  # "file: why", one per file that could not be read

    def line(self) -> str:
        return (f"documents: added={self.added} unchanged={self.unchanged} replaced={self.replaced}"
                + (f" (staged={self.staged})" if self.staged else "") + "; "
                f"chunks: added={self.chunks_added} removed={self.chunks_removed}"
                + (f"; files not read: {len(self.errors)}" if self.errors else ""))


def same_tokenizer(model) -> list[str]:
    """What a chunk row's `model` may hold for this model's tokenizer: its id, or (rows from before
    the tokenizer had its own id) this very model's fingerprint."""
    return [model.tokenizer_id, model.fingerprint]


def ingest_documents(db: Database, tokenizer, tokenizer_ids: list[str], docs: list[Document], namespace: str,
                     max_tokens: int) -> IngestReport:
    """`tokenizer_ids`: what chunks made by this tokenizer carry (the first is written); a document
    whose chunks another tokenizer made is re-tokenized even if its text is unchanged.
    Where a replaced document leaves KV entries no chunk references, the report holds the new chunks'
    token ids too: an entry one of them will use again (KV is keyed by content) is not an orphan.

    Documents are chunked before the write transaction opens: SQLite's one write lock is never held
    while tokenizing. A document another process adds or replaces meanwhile is taken as found."""
    docs = list({d.external_id: d for d in docs}.values())  # an id given twice: its last version
    report, new_ids = IngestReport(), {}  # external id → its new chunks' token ids
    ids = [d.external_id for d in docs]
    with db.session() as s:
        existing, foreign = _existing(s, namespace, tokenizer_ids, ids)
    todo = [d for d in docs if not _is_unchanged(existing.get(d.external_id), d, foreign)]
    chunked = dict(zip([(d.external_id, d.text_hash) for d in todo], chunk_documents(tokenizer, todo, max_tokens)))
    with db.session() as s:
        existing, foreign = _existing(s, namespace, tokenizer_ids, ids)
        added = _add_all(s, namespace, [d for d in docs if d.external_id not in existing])
        rows = []  # the new chunks, inserted in one statement
        for doc in docs:
            if doc.external_id in added:
                row, staged = added[doc.external_id], False
                report.added += 1
            elif (found := _document_row(s, existing, foreign, namespace, doc, tokenizer_ids, report)) is not None:
                row, staged = found
            else:
                continue
            specs = chunked.get((doc.external_id, doc.text_hash))
            if specs is None:  # changed by another process between the two looks: chunked here (rare)
                specs = chunked[doc.external_id, doc.text_hash] = chunk_document(tokenizer, doc, max_tokens)
            new_ids[doc.external_id] = [spec.token_ids for spec in specs]
            rows += [dict(document_id=row.id, namespace=namespace, ordinal=spec.ordinal, text=spec.text,
                          heading=spec.heading or None, page=spec.page, n_tokens=len(spec.token_ids),
                          token_ids=pack_ids(spec.token_ids), model=tokenizer_ids[0], staged=staged)
                     for spec in specs]
        s.flush()
        if rows:
            s.execute(insert(Chunk), rows)
            report.chunks_added = len(rows)
        if report.removed_chunk_ids:
            bump_index_versions(s, [namespace])  # other processes drop the old chunks from their indexes
        if report.orphan_kv_keys:
            report.orphan_kv_keys = sorted(set(report.orphan_kv_keys) - keys_in_use(s, report.orphan_kv_keys))
    if report.orphan_kv_keys:
        report.new_token_ids = [ids for chunks in new_ids.values() for ids in chunks]
    return report


def _existing(s: Session, namespace: str, tokenizer_ids: list[str],
              external_ids: list[str]) -> tuple[dict[str, DocRow], set[int]]:
    """Those of `external_ids` already in the namespace, and the ids of those whose chunks another
    tokenizer made. Looked up a slice at a time: the cost follows the request, not the namespace."""
    existing, foreign = {}, set()
    for i in range(0, len(external_ids), _SLICE):
        found = list(s.scalars(select(DocRow).where(DocRow.namespace == namespace,
                                                    DocRow.external_id.in_(external_ids[i:i + _SLICE]))))
        existing |= {d.external_id: d for d in found}
        if found:
            foreign |= set(s.scalars(select(Chunk.document_id).distinct().where(
                Chunk.document_id.in_([d.id for d in found]), Chunk.model.not_in(tokenizer_ids))))
    return existing, foreign


def _add_all(s: Session, namespace: str, docs: list[Document]) -> dict[str, DocRow]:
    """New documents' rows by external id, added in one flush; none when a concurrent ingest added
    one of the same ids meanwhile (each then goes the one-at-a-time way of `_document_row`)."""
    rows = {d.external_id: DocRow(namespace=namespace, external_id=d.external_id, title=d.title,
                                  text_hash=d.text_hash) for d in docs}
    if not rows:
        return {}
    try:
        with s.begin_nested():
            s.add_all(rows.values())
    except IntegrityError:
        return {}
    return rows


def _is_unchanged(row: DocRow | None, doc: Document, foreign: set[int]) -> bool:
    """Nothing to do: the text is the one staged, or (nothing staged) the one served, by this tokenizer."""
    return row is not None and row.id not in foreign and (row.staged_hash or row.text_hash) == doc.text_hash


def _document_row(s: Session, existing: dict[str, DocRow], foreign: set[int], namespace: str, doc: Document,
                  tokenizer_ids: list[str], report: IngestReport) -> tuple[DocRow, bool] | None:
    """`doc`'s row and whether its new chunks are staged: added, emptied of its old chunks, or (its
    served chunks retrievable) emptied of a staged version only; None when there is nothing to add."""
    row = existing.get(doc.external_id)
    if row is None:
        try:
            with s.begin_nested():
                row = DocRow(namespace=namespace, external_id=doc.external_id, title=doc.title,
                             text_hash=doc.text_hash)
                s.add(row)
            existing[doc.external_id] = row
            report.added += 1
            return row, False
        except IntegrityError:  # the same new id, just added by a concurrent ingest: theirs is replaced
            row = existing[doc.external_id] = s.scalars(select(DocRow).where(
                DocRow.namespace == namespace, DocRow.external_id == doc.external_id)).one()
            foreign |= set(s.scalars(select(Chunk.document_id).where(
                Chunk.document_id == row.id, Chunk.model.not_in(tokenizer_ids))))
    if _is_unchanged(row, doc, foreign):
        report.unchanged += 1
        return None
    lock_document(s, row.id)  # a concurrent replace, swap or delete of the same document finishes first
    s.refresh(row)
    staging = row.id not in foreign and serves(s, row.id)  # another tokenizer's chunks serve nothing here
    gone = [Chunk.document_id == row.id, *([Chunk.staged] if staging else [])]
    old = list(s.scalars(select(Chunk).where(*gone)))
    report.removed_chunk_ids += [c.id for c in old]
    report.orphan_kv_keys += [c.kv_key for c in old if c.kv_key]
    report.chunks_removed += len(old)
    s.execute(delete(Chunk).where(*gone))
    foreign.discard(row.id)
    report.replaced += 1
    if not staging:
        row.title, row.text_hash, row.staged_hash, row.staged_title = doc.title, doc.text_hash, None, None
        return row, False
    if doc.text_hash == row.text_hash:  # back to the text served: the staged version goes, nothing is added
        row.staged_hash = row.staged_title = None
        return None
    row.staged_hash, row.staged_title = doc.text_hash, doc.title
    report.staged += 1
    return row, True


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
