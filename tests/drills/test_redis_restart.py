"""Drill: the Redis tier's server stopped while a server serves from it, then started again on the same
port (empty: it keeps nothing on disk). Meanwhile every request answers 200, its chunks recomputed; once
Redis is back the tier is used again (a Redis hit) within a minute. Its own redis-server on a free port:
the machine's Redis on 6379 is never touched."""
from __future__ import annotations

import shutil
import subprocess

import redis

from tests.api.conftest import free_port, short_docs
from tests.api.test_documents_jobs import _wait_job

from .conftest import wait_for

NS = "drill-redis"


def _redis(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(port),
                             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_connect_timeout=1)
    wait_for(lambda: _pong(client), 30, f"redis-server on port {port}")
    return proc


def _pong(client) -> bool:
    try:
        return client.ping()
    except redis.ConnectionError:
        return False


def test_redis_stopped_and_restarted_while_serving(servers, tmp_path):
    port = free_port()
    store = _redis(port)
    try:
        s = servers(tmp_path / "home", RAGCACHE_REDIS_URL=f"redis://127.0.0.1:{port}/0",
                    RAGCACHE_CPU_CACHE_BYTES=0,  # no memory tier: every load asks the blob tiers
                    RAGCACHE_DISK_CACHE_BYTES=1)  # no blob fits the disk tier: Redis holds every chunk
        docs = short_docs(4, 3, "r-")
        ask = {"query": docs[0]["text"], "namespace": NS, "top_k": 3, "mode": "reuse", "max_tokens": 8}
        with s.client() as c:
            r = c.post("/v1/documents", params={"namespace": NS}, json=docs)
            assert r.status_code == 200, r.text
            job = _wait_job(c, r.json()["job"]["id"])
            assert job["state"] == "finished" and job["done"] == job["total"] == 3, job

            def tiers() -> set[str]:
                r = c.post("/v1/rag/generate", json=ask)
                assert r.status_code == 200, r.text[:300]
                return {ch["tier"] for ch in r.json()["chunks"]}

            assert tiers() == {"redis"}
            store.terminate()
            store.wait(30)
            for _ in range(3):  # Redis down: served all the same, every chunk recomputed
                assert tiers() == {"computed"}
            assert s.metric("ragcache_store_errors_total", tier="redis") >= 1
            hits = s.metric("ragcache_chunk_lookups_total", tier="redis", result="hit")
            store = _redis(port)  # the same port, nothing in it
            wait_for(lambda: "redis" in tiers(), 60, "a chunk served from Redis again", every=1)
        assert s.metric("ragcache_chunk_lookups_total", tier="redis", result="hit") > hits
    finally:
        store.kill()
        store.wait(30)
