"""Drill: PostgreSQL's backends terminated under a server while 8 clients generate, then the database
refusing connections for a while. Pooled connections that died are replaced (pre-ping) so every later
request answers 200; only a request in flight at that moment may fail, and then as a JSON 503; a database
that cannot be reached is a 503 naming it, with Retry-After, until it is back.

The backends are terminated twice: with all 8 clients in flight, and with the clients paused between
requests, so that every connection in the pool is dead when the next request takes one (without pre-ping
that request fails: what makes this drill fail)."""
from __future__ import annotations

import threading
import time

import httpx
import psycopg

from tests.api.conftest import short_docs
from tests.api.test_documents_jobs import _wait_job
from tests.api.test_scale_out import shared_db  # noqa: F401 — the fixture
from tests.ragcache.conftest import PG_ADMIN

from .conftest import wait_for

NS = "drill-pg"
CLIENTS = 8


def _admin(sql: str, *params):
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall() if sql.startswith("SELECT") else conn.execute(sql, params)


def _terminate(name: str) -> int:
    rows = _admin("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                  "AND pid <> pg_backend_pid()", name)
    return sum(ok for ok, in rows)


def _is_503_json(r: httpx.Response) -> bool:
    return r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable" \
        and int(r.headers["retry-after"]) >= 1 and "database" in r.json()["error"]["message"]


def test_backends_terminated_under_8_clients_then_a_lost_database_is_503(shared_db, servers, tmp_path):  # noqa: F811
    name = shared_db.rsplit("/", 1)[1]
    s = servers(tmp_path / "home", RAGCACHE_DATABASE_URL=shared_db)
    docs = short_docs(3, 3, "pg-")
    with s.client() as c:
        r = c.post("/v1/documents", params={"namespace": NS}, json=docs)
        assert r.status_code == 200, r.text
        assert _wait_job(c, r.json()["job"]["id"])["state"] == "finished"
    ask = {"query": docs[0]["text"], "namespace": NS, "top_k": 2, "mode": "reuse", "max_tokens": 8}

    answers, stop, go, lock, busy = [[] for _ in range(CLIENTS)], threading.Event(), threading.Event(), \
        threading.Lock(), [0]

    def client(mine: list) -> None:
        with s.client() as c:
            while go.wait() and not stop.is_set():
                with lock:  # a paused client starts nothing: `busy` counts what is in flight
                    if not go.is_set():
                        continue
                    busy[0] += 1
                t0 = time.monotonic()
                r = c.post("/v1/rag/generate", json=ask)
                mine.append((t0, time.monotonic(), r))
                with lock:
                    busy[0] -= 1

    def one_more_each(since: float) -> None:
        wait_for(lambda: all(any(t0 > since for t0, _, _ in mine) for mine in answers), 180,
                 "an answer to every client")

    threads = [threading.Thread(target=client, args=(mine,), daemon=True) for mine in answers]
    for t in threads:
        t.start()
    go.set()
    one_more_each(0)
    cut = time.monotonic()  # 1. while all 8 are in flight
    assert _terminate(name) >= 1, "the server held no connection to terminate"
    after = time.monotonic()
    one_more_each(after)
    with lock:  # 2. between requests: every pooled connection is dead when the next request takes one
        go.clear()
    wait_for(lambda: busy[0] == 0, 120, "the clients paused")
    assert _terminate(name) >= 1
    paused = time.monotonic()
    go.set()
    one_more_each(paused)
    stop.set()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)

    calls = [call for mine in answers for call in mine]
    later = [r for t0, _, r in calls if t0 > after]
    in_flight = [r for t0, t1, r in calls if t0 <= after and t1 >= cut]
    assert [r.status_code for r in later] == [200] * len(later), [r.text[:200] for r in later if r.status_code != 200]
    assert all(r.status_code == 200 or _is_503_json(r) for r in in_flight), \
        [(r.status_code, r.text[:200]) for r in in_flight if r.status_code != 200]
    assert all(r.status_code == 200 for t0, t1, r in calls if t1 < cut)

    _admin(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')  # the database is lost to the server
    try:
        _terminate(name)
        with s.client() as c:
            r = c.post("/v1/rag/generate", json=ask)
            assert _is_503_json(r), (r.status_code, r.text[:300])
            ready = c.get("/ready")
            assert ready.status_code == 503 and ready.json()["checks"]["database"] is False
    finally:
        _admin(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')
    with s.client() as c:  # back: the next request is served
        r = c.post("/v1/rag/generate", json=ask)
        assert r.status_code == 200, r.text[:300]
        assert c.get("/ready").status_code == 200
