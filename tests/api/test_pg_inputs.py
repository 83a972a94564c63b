"""On PostgreSQL, what SQLite lets through: ids past a column's width and NUL characters are 422s naming the
field, and the same new document ingested at once through two replicas is no 500."""
from __future__ import annotations

import threading

import pytest

from .conftest import demo_docs, start_server
from .test_scale_out import shared_db  # noqa: F401 — the fixture

NS = "pg-inputs"


@pytest.fixture
def replicas(shared_db, tmp_path, smollm):  # noqa: F811
    servers = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            servers.append(start_server(tmp_path / name / "home", smollm, RAGCACHE_DATABASE_URL=shared_db))
        yield servers
    finally:
        for s in servers:
            s.stop()


def _param(r) -> str:
    assert r.status_code == 422, (r.status_code, r.text[:300])
    return r.json()["error"]["param"]


def test_long_ids_and_nul_are_422_and_a_concurrent_ingest_of_one_id_resolves(replicas):
    a, b = replicas
    long_id = "x" * 513
    with a.client() as c:
        assert _param(c.post("/v1/documents", params={"namespace": NS},
                             json=[{"id": long_id, "text": "t"}])) == "documents.0.id"
        assert _param(c.post("/v1/documents", params={"namespace": NS}, json=[{"id": "a\x00b", "text": "t"}])) \
            == "documents.0.id"
        assert _param(c.post("/v1/documents", params={"namespace": NS},
                             json=[{"id": "ok", "title": "t\x00", "text": "t"}])) == "documents.0.title"
        assert _param(c.post("/v1/documents", params={"namespace": NS}, json=[{"id": "ok", "text": "t\x00"}])) \
            == "documents.0.text"
        assert _param(c.post("/v1/documents", params={"namespace": "n\x00"}, json=[{"id": "k", "text": "t"}])) \
            == "namespace"
        assert _param(c.get(f"/v1/documents/{long_id}", params={"namespace": NS})) == "doc_id"
        assert _param(c.delete("/v1/documents/a%00b", params={"namespace": NS})) == "doc_id"
        assert _param(c.post("/v1/cache/lookup", json={"namespace": NS, "doc_id": long_id})) == "doc_id"
        assert _param(c.post("/v1/cache/pin", json={"namespace": NS, "doc_id": "a\x00"})) == "doc_id"
        assert _param(c.post("/v1/rag/generate", json={"query": "x", "namespace": "n\x00"})) == "namespace"
        assert _param(c.post("/v1/jobs/precompute", json={"namespace": "n\x00"})) == "namespace"
        assert _param(c.post("/v1/chat/completions", json={"model": "m", "rag": {"namespace": "n\x00"},
                                                           "messages": [{"role": "user", "content": "x"}]})) \
            == "rag.namespace"
        files = {"files": ("nul.txt", b"some\x00text", "text/plain")}
        r = c.post("/v1/documents", params={"namespace": NS}, files=files)
        assert r.status_code == 422 and "NUL" in r.json()["error"]["message"], r.text

    docs = demo_docs(2, 6, "race-")
    for round_ in range(4):  # both replicas add the same new ids at the same moment
        batch = [{**d, "id": f"{d['id']}-{round_}"} for d in docs]
        start, out = threading.Barrier(2), {}

        def post(server):
            with server.client() as c:
                start.wait()
                out[server.url] = c.post("/v1/documents", params={"namespace": NS, "precompute": "false"},
                                         json=batch)

        threads = [threading.Thread(target=post, args=(s,)) for s in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r.status_code == 200 for r in out.values()), [r.text[:300] for r in out.values()]
        added = sorted(r.json()["documents"]["added"] for r in out.values())
        assert sum(added) == len(batch) and sum(r.json()["documents"]["unchanged"] for r in out.values()) \
            == sum(len(batch) - n for n in added), [r.json() for r in out.values()]
    with b.client() as c:
        assert c.get(f"/v1/documents/{docs[0]['id']}-3", params={"namespace": NS}).status_code == 200
