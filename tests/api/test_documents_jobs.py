"""Documents in and out over HTTP, precompute jobs in a child process, and the CLI beside a server."""
from __future__ import annotations

import json
import subprocess
import sys
import time

from .conftest import server_env, short_docs, write_jsonl


def _wait_job(c, job_id: int, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = c.get(f"/v1/jobs/{job_id}").json()
        if job["state"] != "running":
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still running: {job}")


def test_upload_precompute_retrieve_delete(api_server):
    ns = "uploads"
    docs = short_docs(3, 2, "up-")
    with api_server.client() as c:
        r = c.post("/v1/documents", params={"namespace": ns}, json=docs)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["documents"]["added"] == 2 and out["job"]["state"] == "running"
        t0 = time.monotonic()
        assert c.get("/health").status_code == 200 and time.monotonic() - t0 < 1.0  # responsive meanwhile
        job = _wait_job(c, out["job"]["id"])
        assert job["state"] == "finished" and job["done"] == job["total"] == out["chunks"]["added"], job
        assert job["failed"] == 0 and job["started"] and job["finished"]

        doc = c.get("/v1/documents/up-0", params={"namespace": ns}).json()
        assert doc["chunks_by_state"] == {"done": len(doc["chunk_ids"])} and doc["title"] == docs[0]["title"]
        answer = c.post("/v1/rag/generate", json={"query": docs[0]["text"][:200], "namespace": ns, "top_k": 2,
                                                  "max_tokens": 2}).json()
        assert {ch["doc_id"] for ch in answer["chunks"]} == {"up-0", "up-1"}

        gone = c.delete("/v1/documents/up-0", params={"namespace": ns}).json()
        assert gone["chunks_removed"] == len(doc["chunk_ids"]) and gone["kv_entries_removed"] == gone["chunks_removed"]
        answer = c.post("/v1/rag/generate", json={"query": docs[0]["text"][:200], "namespace": ns, "top_k": 2,
                                                  "max_tokens": 2}).json()
        assert {ch["doc_id"] for ch in answer["chunks"]} == {"up-1"}
        assert c.get("/v1/documents/up-0", params={"namespace": ns}).status_code == 404
        assert c.delete("/v1/documents/up-0", params={"namespace": ns}).status_code == 404


def test_jsonl_upload_without_precompute_and_bad_bodies(api_server):
    lines = "".join(json.dumps(d) + "\n" for d in short_docs(4, 2, "jl-"))
    with api_server.client() as c:
        r = c.post("/v1/documents", params={"namespace": "jsonl", "precompute": "false"}, content=lines,
                   headers={"content-type": "application/x-ndjson"})
        assert r.status_code == 200 and r.json()["job"] is None and r.json()["documents"]["added"] == 2
        assert c.get("/v1/documents/jl-1", params={"namespace": "jsonl"}).json()["chunks_by_state"].get("pending")
        bad = [(b'{"id": 1, "text": "x"}\nnot json\n', "application/x-ndjson", "line 2"),
               (b'[{"id": 1}]', "application/json", "text"),
               (b"[]", "application/json", "non-empty"),
               (b'[{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]', "application/json", "repeat"),
               (b"\xff\xfe", "application/json", "UTF-8"),
               (b'[{"id": "nb", "text": "a \\ud800 b"}]', "application/json", "lone UTF-16 surrogate"),  # was a 500
               (b'{"documents": [{"id": "nb", "text": "x"}], "namespace": "jsonl"}', "application/json", "?namespace=")]
        for raw, ctype, words in bad:
            r = c.post("/v1/documents", params={"namespace": "jsonl"}, content=raw, headers={"content-type": ctype})
            assert r.status_code == 422 and words in r.json()["error"]["message"], (raw, r.text)
        assert c.get("/v1/documents/nb", params={"namespace": "jsonl"}).status_code == 404  # nothing ingested
        assert c.get("/v1/jobs/999999").status_code == 404
        assert c.get("/v1/jobs/not-a-number").status_code == 422
        r = c.post("/v1/jobs/precompute", json={"namespace": "jsonl"})
        assert r.status_code == 202
        job = _wait_job(c, r.json()["id"])
        assert job["state"] == "finished" and job["done"] >= 2


def test_a_document_ingested_by_the_cli_is_served_without_restart(api_server, smollm):
    ns = "cli-side"
    docs = write_jsonl(api_server.home.parent / "cli.jsonl", short_docs(5, 2, "cli-"))
    env = server_env(api_server.home, smollm)
    for args in (["ingest", str(docs), "--namespace", ns], ["precompute", "--quiet", "--namespace", ns]):
        r = subprocess.run([sys.executable, "-m", "ragcache.cli", *args], env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
    with api_server.client() as c:
        out = c.post("/v1/rag/generate", json={"query": "x", "namespace": ns, "top_k": 4, "max_tokens": 2}).json()
    assert {ch["doc_id"] for ch in out["chunks"]} == {"cli-0", "cli-1"}
