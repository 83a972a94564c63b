"""The metadata database (meta.py's tables): engine, sessions, and the schema created or upgraded at start.

Schema changes: the schema is created at start (`create_all`, idempotent) and carries a
version in `schema_info`; a change bumps SCHEMA_VERSION and adds a step to `_MIGRATIONS`
(plain DDL run once, in order), so an existing database is upgraded in place at start.
"""
from __future__ import annotations

import re
import secrets
from contextlib import contextmanager
from typing import Iterator

from sqlalchemy import create_engine, event, inspect, text
from sqlalchemy.exc import ArgumentError, IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from .errors import UserError
from .meta import Base, IndexVersion, Namespace, SchemaInfo

SCHEMA_VERSION = 10
_SCHEMA_LOCK = 0x7261676361636865  # PostgreSQL advisory lock key ("ragcache") for schema changes
_MIGRATIONS: dict[int, list[str]] = {  # version → DDL statements that bring version-1 up to it
    2: ["ALTER TABLE jobs ADD COLUMN error TEXT"],  # (index_versions is a new table: create_all makes it)
    3: ["ALTER TABLE chunks ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE chunks ADD COLUMN retry_at TIMESTAMP WITH TIME ZONE"],
    4: ["ALTER TABLE kv_entries ADD COLUMN cost_s FLOAT",  # where a blob is moves to kv_copies, per store:
        "CREATE TABLE legacy_disk_copies AS SELECT key, bytes, checksum FROM kv_entries WHERE on_disk",
        *[f"ALTER TABLE kv_entries DROP COLUMN {c}" for c in ("on_disk", "in_redis", "bytes", "checksum")]],
    5: ["ALTER TABLE chunks ADD COLUMN heading TEXT", "ALTER TABLE chunks ADD COLUMN page INTEGER"],
    6: ["ALTER TABLE documents ADD COLUMN staged_hash VARCHAR(64)", "ALTER TABLE documents ADD COLUMN staged_title TEXT",
        "ALTER TABLE chunks ADD COLUMN staged BOOLEAN NOT NULL DEFAULT FALSE",  # a document's ordinals, once per
        "DROP INDEX ux_chunks_doc_ordinal",  # version: the served one and the staged one
        "CREATE UNIQUE INDEX ux_chunks_doc_staged_ordinal ON chunks (document_id, staged, ordinal)"],
    7: ["ALTER TABLE model_defaults ADD COLUMN points TEXT"],
    8: ["ALTER TABLE model_defaults ADD COLUMN ape VARCHAR(32)"],
    9: [],  # leads is a new table: create_all makes it
    10: ["ALTER TABLE model_defaults ADD COLUMN chunk_prefill VARCHAR(16)"],
}


class Database:
    """Engine + sessions. One per process; thread-safe (a session per `session()` call)."""

    def __init__(self, url: str):
        self.is_sqlite = url.startswith("sqlite")
        kwargs = {"connect_args": {"timeout": 60, "check_same_thread": False}} if self.is_sqlite else {}
        try:
            self.engine = create_engine(url, pool_pre_ping=True, **kwargs)
        except ArgumentError as e:
            raise UserError(f"database URL {url!r} is not usable ({e}): set RAGCACHE_DATABASE_URL to "
                            "sqlite:///PATH or postgresql+psycopg://…") from None
        if self.is_sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        try:
            self._create_schema()
        except OperationalError as e:
            self.engine.dispose()
            raise UserError(f"cannot open the database at {self.engine.url!r}: {e.orig}", usage=False) from None

    def _create_schema(self) -> None:
        """Create or upgrade the schema in one transaction; on PostgreSQL under an advisory lock, so
        processes starting together on a fresh database take turns instead of racing on the DDL."""
        with self.session() as s:
            if not self.is_sqlite:
                s.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK})
            Base.metadata.create_all(s.connection())
            info = s.get(SchemaInfo, 1)
            if info is None:
                s.add(SchemaInfo(id=1, version=SCHEMA_VERSION))
                return
            if info.version > SCHEMA_VERSION:
                raise UserError(f"the database has schema version {info.version}, newer than this ragcache "
                                f"(version {SCHEMA_VERSION}): upgrade ragcache to use it", usage=False)
            for version in range(info.version + 1, SCHEMA_VERSION + 1):
                for ddl in _MIGRATIONS.get(version, []):
                    if not _applied(s, ddl):  # SQLite commits each ALTER: a step cut short is not redone
                        s.execute(text(ddl))
                info.version = version

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A transaction: committed on success, rolled back on error."""
        with self._sessions() as s, s.begin():
            yield s

    def namespace_salt(self, name: str, shared: bool) -> str:
        """The tenant's key salt ("" when caching is shared across namespaces)."""
        if shared:
            return ""
        with self.session() as s:
            ns = s.get(Namespace, name)
            if ns is not None:
                return ns.salt
            try:
                with s.begin_nested():
                    s.add(Namespace(name=name, salt=secrets.token_hex(16)))
            except IntegrityError:  # created concurrently
                pass
        with self.session() as s:
            return s.get(Namespace, name).salt

    def index_version(self, namespace: str) -> int:
        with self.session() as s:
            row = s.get(IndexVersion, namespace)
            return 0 if row is None else row.version

    def dispose(self) -> None:
        self.engine.dispose()


def _applied(s: Session, ddl: str) -> bool:
    """True for a step already done: a column added or dropped, a table or an index created or dropped."""
    look = inspect(s.connection())
    if m := re.match(r"CREATE TABLE (\w+)", ddl):
        return look.has_table(m[1])
    if m := re.match(r"(CREATE UNIQUE|DROP) INDEX (\w+)", ddl):
        present = any(ix["name"] == m[2] for table in look.get_table_names() for ix in look.get_indexes(table))
        return present == (m[1] != "DROP")
    m = re.match(r"ALTER TABLE (\w+) (ADD|DROP) COLUMN (\w+)", ddl)
    return bool(m) and (m[3] in {c["name"] for c in look.get_columns(m[1])}) == (m[2] == "ADD")


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
    cur.execute("PRAGMA synchronous=FULL")  # a committed row survives a crash
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=60000")
    cur.close()
