"""Chunk claims in SQL: how precompute workers on any number of hosts share the pending chunks.

- A worker is `host:pid:run:i` (its own pid, so a dead worker's claims are found whoever its parent is).
- `claim` takes up to n chunks that are pending (and not waiting out a retry delay) or whose lease
  lapsed, with FOR UPDATE SKIP LOCKED on PostgreSQL; leases are computed on the database's clock,
  which every host shares. A `Heartbeat` renews the worker's leases while it works.
- `commit` marks done ones (with their key and embedding) and sends failed ones back to pending
  with a growing delay, up to `attempts` tries; then they stay `failed`, the reason on the row,
  until `retry_failed`.
"""
from __future__ import annotations

import os
import socket
import threading
from datetime import datetime, timedelta

import numpy as np
from sqlalchemy import func, or_, select, update

from .meta import Chunk, Database, Job, bump_index_versions, utcnow


def worker_id(run: str, i: int) -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{run}:{i}"


def db_now(s, db: Database) -> datetime:
    """PostgreSQL's clock (shared by every host); SQLite's only host is this one."""
    return utcnow() if db.is_sqlite else s.scalar(select(func.now()))


def claim(db: Database, namespace: str | None, worker: str, n: int, lease: timedelta, job_id: int):
    with db.session() as s:
        now = db_now(s, db)
        ready = (Chunk.state == "pending") & (Chunk.retry_at.is_(None) | (Chunk.retry_at <= now))
        q = select(Chunk).where(or_(ready, (Chunk.state == "running") & (Chunk.lease_until < now)))
        if namespace is not None:
            q = q.where(Chunk.namespace == namespace)
        q = q.order_by(Chunk.id).limit(n)
        if not db.is_sqlite:
            q = q.with_for_update(skip_locked=True)
        rows = list(s.scalars(q))
        for r in rows:
            r.state, r.claimed_by, r.lease_until, r.job_id = "running", worker, now + lease, job_id
        return [(r.id, r.namespace, r.token_ids, r.text) for r in rows]


def next_retry(db: Database, namespace: str | None) -> float | None:
    """Seconds until the earliest pending chunk's retry delay ends (None: no chunk waits for one)."""
    with db.session() as s:
        q = select(func.min(Chunk.retry_at)).where(Chunk.state == "pending", Chunk.retry_at.is_not(None))
        if namespace is not None:
            q = q.where(Chunk.namespace == namespace)
        first = s.scalar(q)
        if first is None:
            return None
        now = db_now(s, db)
        first = first if first.tzinfo is not None else first.replace(tzinfo=now.tzinfo)
        return max(0.0, (first - now).total_seconds())


def commit(db: Database, job_id: int, worker: str, done, vectors, failed, attempts: int, backoff_s: float) -> None:
    """Chunk states and the job's counters in one transaction, for chunks this worker still holds;
    the namespaces that gained retrievable chunks move their index version."""
    with db.session() as s:
        ok, grown = 0, set()
        for (cid, ns, key, _, _), vec in zip(done, vectors):
            n = s.execute(update(Chunk).where(Chunk.id == cid, Chunk.state == "running", Chunk.claimed_by == worker)
                          .values(state="done", kv_key=key, embedding=vec.astype(np.float32).tobytes(),
                                  error=None, lease_until=None, retry_at=None)).rowcount
            ok += n
            if n:
                grown.add(ns)
        bump_index_versions(s, grown)
        bad, now = 0, db_now(s, db)
        for cid, err in failed:
            row = s.get(Chunk, cid)
            if row is None or row.claimed_by != worker:
                continue
            row.attempts, row.error, row.lease_until = row.attempts + 1, err[:2000], None
            if row.attempts < attempts:  # back in the pool after 1, 2, 4, … × backoff
                row.state, row.retry_at = "pending", now + timedelta(seconds=backoff_s * 2 ** (row.attempts - 1))
            else:
                row.state = "failed"
                bad += 1
        s.execute(update(Job).where(Job.id == job_id).values(
            done=Job.done + ok, failed=Job.failed + bad, tokens=Job.tokens + sum(n for *_, n in done)))


def retry_failed(db: Database, namespace: str | None) -> int:
    """Failed chunks back to pending with a fresh set of attempts (`ragcache precompute --retry-failed`)."""
    with db.session() as s:
        q = update(Chunk).where(Chunk.state == "failed")
        if namespace is not None:
            q = q.where(Chunk.namespace == namespace)
        return s.execute(q.values(state="pending", attempts=0, retry_at=None)).rowcount


def release_dead(db: Database, single_writer: bool) -> int:
    """Running chunks whose worker is gone go back to pending: all of them under the SQLite lock
    (no other worker can exist), else those of dead processes on this host (other hosts' claims
    return when their leases lapse)."""
    host = socket.gethostname()
    with db.session() as s:
        freed = 0
        for r in s.scalars(select(Chunk).where(Chunk.state == "running")):
            owner = (r.claimed_by or "::").split(":")
            if single_writer or (owner[0] == host and not _alive(int(owner[1] or 0))):
                r.state, r.claimed_by, r.lease_until = "pending", None, None
                freed += 1
        return freed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True


class Heartbeat:
    """While a worker works, its leases are renewed every lease/3: a long batch never looks abandoned."""

    def __init__(self, db: Database, worker: str, lease: timedelta):
        self.db, self.worker, self.lease = db, worker, lease
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-heartbeat", daemon=True)

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(max(0.2, self.lease.total_seconds() / 3)):
            self.renew()

    def renew(self) -> int:
        with self.db.session() as s:
            until = db_now(s, self.db) + self.lease
            return s.execute(update(Chunk).where(Chunk.claimed_by == self.worker, Chunk.state == "running")
                             .values(lease_until=until)).rowcount
