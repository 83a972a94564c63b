"""Metadata in SQL (SQLAlchemy 2.0 typed ORM): SQLite file by default, PostgreSQL by URL.

Tables: namespaces (per-tenant key salt), documents, chunks (a document's pieces and their
precompute state; a changed document's new pieces `staged` beside the served ones until all are
done, corpus/versions.py), kv_entries (one stored chunk KV, shared by every chunk with the same key),
kv_copies and blob_stores (where each entry's blobs are: per host disk, per deployment Redis),
pins (who pins which entry, within a quota), jobs (precompute runs), model_defaults (what
`calibrate` measured and chose), leads (the passage a namespace's chunks are computed behind, picked once
from its own chunks: chunk_prefill=lead), index_versions (bumped whenever
a namespace's set of retrievable chunks changes: a long-lived process re-syncs its FAISS index
when the number moves, whoever made the change). The engine, sessions and schema upgrades: database.py.
"""
from __future__ import annotations

import json
import re
from datetime import datetime, timezone

from sqlalchemy import (BigInteger, Boolean, DateTime, Float, ForeignKey, Index, Integer, LargeBinary, String, Text,
                        false, select, update)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


class SchemaInfo(Base):
    __tablename__ = "schema_info"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer)


class Namespace(Base):
    __tablename__ = "namespaces"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    salt: Mapped[str] = mapped_column(String(64))  # mixed into every KV key of this tenant
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Document(Base):
    __tablename__ = "documents"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    namespace: Mapped[str] = mapped_column(String(128), index=True)
    external_id: Mapped[str] = mapped_column(String(512))
    title: Mapped[str] = mapped_column(Text, default="")
    text_hash: Mapped[str] = mapped_column(String(64))  # of the version served
    staged_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)  # of a version being precomputed
    staged_title: Mapped[str | None] = mapped_column(Text, nullable=True)
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    __table_args__ = (Index("ux_documents_ns_ext", "namespace", "external_id", unique=True),)


class Chunk(Base):
    __tablename__ = "chunks"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    document_id: Mapped[int] = mapped_column(ForeignKey("documents.id", ondelete="CASCADE"), index=True)
    namespace: Mapped[str] = mapped_column(String(128), index=True)
    ordinal: Mapped[int] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text)
    heading: Mapped[str | None] = mapped_column(Text, nullable=True)  # its heading path, " > "-joined
    page: Mapped[int | None] = mapped_column(Integer, nullable=True)  # 1-based, in a PDF
    n_tokens: Mapped[int] = mapped_column(Integer)
    token_ids: Mapped[bytes] = mapped_column(LargeBinary)  # int32, the model's tokenizer
    model: Mapped[str] = mapped_column(String(64))  # fingerprint of the model whose tokenizer made them
    kv_key: Mapped[str | None] = mapped_column(String(64), index=True, nullable=True)  # set when done
    embedding: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)  # float32, set when done
    state: Mapped[str] = mapped_column(String(16), default="pending", index=True)  # pending/running/done/failed
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    job_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    claimed_by: Mapped[str | None] = mapped_column(String(128), nullable=True)  # host:pid:run:i
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # failed prefills so far
    retry_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)  # after a failure
    staged: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())  # of the next version
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    __table_args__ = (Index("ux_chunks_doc_staged_ordinal", "document_id", "staged", "ordinal", unique=True),)


class KVEntry(Base):
    """One chunk KV by key, wherever its copies are (kv_copies says where)."""
    __tablename__ = "kv_entries"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    n_tokens: Mapped[int] = mapped_column(Integer)
    kv_dtype: Mapped[str] = mapped_column(String(16))
    cost_s: Mapped[float | None] = mapped_column(Float, nullable=True)  # measured prefill seconds
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    hits: Mapped[int] = mapped_column(Integer, default=0)
    last_access: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Pin(Base):
    """One namespace's pin on one stored entry, and the entry's bytes then: its share of the
    namespace's pin quota. An entry stays pinned (kv_entries.pinned) while any namespace pins it."""
    __tablename__ = "pins"
    namespace: Mapped[str] = mapped_column(String(128), primary_key=True)
    key: Mapped[str] = mapped_column(String(64), primary_key=True, index=True)
    bytes: Mapped[int] = mapped_column(BigInteger)


class BlobStore(Base):
    """A place blobs live: `disk:<id>` per host directory (several processes of a host share it),
    `redis` per deployment (its `token` prefixes every key). Its use is counted here, where every
    writer sees it."""
    __tablename__ = "blob_stores"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    token: Mapped[str] = mapped_column(String(32), default="")
    used_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    entries: Mapped[int] = mapped_column(Integer, default=0)
    clock: Mapped[float] = mapped_column(Float, default=0.0)  # GDSF ageing: the last evicted priority


class KVCopy(Base):
    """One blob of one entry in one store. `checksum` is NULL while it is being written: a copy left
    so past a grace period is a crashed put, swept at the next start (a few rows, not every entry)."""
    __tablename__ = "kv_copies"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    store: Mapped[str] = mapped_column(String(64), primary_key=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    checksum: Mapped[str | None] = mapped_column(String(32), nullable=True)  # of this store's blob
    cost: Mapped[float] = mapped_column(Float)  # recompute cost (seconds, or tokens when not measured)
    hits: Mapped[int] = mapped_column(Integer, default=0)
    priority: Mapped[float] = mapped_column(Float, default=0.0)  # eviction order: the lowest goes first
    written: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    __table_args__ = (Index("ix_kv_copies_store_priority", "store", "priority"),)


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    namespace: Mapped[str | None] = mapped_column(String(128), nullable=True)
    state: Mapped[str] = mapped_column(String(16), default="running")  # running/finished/failed/stopped
    total: Mapped[int] = mapped_column(Integer, default=0)
    done: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    skipped: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    seconds: Mapped[float] = mapped_column(Float, default=0.0)
    started: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)  # why a job failed


class IndexVersion(Base):
    __tablename__ = "index_versions"
    namespace: Mapped[str] = mapped_column(String(128), primary_key=True)
    version: Mapped[int] = mapped_column(BigInteger, default=0)


class Lead(Base):
    __tablename__ = "leads"
    namespace: Mapped[str] = mapped_column(String(128), primary_key=True)  # "": every namespace's (shared caching)
    text: Mapped[str] = mapped_column(Text)
    chunk_id: Mapped[int | None] = mapped_column(Integer, nullable=True)  # picked from (that chunk may be gone)
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ModelDefault(Base):
    __tablename__ = "model_defaults"
    fingerprint: Mapped[str] = mapped_column(String(64), primary_key=True)
    mode: Mapped[str] = mapped_column(String(32))
    param: Mapped[float | None] = mapped_column(Float, nullable=True)
    target_kl: Mapped[float] = mapped_column(Float)
    measured_kl: Mapped[float] = mapped_column(Float)
    speedup: Mapped[float] = mapped_column(Float)
    dataset: Mapped[str] = mapped_column(Text)
    created: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    points: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON [{label, kl, speedup}]: all measured
    ape: Mapped[str | None] = mapped_column(String(32), nullable=True)  # "T,S": the APE measured best
    # what the chunk KV was computed as when measured (None: before schema 10; taken as `prefixed`, the default then
    # but for the last release)
    chunk_prefill: Mapped[str | None] = mapped_column(String(16), nullable=True)

    def measured_for(self, chunk_prefill: str) -> bool:
        """Whether these measurements hold for chunk KV computed as `chunk_prefill` (the KLs, and so the fastest
        point within a target and the best APE, differ between them)."""
        return (self.chunk_prefill or "prefixed") == chunk_prefill

    def fastest(self, target_kl: float, family: str | None = None) -> str | None:
        """The label of the fastest point measured within `target_kl` (of one mode's labels), else of the
        closest; None when none was measured (a row from before schema 7)."""
        points = [p for p in json.loads(self.points or "[]") if family in (None, re.split("[@+]", p["label"])[0])]
        fits = [p for p in points if p["kl"] <= target_kl]
        return (max(fits, key=lambda p: p["speedup"]) if fits else min(points, key=lambda p: p["kl"]))["label"] \
            if points else None


def in_batches(items, n: int = 900):
    """`items` in lists of at most `n`: an IN list under SQLite's variable limit (999 before 3.32)."""
    items = list(items)
    return (items[i:i + n] for i in range(0, len(items), n))


def keys_in_use(s: Session, keys) -> set[str]:
    """Those of `keys` some chunk still names (in batches: a replace may drop 100K chunks)."""
    return {k for part in in_batches(set(keys)) for k in s.scalars(select(Chunk.kv_key).where(Chunk.kv_key.in_(part)))}


def bump_index_versions(s: Session, namespaces) -> None:
    """Within `s`'s transaction: every namespace whose retrievable chunks changed moves on by one."""
    for ns in sorted(set(namespaces)):
        bump = update(IndexVersion).where(IndexVersion.namespace == ns).values(version=IndexVersion.version + 1)
        if s.execute(bump).rowcount:
            continue
        try:
            with s.begin_nested():
                s.add(IndexVersion(namespace=ns, version=1))
        except IntegrityError:  # created concurrently: bump theirs
            s.execute(bump)
