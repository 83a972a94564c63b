"""API keys: tenants see only their namespaces; the admin key sees everything; JSON 401/403s."""
from __future__ import annotations

import httpx


def _keys(server):
    (a, [ns_a]), (b, [ns_b]) = server.tenant_keys.items()
    return a, ns_a, b, ns_b


def test_no_key_or_unknown_key_is_401(api_server_with_keys):
    s = api_server_with_keys
    for headers in ({}, {"Authorization": "Bearer not-a-key-at-all"}, {"Authorization": "Basic abc"}):
        r = httpx.post(f"{s.url}/v1/rag/generate", json={"query": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{s.url}/health").status_code == 200  # liveness needs no key


def test_no_question_in_either_tenant_returns_a_foreign_chunk(api_server_with_keys):
    """Each question in each tenant, asking for fewer and for more chunks than the tenant holds (3): what one
    tenant's namespace lacks is never filled from the other's (retrieval is deterministic: each pair once)."""
    s = api_server_with_keys
    a, ns_a, b, ns_b = _keys(s)
    questions = ["who", "where was it", "when did it happen", "what is the name", s.question]
    foreign, served = 0, 0
    with s.client(a) as ca, s.client(b) as cb:
        for client, ns in ((ca, ns_a), (cb, ns_b)):
            for question in questions:
                for top_k in (2, 6):
                    r = client.post("/v1/rag/generate", json={"query": question, "namespace": ns, "mode": "reuse",
                                                              "top_k": top_k, "max_tokens": 1})
                    assert r.status_code == 200, r.text
                    chunks = r.json()["chunks"]
                    served += len(chunks)
                    foreign += sum(not ch["doc_id"].startswith(f"{ns}-") for ch in chunks)
    assert foreign == 0 and served >= 2 * len(questions) * (2 + 3)  # top 6 of a 3-chunk tenant: its 3


def test_a_tenant_cannot_touch_another_namespace(api_server_with_keys):
    s = api_server_with_keys
    a, ns_a, b, ns_b = _keys(s)
    other_doc = f"{ns_b}-0"
    with s.client(a) as c:
        calls = [("POST", "/v1/rag/generate", {"json": {"query": "x", "namespace": ns_b}}),
                 ("POST", "/v1/chat/completions", {"json": {"model": "smollm2", "rag": {"namespace": ns_b},
                                                            "messages": [{"role": "user", "content": "x"}]}}),
                 ("GET", f"/v1/documents/{other_doc}", {"params": {"namespace": ns_b}}),
                 ("DELETE", f"/v1/documents/{other_doc}", {"params": {"namespace": ns_b}}),
                 ("POST", "/v1/documents", {"params": {"namespace": ns_b}, "json": [{"id": "x", "text": "y"}]}),
                 ("POST", "/v1/cache/lookup", {"json": {"namespace": ns_b, "doc_id": other_doc}}),
                 ("POST", "/v1/cache/pin", {"json": {"namespace": ns_b, "doc_id": other_doc}}),
                 ("POST", "/v1/cache/evict", {"json": {"namespace": ns_b, "doc_id": other_doc}}),
                 ("POST", "/v1/cache/evict", {"json": {"tier": "cpu"}}),
                 ("GET", "/v1/cache/stats", {}),
                 ("POST", "/v1/jobs/precompute", {"json": {"namespace": ns_b}}),
                 ("POST", "/v1/jobs/precompute", {"json": {}})]
        for method, path, kw in calls:
            r = c.request(method, path, **kw)
            assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", (method, path, r.text)
        assert c.get(f"/v1/documents/{ns_a}-0", params={"namespace": ns_a}).status_code == 200
        assert all(row["namespace"] == ns_a for row in c.get("/v1/requests/recent").json()["requests"])
    with s.client(s.admin_key) as admin:  # the document is still there, and the admin reaches it all
        assert admin.get(f"/v1/documents/{other_doc}", params={"namespace": ns_b}).status_code == 200
        assert admin.get("/v1/cache/stats").status_code == 200
