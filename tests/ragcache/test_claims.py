"""Job lifecycle: failed prefills retried with backoff, --retry-failed, leases renewed on the database's
clock, and each worker its own identity (dead-claim detection per worker, not per parent)."""
from __future__ import annotations

import json
import os
import time
from datetime import timedelta

from sqlalchemy import select

from ragcache.jobs import claims
from ragcache.meta import Chunk, Document, Job
from ragcache.jobs.precompute import run_precompute
from ragcache.service import RagCache

from .test_precompute import _env, _settings


def _add_chunks(db, n: int, namespace: str = "default") -> list[int]:
    with db.session() as s:
        doc = Document(namespace=namespace, external_id="d", title="", text_hash="h")
        s.add(doc)
        s.flush()
        rows = [Chunk(document_id=doc.id, namespace=namespace, ordinal=i, text=f"t{i}", n_tokens=1,
                      token_ids=b"\0\0\0\0", model="m") for i in range(n)]
        s.add_all(rows)
        s.add(Job(id=1, namespace=None))
        s.flush()
        return [r.id for r in rows]


def _service(tmp_path, smollm, **extra):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": f"d{i}", "text": f"Passage {i} about rivers" + " and hills" * i})
                            + "\n" for i in range(4)))  # four lengths: a failure is injected by length
    settings = _settings(_env(tmp_path / "home", smollm, **extra))
    service = RagCache(settings)
    service.ingest(docs)
    return settings, service


def _failing(service, fails: dict[int, int]):
    """compute_chunk_kv that raises for the first `fails[n_tokens]` calls of a chunk of that length."""
    real = service.compute_chunk_kv

    def compute(ids, namespace):
        if fails.get(ids.numel(), 0) > 0:
            fails[ids.numel()] -= 1
            raise RuntimeError("injected prefill failure")
        return real(ids, namespace)

    service.compute_chunk_kv = compute


def test_a_prefill_that_failed_once_is_retried_and_ends_done(tmp_path, smollm):
    settings, service = _service(tmp_path, smollm, RAGCACHE_RETRY_BACKOFF_S=0.3)
    with service.db.session() as s:
        first = s.scalars(select(Chunk).order_by(Chunk.id)).first().n_tokens
    _failing(service, {first: 1})
    summary = run_precompute(settings, progress=False, service=service)
    assert summary.failed == 0 and service.counts() == {"done": 4}
    with service.db.session() as s:
        assert sorted(s.scalars(select(Chunk.attempts))) == [0, 0, 0, 1]  # failed prefills, kept after done
    service.close()


def test_a_chunk_out_of_attempts_keeps_its_reason_until_retry_failed(tmp_path, smollm):
    settings, service = _service(tmp_path, smollm, RAGCACHE_RETRY_BACKOFF_S=0.1, RAGCACHE_PRECOMPUTE_ATTEMPTS=2)
    with service.db.session() as s:
        first = s.scalars(select(Chunk).order_by(Chunk.id)).first().n_tokens
    _failing(service, {first: 2})
    assert run_precompute(settings, progress=False, service=service).failed == 1
    with service.db.session() as s:
        bad = s.scalars(select(Chunk).where(Chunk.state == "failed")).one()
        assert bad.attempts == 2 and "injected prefill failure" in bad.error
    assert run_precompute(settings, progress=False, service=service, retry_failed=True).done == 1
    assert service.counts() == {"done": 4}
    service.close()


def test_a_heartbeat_renews_leases_on_the_database_clock(db):
    _add_chunks(db, 2)
    worker, lease = claims.worker_id("run", 0), timedelta(seconds=1)
    assert len(claims.claim(db, None, worker, 2, lease, 1)) == 2
    with db.session() as s:
        before = max(s.scalars(select(Chunk.lease_until)))
        start = claims.db_now(s, db)
    with claims.Heartbeat(db, worker, lease):
        time.sleep(1.2)
    with db.session() as s:
        after = min(s.scalars(select(Chunk.lease_until)))
    norm = lambda t: t if t.tzinfo else t.replace(tzinfo=start.tzinfo)  # noqa: E731 — SQLite drops the zone
    assert norm(after) > norm(before) and norm(after) > start + lease
    assert claims.claim(db, None, claims.worker_id("other", 0), 2, lease, 1) == []  # still held


def test_dead_claims_are_found_per_worker(db):
    ids = _add_chunks(db, 2)
    lease = timedelta(seconds=600)
    live = claims.worker_id("run", 0)
    dead = live.replace(f":{os.getpid()}:", ":999999:")  # the same run and host, a process that is gone
    claims.claim(db, None, live, 1, lease, 1)
    claims.claim(db, None, dead, 1, lease, 1)
    assert claims.release_dead(db, single_writer=False) == 1
    with db.session() as s:
        states = dict(s.execute(select(Chunk.id, Chunk.state).where(Chunk.id.in_(ids))).all())
    assert sorted(states.values()) == ["pending", "running"]


def test_each_worker_process_claims_under_its_own_pid(tmp_path, smollm):
    from .conftest import pg_database

    url, drop = pg_database()
    try:
        settings, service = _service(tmp_path, smollm, RAGCACHE_DATABASE_URL=url, RAGCACHE_PRECOMPUTE_BATCH=1)
        run_precompute(settings, workers=2, progress=False)
        with service.db.session() as s:
            owners = set(s.scalars(select(Chunk.claimed_by)))
        pids = {o.split(":")[1] for o in owners}
        assert str(os.getpid()) not in pids and len(owners) == len(pids)
        service.close()
    finally:
        drop()


def test_retry_failed_takes_them_off_the_job_that_counted_them(db):
    ids = _add_chunks(db, 2)
    worker, lease = claims.worker_id("run", 0), timedelta(seconds=600)
    claims.claim(db, None, worker, 2, lease, 1)
    claims.commit(db, 1, worker, [], [], [(ids[0], "boom"), (ids[1], "boom")], attempts=1, backoff_s=0)
    with db.session() as s:
        assert s.get(Job, 1).failed == 2
    assert claims.retry_failed(db, None) == 2
    with db.session() as s:
        assert s.get(Job, 1).failed == 0 and {c.state for c in s.scalars(select(Chunk))} == {"pending"}


def test_a_stuck_worker_stops_renewing(db):
    _add_chunks(db, 1)
    worker, lease = claims.worker_id("run", 0), timedelta(seconds=0.3)
    claims.claim(db, None, worker, 1, lease, 1)
    with claims.Heartbeat(db, worker, lease):  # never beats: after 3 leases it lets the chunk go
        time.sleep(1.6)
        assert len(claims.claim(db, None, claims.worker_id("other", 1), 1, lease, 1)) == 1
