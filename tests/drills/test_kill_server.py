"""Drill: `kill -9` a server while a client streams and a precompute job it started runs. The client's
connection ends; the job's child dies with its server; a server restarted on the same home resumes the job,
and every chunk ends `done` exactly once with its blob, no copy row without a blob, no blob without a row."""
from __future__ import annotations

import threading

import httpx

from tests.api.conftest import children, demo_docs
from tests.api.sse import events

from .conftest import alive, chunk_states, disk_store_problems, kill9, wait_for

NS = "drill-kill"


def test_kill_9_mid_stream_and_mid_job_then_restart_resumes_the_job(servers, tmp_path):
    home = tmp_path / "home"
    env = dict(RAGCACHE_PRECOMPUTE_BATCH=1,  # a chunk per commit: the job is cut between chunks, or inside one
               RAGCACHE_CHUNK_TOKENS=96,  # many quick chunks: work left at the kill, little after the restart
               RAGCACHE_ORPHAN_GRACE_S=1)  # a put cut off by the kill is swept at the restart
    docs = demo_docs(1, 3, "k-")
    a = servers(home, **env)
    with a.client() as c:
        r = c.post("/v1/documents", params={"namespace": NS}, json=docs)
        assert r.status_code == 200, r.text
        job_id, total = r.json()["job"]["id"], r.json()["chunks"]["added"]
        wait_for(lambda: c.get(f"/v1/jobs/{job_id}").json()["done"] >= 1, 180, "a chunk precomputed")
    jobs = children(a.proc.pid)
    assert jobs, "the job runs in a child of the server"

    seen, ended = [], {}

    def stream():
        body = {"query": docs[0]["text"][:200], "namespace": NS, "top_k": 1, "mode": "reuse", "stream": True,
                "max_tokens": 400, "ignore_eos": True}
        try:
            with httpx.stream("POST", f"{a.url}/v1/rag/generate", json=body, timeout=60) as r:
                for event, _ in events(r):
                    seen.append(event)
            ended["how"] = "closed"
        except httpx.HTTPError as e:
            ended["how"] = type(e).__name__

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    wait_for(lambda: "token" in seen, 120, "the stream's first token")
    kill9(a)
    url = f"sqlite:///{home / 'ragcache.db'}"
    done_at_kill = chunk_states(url, NS).get("done", 0)
    assert done_at_kill < total, "the job had finished before the kill: nothing to resume"

    client.join(60)
    assert not client.is_alive(), "the streaming client hangs on a dead server"
    assert "done" not in seen and ended["how"] in ("closed", "RemoteProtocolError", "ReadError"), (ended, seen[-3:])
    wait_for(lambda: not any(alive(pid) for pid in jobs), 10, "the job's child to die with its server")
    assert chunk_states(url, NS).get("done", 0) <= done_at_kill + 1, "the job's child worked on without its server"

    b = servers(home, **env)  # the same home, the same settings
    with b.client() as c:
        job = wait_for(lambda: (j := c.get(f"/v1/jobs/{job_id}").json())["state"] != "running" and j, 240,
                       "the job resumed and finished")
    assert job["state"] == "finished" and job["done"] == total and job["failed"] == 0, job  # each chunk once
    assert chunk_states(url, NS) == {"done": total}
    assert disk_store_problems(home, url) == []
