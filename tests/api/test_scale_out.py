"""Several hosts, one cache: `ragcache serve` replicas and precompute workers with homes of their own
(standing in for hosts) on one PostgreSQL database and one Redis."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import redis
from sqlalchemy import func, select, update

from ragcache.config import Settings
from ragcache.database import Database
from ragcache.meta import BlobStore, Chunk, Job, KVCopy
from ragcache.parts import Parts
from tests.ragcache.conftest import REDIS_URL, pg_database

from .conftest import demo_docs, server_env, short_docs, start_server, write_jsonl
from .test_documents_jobs import _wait_job

NS = "shared"


@pytest.fixture
def shared_db():
    """A fresh PostgreSQL database; afterwards its deployment's Redis keys are deleted with it."""
    url, drop = pg_database()
    yield url
    db = Database(url)
    with db.session() as s:
        token = s.scalar(select(BlobStore.token).where(BlobStore.id == "redis"))
    db.dispose()
    if token:
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"ragcache:{token}:*"))
        if keys:
            client.delete(*keys)
    drop()


def _ask(server, query: str, **extra) -> dict:
    with server.client() as c:
        r = c.post("/v1/rag/generate", json={"query": query, "namespace": NS, "top_k": 3, "mode": "reuse",
                                             "max_tokens": 8, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_replicas_share_corpus_and_kv_and_a_restart_loses_nothing(shared_db, tmp_path, smollm):
    hosts = {"RAGCACHE_DATABASE_URL": shared_db, "RAGCACHE_REDIS_URL": REDIS_URL}
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = start_server(tmp_path / "a" / "home", smollm, **hosts)
    b = None
    try:
        docs = short_docs(5, 3, "so-")
        with a.client() as c:
            job = c.post("/v1/documents", params={"namespace": NS}, json=docs).json()["job"]
            assert _wait_job(c, job["id"])["state"] == "finished"
        query = docs[0]["text"][:200]
        from_a = _ask(a, query)
        b = start_server(tmp_path / "b" / "home", smollm, **hosts)
        from_b = _ask(b, query)
        assert from_b["answer"] == from_a["answer"]
        assert [ch["id"] for ch in from_b["chunks"]] == [ch["id"] for ch in from_a["chunks"]]
        assert {ch["tier"] for ch in from_b["chunks"]} == {"redis"}  # B's disk is empty: Redis served them
        assert b.metric("ragcache_chunk_lookups_total", tier="redis", result="hit") == 3
        assert b.metric("ragcache_chunks_prefilled_total") == 0

        assert "so-0" in {ch["doc_id"] for ch in _ask(a, query, retrieval="bm25")["chunks"]}  # A's BM25 loaded
        with b.client() as c:  # ingested through B: in A's BM25 index at A's next request
            new = [{"id": "so-new", "title": "Festival", "text": "The Qwertzuiop festival is held each spring."}]
            job = c.post("/v1/documents", params={"namespace": NS}, json=new).json()["job"]
            assert _wait_job(c, job["id"])["state"] == "finished"
        assert _ask(a, "Qwertzuiop", retrieval="bm25")["chunks"][0]["doc_id"] == "so-new"
        with b.client() as c:
            assert c.delete("/v1/documents/so-0", params={"namespace": NS}).status_code == 200
        for retrieval in ("dense", "bm25"):  # gone from both of A's indexes too
            assert "so-0" not in {ch["doc_id"] for ch in _ask(a, query, retrieval=retrieval)["chunks"]}

        a.stop()
        a = start_server(tmp_path / "a" / "home", smollm, **hosts)  # B's start and misses judged none of A's
        with a.client() as c:
            looked = c.post("/v1/cache/lookup", json={"namespace": NS, "doc_id": "so-1"}).json()["chunks"]
        assert looked and all("disk" in x["tiers"] and "redis" in x["tiers"] for x in looked)
        assert {ch["tier"] for ch in _ask(a, query)["chunks"] if ch["doc_id"] != "so-new"} == {"disk"}  # B made so-new
    finally:
        a.stop()
        if b is not None:
            b.stop()


def _cli(env: dict, *args: str, **kw):
    return subprocess.Popen([sys.executable, "-m", "ragcache.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_workers_on_two_hosts_one_killed_every_chunk_done_once_and_durable(shared_db, tmp_path, smollm):
    extra = {"RAGCACHE_DATABASE_URL": shared_db, "RAGCACHE_REDIS_URL": REDIS_URL, "RAGCACHE_LEASE_SECONDS": 10,
             "RAGCACHE_PRECOMPUTE_BATCH": 1, "RAGCACHE_ORPHAN_GRACE_S": 0, "RAGCACHE_CHUNK_TOKENS": 96}
    env_a, env_b = (server_env(tmp_path / h / "home", smollm, **extra) for h in ("a", "b"))
    docs = write_jsonl(tmp_path / "docs.jsonl", demo_docs(4, 8, "w-"))
    r = subprocess.run([sys.executable, "-m", "ragcache.cli", "ingest", str(docs), "--namespace", NS], env=env_a,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    db = Database(shared_db)

    def states() -> dict[str, int]:
        with db.session() as s:
            return dict(s.execute(select(Chunk.state, func.count()).group_by(Chunk.state)).all())

    a = _cli(env_a, "precompute", "--quiet")
    deadline = time.monotonic() + 180
    while not (states().get("done") and states().get("running")) and a.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.poll() is None, "worker A finished before it could be killed"
    a.send_signal(signal.SIGKILL)  # mid-job, holding a claim
    a.wait()
    with db.session() as s:  # A stood for another host: no process here can tell that it died
        s.execute(update(Chunk).where(Chunk.state == "running").values(claimed_by="host-a:1:run:0"))
    assert states().get("running") == 1
    b = _cli(env_b, "precompute", "--quiet")
    _, err = b.communicate(timeout=600)
    assert b.returncode == 0, err[-2000:]
    assert states() == {"done": sum(states().values())}  # A's chunk too, once its lease lapsed
    Parts(Settings(home=tmp_path / "a" / "home", database_url=shared_db, redis_url=REDIS_URL,
                   orphan_grace_s=0)).store.close()  # A's host starts again: its cut-off put is swept

    with db.session() as s:
        chunks = list(s.scalars(select(Chunk)))
        counted = s.scalar(select(func.sum(Job.done)))
        copies = list(s.scalars(select(KVCopy)))
        prefix = f"ragcache:{s.scalar(select(BlobStore.token).where(BlobStore.id == 'redis'))}:kv:"
    db.dispose()
    assert counted == len(chunks)  # each chunk done exactly once, across both workers
    assert all(c.checksum is not None for c in copies), "an unfinished put was left behind"  # 0 orphan rows
    finished = {(c.key, c.store) for c in copies}
    assert all((c.kv_key, "redis") in finished for c in chunks)  # durable where every host sees it
    in_redis = {k.decode()[len(prefix):] for k in redis.Redis.from_url(REDIS_URL).scan_iter(match=prefix + "*")}
    assert in_redis == {c.key for c in copies if c.store == "redis"}  # 0 orphan blobs in Redis
    for host in ("a", "b"):
        kv = tmp_path / host / "home" / "kv"
        store_id = "disk:" + (kv / "STORE_ID").read_text().strip()
        on_disk = {p.name.removesuffix(".safetensors") for p in kv.glob("*/*.safetensors")}
        assert on_disk == {c.key for c in copies if c.store == store_id}, host  # 0 orphan blobs on either disk
        assert not list(kv.glob("*/.*.tmp"))
