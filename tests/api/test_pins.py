"""Pins inside a per-namespace quota, and a disk tier full of one tenant's pins: the other tenant's
precompute still finishes its chunks (retrievable, their KV computed when used) instead of failing them."""
from __future__ import annotations

import sqlite3

import pytest

from .conftest import NAMESPACE, copy_home, demo_docs, start_server
from .test_documents_jobs import _wait_job


@pytest.fixture(scope="module")
def pinned_server(corpus_home, tmp_path_factory, smollm):
    """A disk tier with room for the corpus less its largest chunk, and a pin quota just under the corpus."""
    home = copy_home(corpus_home, tmp_path_factory.mktemp("pins"))
    with sqlite3.connect(home / "ragcache.db") as conn:
        sizes = sorted(n for (n,) in conn.execute("SELECT bytes FROM kv_copies"))
    server = start_server(home, smollm, RAGCACHE_DISK_CACHE_BYTES=sum(sizes[:-1]),
                          RAGCACHE_PIN_QUOTA_BYTES=sum(sizes) - 1, RAGCACHE_RETRY_BACKOFF_S=0.1)
    yield server
    server.stop()


def test_a_pin_over_the_quota_is_refused_by_name_and_pins_nothing(pinned_server):
    with pinned_server.client() as c:
        ids = c.get("/v1/documents/q0-0", params={"namespace": NAMESPACE}).json()["chunk_ids"]
        every = [i for d in range(6) for i in c.get(f"/v1/documents/q0-{d}",
                                                    params={"namespace": NAMESPACE}).json()["chunk_ids"]]
        r = c.post("/v1/cache/pin", json={"namespace": NAMESPACE, "chunk_ids": every})
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert "RAGCACHE_PIN_QUOTA_BYTES" in err["message"] and err["param"] == "chunk_ids"
        looked = c.post("/v1/cache/lookup", json={"namespace": NAMESPACE, "chunk_ids": every}).json()["chunks"]
        assert not any(x["pinned"] for x in looked)  # all or nothing
        assert all(x["pinned"] for x in c.post("/v1/cache/pin", json={"namespace": NAMESPACE,
                                                                     "chunk_ids": ids}).json()["chunks"])
        c.post("/v1/cache/unpin", json={"namespace": NAMESPACE, "chunk_ids": ids})


def test_a_disk_full_of_one_tenants_pins_leaves_another_tenants_precompute_finishing(pinned_server):
    with pinned_server.client() as c:
        every = [i for d in range(6) for i in c.get(f"/v1/documents/q0-{d}",
                                                    params={"namespace": NAMESPACE}).json()["chunk_ids"]]
        r = c.post("/v1/cache/pin", json={"namespace": NAMESPACE, "chunk_ids": every[1:]})  # within the quota,
        assert r.status_code == 200, r.text  # and as much as the disk tier holds

        out = c.post("/v1/documents", params={"namespace": "other"}, json=demo_docs(1, 2, "o-")).json()
        job = _wait_job(c, out["job"]["id"])
        assert job["state"] == "finished" and job["failed"] == 0 and job["done"] == out["chunks"]["added"], job
        doc = c.get("/v1/documents/o-0", params={"namespace": "other"}).json()
        looked = c.post("/v1/cache/lookup", json={"namespace": "other", "doc_id": "o-0"}).json()["chunks"]
        assert doc["chunks_by_state"] == {"done": len(doc["chunk_ids"])} and not any(x["cached"] for x in looked)
        query = {"query": demo_docs(1, 1, "o-")[0]["text"][:200], "namespace": "other", "top_k": 2, "max_tokens": 2}
        answer = c.post("/v1/rag/generate", json=query)
        assert answer.status_code == 200 and {ch["doc_id"] for ch in answer.json()["chunks"]} == {"o-0", "o-1"}

        c.post("/v1/cache/unpin", json={"namespace": NAMESPACE, "chunk_ids": every})
