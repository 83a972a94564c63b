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

import logging
import os
import socket
import threading
import time
from datetime import datetime, timedelta

import numpy as np
from sqlalchemy import func, or_, select, update

from ..database import Database
from ..meta import Chunk, Job, bump_index_versions, in_batches, keys_in_use, utcnow

log = logging.getLogger("ragcache.precompute")


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


def next_wake(db: Database, namespace: str | None) -> float | None:
    """Seconds until more work may be claimable: the earliest retry delay of a pending chunk, or the
    earliest lease end of a chunk another worker holds (if that worker died, its chunk becomes ours
    then; while it lives it renews the lease). None: no chunk waits for either."""
    with db.session() as s:
        retry = select(func.min(Chunk.retry_at)).where(Chunk.state == "pending", Chunk.retry_at.is_not(None))
        held = select(func.min(Chunk.lease_until)).where(Chunk.state == "running")
        if namespace is not None:
            retry, held = retry.where(Chunk.namespace == namespace), held.where(Chunk.namespace == namespace)
        times = [t for t in (s.scalar(retry), s.scalar(held)) if t is not None]
        if not times:
            return None
        now = db_now(s, db)
        first = min(t if t.tzinfo is not None else t.replace(tzinfo=now.tzinfo) for t in times)
        return max(0.0, (first - now).total_seconds())


def commit(db: Database, job_id: int, worker: str, done, vectors, failed, attempts: int,
           backoff_s: float) -> int:
    """Chunk states and the job's counters in one transaction, for chunks this worker still holds;
    the namespaces that gained retrievable chunks (staged ones wait for their swap) move their index
    version. Rows are updated in id order (the heartbeat skips locked rows): no deadlock. Returns how
    many chunks ended (done or failed)."""
    with db.session() as s:
        ok = []
        for (cid, _, key, _, _), vec in sorted(zip(done, vectors), key=lambda d: d[0][0]):
            n = s.execute(update(Chunk).where(Chunk.id == cid, Chunk.state == "running", Chunk.claimed_by == worker)
                          .values(state="done", kv_key=key, embedding=vec.astype(np.float32).tobytes(),
                                  error=None, lease_until=None, retry_at=None)).rowcount
            ok += [cid] * n
        bump_index_versions(s, {ns for part in in_batches(ok) for ns in s.scalars(
            select(Chunk.namespace).where(Chunk.id.in_(part), Chunk.staged.is_(False)))})
        bad, now = 0, db_now(s, db)
        for cid, err in sorted(failed):
            row = s.get(Chunk, cid, with_for_update=True)
            if row is None or row.claimed_by != worker or row.state != "running":
                continue  # its lease lapsed and another worker has it now
            row.attempts, row.error, row.lease_until = row.attempts + 1, err[:2000], None
            if row.attempts < attempts:  # back in the pool after 1, 2, 4, … × backoff (an hour at most)
                delay = min(backoff_s * 2 ** min(row.attempts - 1, 20), 3600.0)
                row.state, row.retry_at = "pending", now + timedelta(seconds=delay)
            else:
                row.state = "failed"
                bad += 1
        s.execute(update(Job).where(Job.id == job_id).values(
            done=Job.done + len(ok), failed=Job.failed + bad, tokens=Job.tokens + sum(n for *_, n in done)))
        return len(ok) + bad


def orphaned(db: Database, done) -> set[str]:
    """Keys of `done` chunks deleted while they were computed (their document removed or replaced)
    that no chunk names: blobs stored for nothing, for the caller to delete. A chunk is alive by its
    id and its text: SQLite gives a deleted chunk's id to the next chunk added."""
    with db.session() as s:
        ids = [d[0] for d in done]
        alive = {tuple(r) for part in in_batches(ids) for r in s.execute(
            select(Chunk.id, Chunk.namespace, Chunk.text).where(Chunk.id.in_(part)))}
        keys = {key for cid, ns, key, text, _ in done if (cid, ns, text) not in alive}
        return keys - keys_in_use(s, keys) if keys else set()


def retry_failed(db: Database, namespace: str | None) -> int:
    """Failed chunks back to pending with a fresh set of attempts (`ragcache precompute --retry-failed`);
    a running job that counted them failed counts them no more."""
    with db.session() as s:
        q = select(Chunk).where(Chunk.state == "failed")
        if namespace is not None:
            q = q.where(Chunk.namespace == namespace)
        rows = list(s.scalars(q.with_for_update()))
        per_job: dict[int, int] = {}
        for r in rows:
            r.state, r.attempts, r.retry_at = "pending", 0, None
            if r.job_id is not None:
                per_job[r.job_id] = per_job.get(r.job_id, 0) + 1
        for job_id, n in per_job.items():
            s.execute(update(Job).where(Job.id == job_id, Job.state == "running").values(failed=Job.failed - n))
        return len(rows)


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
    """While a worker makes progress (`beat()` after each chunk), its leases are renewed every lease/3:
    a long batch never looks abandoned, and a worker stuck for 3 leases lets its chunks go."""

    def __init__(self, db: Database, worker: str, lease: timedelta):
        self.db, self.worker, self.lease = db, worker, lease
        self._stop = threading.Event()
        self._last_beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="lease-heartbeat", daemon=True)

    def beat(self) -> None:
        self._last_beat = time.monotonic()

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        seconds = self.lease.total_seconds()
        while not self._stop.wait(max(0.2, seconds / 3)):
            if time.monotonic() - self._last_beat > 3 * seconds:
                continue  # stuck: no renewal, the leases lapse and another worker takes over
            try:
                self.renew()
            except Exception:  # noqa: BLE001 — a missed renewal is retried at the next tick
                log.warning("lease renewal failed", exc_info=True)

    def renew(self) -> int:
        """Extend this worker's leases; rows a commit holds are skipped (SKIP LOCKED), never waited on."""
        with self.db.session() as s:
            until = db_now(s, self.db) + self.lease
            mine = select(Chunk.id).where(Chunk.claimed_by == self.worker, Chunk.state == "running")
            if not self.db.is_sqlite:
                mine = mine.order_by(Chunk.id).with_for_update(skip_locked=True)
            return s.execute(update(Chunk).where(Chunk.id.in_(mine.scalar_subquery()))
                             .values(lease_until=until)).rowcount
