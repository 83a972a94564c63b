"""Cache admin over HTTP: lookup, pin, unpin, evict (chunks and a whole tier), stats; health and metrics."""
from __future__ import annotations

import httpx


def test_lookup_pin_evict_and_stats(api_server):
    ns = api_server.namespace
    with api_server.client() as c:
        doc = c.get("/v1/documents/q0-0", params={"namespace": ns}).json()
        ids = doc["chunk_ids"]
        looked = c.post("/v1/cache/lookup", json={"namespace": ns, "doc_id": "q0-0"}).json()["chunks"]
        assert [x["chunk_id"] for x in looked] == ids and all(x["cached"] and "disk" in x["tiers"] for x in looked)

        pinned = c.post("/v1/cache/pin", json={"namespace": ns, "chunk_ids": ids}).json()["chunks"]
        assert all(x["pinned"] for x in pinned)
        kept = c.post("/v1/cache/evict", json={"namespace": ns, "chunk_ids": ids}).json()
        assert kept == {"evicted": [], "kept_pinned": ids}
        c.post("/v1/cache/unpin", json={"namespace": ns, "chunk_ids": ids})
        assert c.post("/v1/cache/evict", json={"namespace": ns, "chunk_ids": ids}).json()["evicted"] == ids
        looked = c.post("/v1/cache/lookup", json={"namespace": ns, "chunk_ids": ids}).json()["chunks"]
        assert not any(x["cached"] for x in looked)

        out = c.post("/v1/rag/generate", json={"query": api_server.question, "namespace": ns, "top_k": 6,
                                               "max_tokens": 1}).json()
        tiers = {ch["id"]: ch["tier"] for ch in out["chunks"]}
        assert all(tiers[i] == "computed" for i in ids)  # recomputed on demand, and stored again
        assert all(x["cached"] for x in c.post("/v1/cache/lookup", json={"namespace": ns,
                                                                        "chunk_ids": ids}).json()["chunks"])

        stats = c.get("/v1/cache/stats").json()
        names = [t["name"] for t in stats["tiers"]]
        assert names == ["cpu", "disk"]
        cpu = stats["tiers"][0]
        assert cpu["entries"] > 0 and 0 < cpu["used_bytes"] <= cpu["capacity_bytes"] and cpu["hits"] >= 0
        assert c.post("/v1/cache/evict", json={"tier": "cpu"}).json()["evicted"] == cpu["entries"]
        assert c.get("/v1/cache/stats").json()["tiers"][0]["entries"] == 0


def test_cache_route_errors(api_server):
    ns = api_server.namespace
    with api_server.client() as c:
        for route, body, status in [
            ("/v1/cache/lookup", {"namespace": ns}, 422),  # neither chunk_ids nor doc_id
            ("/v1/cache/lookup", {"namespace": ns, "chunk_ids": [1], "doc_id": "q0-0"}, 422),
            ("/v1/cache/lookup", {"namespace": ns, "chunk_ids": [999999]}, 404),
            ("/v1/cache/pin", {"namespace": ns, "doc_id": "nope"}, 404),
            ("/v1/cache/evict", {"tier": "tape"}, 422),
            ("/v1/cache/evict", {"tier": "redis"}, 404),  # not configured here
            ("/v1/cache/evict", {}, 422),
        ]:
            r = c.post(route, json=body)
            assert r.status_code == status and r.json()["error"]["message"], (route, body, r.text)


def test_health_ready_metrics(api_server):
    assert httpx.get(f"{api_server.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{api_server.url}/ready").json()
    assert ready["ready"] and ready["checks"] == {"model": True, "database": True, "tier:cpu": True,
                                                  "tier:disk": True}
    before = api_server.metric("ragcache_requests_total", route="/v1/rag/generate", status="200")
    reused = api_server.metric("ragcache_reused_tokens_total")
    with api_server.client() as c:
        c.post("/v1/rag/generate", json={"query": api_server.question, "namespace": api_server.namespace,
                                         "mode": "epic", "max_tokens": 2})
    assert api_server.metric("ragcache_requests_total", route="/v1/rag/generate", status="200") == before + 1
    assert api_server.metric("ragcache_ttft_seconds_count", mode="epic") >= 1
    assert api_server.metric("ragcache_reused_tokens_total") > reused
    text = httpx.get(f"{api_server.url}/metrics").text
    for name in ("ragcache_ttft_seconds", "ragcache_request_seconds", "ragcache_chunk_lookups_total",
                 "ragcache_recomputed_tokens_total", "ragcache_reused_tokens_total", "ragcache_kv_corrupt_total",
                 "ragcache_store_errors_total", "ragcache_queue_depth", "ragcache_requests_total"):
        assert name in text, name
