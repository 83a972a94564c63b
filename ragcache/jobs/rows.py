"""Job rows and chunk counts by precompute state: what the precompute job and a server's jobs share."""
from __future__ import annotations

from sqlalchemy import func, select

from ..database import Database
from ..meta import Chunk, Job, utcnow

LOCK_FILE = "precompute.lock"  # in RAGCACHE_HOME: SQLite's one-precompute-at-a-time lock


def join_or_start_job(db: Database, namespace: str | None) -> int:
    """The running job of `namespace`, or a new one (counting what is already done as skipped)."""
    with db.session() as s:
        job = s.scalars(select(Job).where(Job.state == "running", Job.namespace.is_(None) if namespace is None
                                          else Job.namespace == namespace).order_by(Job.id.desc())).first()
        if job is None:
            job = Job(namespace=namespace, state="running", skipped=count_in(s, namespace, "done"))
            s.add(job)
            s.flush()
        job.total = count_in(s, namespace, None)
        return job.id


def finish_job_if_empty(db: Database, job_id: int, namespace: str | None) -> None:
    if count_chunks(db, namespace, "pending") or count_chunks(db, namespace, "running"):
        return
    with db.session() as s:
        job = s.get(Job, job_id)
        if job is not None and job.state == "running":
            job.state, job.finished = "finished", utcnow()
            job.seconds = (job.finished - job.started.replace(tzinfo=job.finished.tzinfo)).total_seconds()


def count_chunks(db: Database, namespace: str | None, state: str, by: str | None = None) -> int:
    with db.session() as s:
        return count_in(s, namespace, state, by)


def count_in(s, namespace: str | None, state: str | None, by: str | None = None) -> int:
    q = select(func.count()).select_from(Chunk)
    if state is not None:
        q = q.where(Chunk.state == state)
    if namespace is not None:
        q = q.where(Chunk.namespace == namespace)
    if by is not None:
        q = q.where(Chunk.claimed_by.like(f"%:{by}:%"))  # workers of one run: host:pid:RUN:i
    return int(s.scalar(q))
