"""The corpus role: documents in and out of SQL, and retrieval over each namespace's indexes.

SQL is the truth; a process's FAISS and BM25 indexes are caches of the namespace's done chunks,
kept in step by `retrieval.Retriever` (every change bumps the namespace's `index_versions` row:
ingest replacing a document, precompute finishing chunks, a delete, whichever process made it).
A server's large ingests run in a child process (`ingest_process`); the rest runs in the caller's thread.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from sqlalchemy import delete, select

from ..errors import NotFound, UserError
from ..meta import Chunk, bump_index_versions, keys_in_use
from ..meta import Document as DocRow
from .body import parse_body
from .chunking import Document
from .ingest import IngestReport, corpus_counts, ingest_documents, same_tokenizer
from .ingest_process import APART_CHARS, IngestProcess
from .readers import read_documents, read_file
from .retrieval import Retriever
from .versions import lock_document


@dataclass(frozen=True)
class ChunkHit:
    id: int
    doc_id: str
    score: float
    text: str
    heading: str = ""  # its heading path, " > "-joined
    page: int | None = None


class Corpus:
    def __init__(self, parts):
        self.p = parts
        self.retriever = Retriever(parts)
        self._apart: IngestProcess | None = None  # large ingests' child process (`apart`), made on first use

    # ---- documents -----------------------------------------------------------------------------

    def ingest(self, path: str | Path, namespace: str = "default") -> IngestReport:
        """A file or a folder; a folder's files that cannot be read are in the report's `errors`."""
        reading = read_documents(Path(path))
        if not reading.documents:
            raise UserError(f"{path}: no file could be read: " + "; ".join(reading.errors))
        report = self.ingest_documents(reading.documents, namespace)
        report.errors = reading.errors
        return report

    def ingest_documents(self, docs: list[Document], namespace: str = "default", apart: bool = False) -> IngestReport:
        """`apart`: if the documents hold APART_CHARS of text or more, they are chunked and written by a child
        process (`ingest_process`), the server's way: its Python then never holds this process's GIL."""
        if not docs:
            raise UserError("no documents given")
        p = self.p
        args = (same_tokenizer(p.model), docs, namespace, p.settings.chunk_tokens)
        if apart and (child := self._child(sum(len(d.text) for d in docs))) is not None:
            return self._ingested(child.ingest(*args), namespace)
        return self._ingested(ingest_documents(p.db, p.tokenizer, *args), namespace)

    def ingest_body(self, raw: bytes, content_type: str, namespace: str = "default") -> IngestReport:
        """A request body of documents (`body.parse_body`: JSON or JSON lines); one of APART_CHARS bytes or more is
        parsed, chunked and written by the child process (the whole of its Python off this process's GIL)."""
        p = self.p
        if (child := self._child(len(raw))) is not None:
            report = child.ingest_body(same_tokenizer(p.model), raw, content_type, namespace, p.settings.chunk_tokens)
            return self._ingested(report, namespace)
        return self.ingest_documents(parse_body(raw, content_type), namespace)

    def _ingested(self, report: IngestReport, namespace: str) -> IngestReport:
        """An ingest's report, once its removed chunks left this process's index and its orphan KV the store."""
        p = self.p
        self.retriever.remove(namespace, report.removed_chunk_ids)
        # KV is keyed by content: an old entry that a new chunk will use again is no orphan
        reused = {p.kv_key_of(torch.tensor(ids), namespace) for ids in report.new_token_ids}
        report.orphan_kv_keys = sorted(set(report.orphan_kv_keys) - reused)
        for key in report.orphan_kv_keys:
            p.store.delete(key)
        return report

    def read_file(self, name: str, data: bytes) -> list[Document]:
        """An uploaded file's documents (`readers.read_file`); a large one's read in the child process."""
        child = self._child(len(data))
        return child.read(name, data) if child is not None else read_file(name, data)

    def apart(self, size: int) -> bool:
        """Whether work of `size` (characters, bytes) goes to the child process: from APART_CHARS up, given a model
        on disk for its tokenizer."""
        return size >= APART_CHARS and self.p.model.path is not None

    def _child(self, size: int) -> IngestProcess | None:
        """The child process, for work of `size` that goes there (`apart`); None: in this thread."""
        if not self.apart(size):
            return None
        if self._apart is None:
            self._apart = IngestProcess(self.p.model.path, self.p.model.tokenizer_id, self.p.settings.db_url)
        return self._apart

    @property
    def apart_pid(self) -> int | None:
        """The large ingests' child process, while it runs."""
        return self._apart.pid if self._apart is not None else None

    def close(self) -> None:
        if self._apart is not None:
            self._apart.close()

    def document(self, namespace: str, external_id: str) -> dict:
        """Its served chunks, and (`staged`) those of a changed version until they are precomputed."""
        with self.p.db.session() as s:
            doc = self._doc(s, namespace, external_id)
            rows = s.execute(select(Chunk.id, Chunk.state, Chunk.n_tokens, Chunk.staged)
                             .where(Chunk.document_id == doc.id).order_by(Chunk.ordinal)).all()
        served, staged = _version([r for r in rows if not r.staged]), _version([r for r in rows if r.staged])
        return {"id": doc.external_id, "namespace": doc.namespace, "title": doc.title,
                "created": doc.created.isoformat(), **served,
                "staged": {"title": doc.staged_title, **staged} if doc.staged_hash is not None else None}

    def delete_document(self, namespace: str, external_id: str) -> dict:
        """Its chunks (served and staged) leave SQL, this process's index (others re-sync: the version
        moves) and the store."""
        with self.p.db.session() as s:
            doc = self._doc(s, namespace, external_id)
            if not lock_document(s, doc.id):  # an ingest, a swap or a delete of it under way finishes first
                raise NotFound(f"no document {external_id!r} in namespace {namespace!r}")
            chunks = s.execute(select(Chunk.id, Chunk.kv_key).where(Chunk.document_id == doc.id)).all()
            s.execute(delete(Chunk).where(Chunk.document_id == doc.id))
            s.delete(doc)
            keys = {k for _, k in chunks if k}
            shared = keys_in_use(s, keys)
            bump_index_versions(s, [namespace])
        self.retriever.remove(namespace, [cid for cid, _ in chunks])
        for key in keys - shared:
            self.p.store.delete(key)
        return {"id": external_id, "namespace": namespace, "chunks_removed": len(chunks),
                "kv_entries_removed": len(keys - shared)}

    @staticmethod
    def _doc(s, namespace: str, external_id: str) -> DocRow:
        doc = s.scalars(select(DocRow).where(DocRow.namespace == namespace, DocRow.external_id == external_id)).first()
        if doc is None:
            raise NotFound(f"no document {external_id!r} in namespace {namespace!r}")
        return doc

    def counts(self, namespace: str | None = None) -> dict[str, int]:
        return corpus_counts(self.p.db, namespace)

    # ---- retrieval -----------------------------------------------------------------------------

    def refresh(self, namespace: str) -> None:
        self.retriever.refresh(namespace, ("dense", "bm25") if self.p.loaded("lexical") else ("dense",))

    def sync_index(self, namespace: str) -> int:
        return self.retriever.sync(namespace)

    def prune_index(self) -> list[str]:
        """FAISS partitions of namespaces that hold no chunk any more dropped; their files."""
        with self.p.db.session() as s:
            live = list(s.scalars(select(Chunk.namespace).distinct()))
        return self.p.index.keep_only(live)

    def search(self, query: str, namespace: str = "default", k: int | None = None,
               retrieval: str | None = None) -> list[ChunkHit]:
        return [hit for hit, _ in self.retrieve(query, namespace, k, retrieval)]

    def retrieve(self, query: str, namespace: str, k: int | None,
                 retrieval: str | None = None) -> list[tuple[ChunkHit, Chunk]]:
        """The top-k chunks for `query`, best first, with their rows (retrieval: the setting's by default)."""
        check_query(query)
        found = self.retriever.ranked(query, namespace, k or self.p.settings.top_k,
                                      retrieval or self.p.settings.retrieval)
        if not found:
            return []
        with self.p.db.session() as s:
            rows = {c.id: (c, d.external_id) for c, d in s.execute(
                select(Chunk, DocRow).join(DocRow, DocRow.id == Chunk.document_id).where(
                    Chunk.id.in_([i for i, _ in found]), Chunk.namespace == namespace))}
        return [(ChunkHit(i, rows[i][1], score, rows[i][0].text, rows[i][0].heading or "", rows[i][0].page),
                 rows[i][0]) for i, score in found if i in rows]

    def chunk_rows(self, namespace: str, chunk_ids: list[int] | None = None, doc_id: str | None = None) -> list:
        """(chunk id, document id, token ids bytes) of the named chunks or document, all in `namespace`."""
        if (chunk_ids is None) == (doc_id is None):
            raise UserError("name either chunk_ids or doc_id")
        with self.p.db.session() as s:
            q = select(Chunk.id, DocRow.external_id, Chunk.token_ids).join(DocRow, DocRow.id == Chunk.document_id)
            if doc_id is not None:
                self._doc(s, namespace, doc_id)
                q = q.where(DocRow.namespace == namespace, DocRow.external_id == doc_id, Chunk.staged.is_(False))
            else:
                q = q.where(Chunk.namespace == namespace, Chunk.id.in_(chunk_ids))
            rows = s.execute(q.order_by(Chunk.id)).all()
        if chunk_ids is not None:
            unknown = sorted(set(chunk_ids) - {r[0] for r in rows})
            if unknown:
                raise NotFound(f"no chunk {unknown[0]} in namespace {namespace!r}")
        return rows


def _version(rows) -> dict:
    """chunk ids (in order), tokens and chunks by state of one version of a document."""
    states: dict[str, int] = {}
    for r in rows:
        states[r.state] = states.get(r.state, 0) + 1
    return {"chunk_ids": [r.id for r in rows], "tokens": sum(r.n_tokens for r in rows), "chunks_by_state": states}


def check_query(query: str) -> None:
    if not query.strip():
        raise UserError("the query is empty")
