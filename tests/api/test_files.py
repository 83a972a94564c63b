"""Files over HTTP: multipart uploads of every format beside bad files, then retrieval by each retriever and the
reranker, with each chunk's heading path and page coming back for citation."""
from __future__ import annotations

from tests.ragcache.test_formats import WRITERS, _encrypted_pdf

from .test_documents_jobs import _wait_job

NS = "files"


def _ask(c, query: str, **extra) -> dict:
    r = c.post("/v1/rag/generate", json={"query": query, "namespace": NS, "top_k": 2, "max_tokens": 2,
                                         "mode": "reuse", **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_multipart_upload_of_every_format_then_each_retriever(api_server, tmp_path):
    files = []
    for name, write in sorted(WRITERS.items()):
        write(tmp_path / name)
        files.append(("files", (name, (tmp_path / name).read_bytes())))
    _encrypted_pdf(tmp_path / "locked.pdf", tmp_path)
    files += [("files", ("locked.pdf", (tmp_path / "locked.pdf").read_bytes())), ("files", ("a.xyz", b"?"))]
    with api_server.client() as c:
        r = c.post("/v1/documents", params={"namespace": NS}, files=files)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["documents"]["added"] == 4 and len(out["errors"]) == 2, out
        assert out["errors"][0].startswith("locked.pdf: is an encrypted PDF") and out["errors"][1].startswith("a.xyz")
        assert _wait_job(c, out["job"]["id"])["state"] == "finished"

        for retrieval in ("dense", "bm25", "hybrid"):
            got = _ask(c, "How many tonnes did ships carry in 1920?", retrieval=retrieval, top_k=4)
            assert any("Cargo" in ch["heading"] or "Trade" in ch["heading"] for ch in got["chunks"]), got["chunks"]
        pdf = [ch for ch in got["chunks"] if ch["doc_id"] == "report.pdf"]
        assert pdf and all(ch["page"] == 1 for ch in pdf)
        reranked = _ask(c, "Who dredged the harbour of Velmora in 1905?", rerank=8)
        assert all("History" in ch["heading"] for ch in reranked["chunks"])
        assert all(ch["score"] > 0 for ch in reranked["chunks"])  # an attention lift (a null question's is 1)
        model = c.get("/v1/models").json()["data"][0]["id"]
        chat = c.post("/v1/chat/completions", json={"model": model, "max_tokens": 2, "messages": [
            {"role": "user", "content": "When did shipping decline?"}], "rag": {"namespace": NS, "rerank": 4,
                                                                                 "retrieval": "bm25"}})
        assert chat.status_code == 200, chat.text
        assert "Decline" in chat.json()["rag"]["chunks"][0]["heading"]
        for body, words in (({"retrieval": "sparse"}, "retrieval"), ({"rerank": -1}, "rerank")):
            r = c.post("/v1/rag/generate", json={"query": "x", "namespace": NS, **body})
            assert r.status_code == 422 and words in r.text
        r = c.post("/v1/documents", params={"namespace": NS}, files=[("files", ("x.bin", b"\x00"))])
        assert r.status_code == 422 and "no file could be read: x.bin: unsupported type" in r.json()["error"]["message"]

        assert c.delete("/v1/documents/report.md", params={"namespace": NS}).status_code == 200
        for retrieval in ("dense", "bm25"):  # gone from both indexes
            got = _ask(c, "Velmora harbour history trade cargo decline", retrieval=retrieval, top_k=12)
            assert got["chunks"] and "report.md" not in {ch["doc_id"] for ch in got["chunks"]}
