"""The HTTP surface read as a hostile tenant would: nothing of another tenant to learn, no input that
reaches a 500, no slow upload that holds the server, no job that refuses the next; keys on, SQLite."""
from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from .conftest import ADMIN, TENANTS, children, copy_home, free_port, server_env, short_docs, start_server
from .test_documents_jobs import _wait_job

KEY_A, KEY_B = TENANTS
BODY_TIMEOUT_S, MAX_CONNECTIONS = 5, 60


@pytest.fixture(scope="module")
def guarded(corpus_home, tmp_path_factory, smollm):
    home = copy_home(corpus_home, tmp_path_factory.mktemp("guarded"))
    server = start_server(home, smollm, RAGCACHE_ADMIN_KEY=ADMIN, RAGCACHE_API_KEYS=json.dumps(TENANTS),
                          RAGCACHE_BODY_TIMEOUT_S=BODY_TIMEOUT_S, RAGCACHE_MAX_CONNECTIONS=MAX_CONNECTIONS)
    yield server
    server.stop()


def _child_environ(server, job_id: int) -> dict[str, str]:
    """The environment of the precompute child running job `job_id` (waiting for it to start)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for pid in children(server.proc.pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"precompute" in cmd and str(job_id).encode() in cmd:
                    raw = Path(f"/proc/{pid}/environ").read_bytes()
                    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no child for job {job_id}")


def test_another_tenants_job_is_404_its_child_has_no_keys_and_the_eval_is_admin_only(guarded):
    with guarded.client(KEY_B) as b, guarded.client(KEY_A) as a, guarded.client(ADMIN) as admin:
        r = b.post("/v1/documents", params={"namespace": "tenant-b"}, json=short_docs(3, 2, "leak-"))
        job = r.json()["job"]
        env = _child_environ(guarded, job["id"])
        assert not {"RAGCACHE_API_KEYS", "RAGCACHE_ADMIN_KEY"} & set(env), sorted(env)
        assert not any(secret in value for value in env.values() for secret in (ADMIN, KEY_A, KEY_B))
        assert env["RAGCACHE_HOME"] == str(guarded.home)  # what it needs, it has
        assert _wait_job(b, job["id"], timeout=900)["state"] == "finished"

        for path in (f"/v1/jobs/{job['id']}", "/v1/jobs/99999"):  # another tenant's and a missing one: the same
            r = a.get(path)
            assert r.status_code == 404 and "tenant-b" not in r.text, r.text
        assert a.get(f"/v1/jobs/{job['id']}").json()["error"]["message"] == f"no job {job['id']}"
        assert admin.get(f"/v1/jobs/{job['id']}").status_code == 200

        latest = guarded.home / "eval" / "latest"
        latest.mkdir(parents=True)
        (latest / "results.json").write_text(json.dumps({"modes": {}, "dataset": "/home/someone/secret.json"}))
        (latest / "pareto.png").write_bytes(b"\x89PNG\r\n\x1a\n")
        for path in ("/v1/eval/latest", "/v1/eval/latest/pareto.png"):
            r = a.get(path)
            assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", (path, r.text)
            assert admin.get(path).status_code == 200


def test_numbers_too_long_and_json_too_deep_are_422(guarded):
    huge, deep = "9" * 5000, "[" * 100_000
    with guarded.client(KEY_A) as a:
        for path, raw in (("/v1/documents?namespace=tenant-a", f'[{{"id": {huge}, "text": "x"}}]'),
                          ("/v1/documents?namespace=tenant-a", deep),
                          ("/v1/rag/generate", f'{{"query": "x", "namespace": "tenant-a", "top_k": {huge}}}'),
                          ("/v1/rag/generate", deep),
                          ("/v1/chat/completions", deep)):
            r = a.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 422, (path, raw[:40], r.status_code, r.text[:300])
            words = "digits" if raw is not deep else "nested too deeply"
            assert words in r.json()["error"]["message"] and r.json()["error"]["param"] == "body", r.text
        for name, raw in (("huge.jsonl", f'{{"id": {huge}, "text": "x"}}\n'), ("deep.json", deep)):  # as files too
            r = a.post("/v1/documents", params={"namespace": "tenant-a"}, files={"files": (name, raw.encode())})
            assert r.status_code == 422 and name in r.json()["error"]["message"], r.text
            assert ("digits" if raw is not deep else "nested too deeply") in r.json()["error"]["message"], r.text


def test_two_ingests_back_to_back_each_get_a_job_and_both_finish(guarded):
    """On SQLite a finished job's child still holds the one-writer lock while it exits: the next job queues."""
    docs = short_docs(4, 4, "b2b-")
    with guarded.client(KEY_A) as a:
        first = a.post("/v1/documents", params={"namespace": "tenant-a"}, json=docs[:2]).json()
        assert first["job"] is not None, first
        deadline = time.monotonic() + 900
        while a.get(f"/v1/jobs/{first['job']['id']}").json()["state"] == "running":  # the row turns finished…
            assert time.monotonic() < deadline
            time.sleep(0.05)
        second = a.post("/v1/documents", params={"namespace": "tenant-a"}, json=docs[2:]).json()  # …at once
        assert second["job"] is not None and second["job_error"] is None, second
        job = _wait_job(a, second["job"]["id"], timeout=900)
        assert job["state"] == "finished" and job["failed"] == 0, job
        states = [a.get(f"/v1/documents/{d['id']}", params={"namespace": "tenant-a"}).json()["chunks_by_state"]
                  for d in docs]
        assert all(set(s) == {"done"} for s in states), states


def _raw(server, head: str, body: bytes = b"") -> socket.socket:
    url = urlparse(server.url)
    s = socket.create_connection((url.hostname, url.port), timeout=120)
    s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
    return s


def _status(s: socket.socket) -> int:
    """The status of the response on `s` (waiting for it, generously)."""
    data = b""
    while b"\r\n" not in data:
        got = s.recv(4096)
        if not got:
            raise AssertionError(f"closed without a response: {data!r}")
        data += got
    s.close()
    return int(data.split(b" ", 2)[1])


def _upload_head(key: str | None, length: int) -> str:
    auth = f"Authorization: Bearer {key}\n" if key else ""
    return (f"POST /v1/documents?namespace=tenant-a HTTP/1.1\nHost: x\n{auth}Content-Type: application/json\n"
            f"Content-Length: {length}\n\n")


def test_stalled_uploads_time_out_while_a_generate_answers_and_strangers_are_refused_unread(guarded):
    stalled = [_raw(guarded, _upload_head(KEY_A, 1_000_000), b'[{"id": "slow", "text": "') for _ in range(50)]
    try:
        with guarded.client(ADMIN) as a:
            r = a.post("/v1/rag/generate", json={"query": guarded.question, "namespace": guarded.namespace,
                                                 "top_k": 2, "max_tokens": 2})
            assert r.status_code == 200, r.text
        stranger = _raw(guarded, _upload_head(None, 5_000_000))  # no body sent: refused from its headers
        assert _status(stranger) == 401
        wrong = _raw(guarded, _upload_head("not-a-key-at-all", 5_000_000))
        assert _status(wrong) == 401
        assert {_status(s) for s in stalled} == {408}  # each let go after RAGCACHE_BODY_TIMEOUT_S
    finally:
        for s in stalled:
            s.close()


def test_past_the_requests_in_flight_a_json_503_names_the_limit_and_the_probes_still_answer(guarded):
    stalled = [_raw(guarded, _upload_head(KEY_A, 1_000_000), b"[") for _ in range(MAX_CONNECTIONS)]
    try:
        with guarded.client(ADMIN) as b:
            while True:  # once the server has read every stalled upload's headers, and before they time out
                r = b.get("/v1/cache/stats")
                if r.status_code == 503:
                    break
                assert r.status_code == 200, r.text
                assert not any(_answered(s) for s in stalled), "the uploads timed out before all were in flight"
            assert "RAGCACHE_MAX_CONNECTIONS=60" in r.json()["error"]["message"] and r.headers["Retry-After"] == "1"
            assert httpx.get(f"{guarded.url}/health", timeout=60).status_code == 200
        assert {_status(s) for s in stalled} == {408}
        with guarded.client(ADMIN) as b:  # they let go: the limit is free again
            assert b.get("/v1/cache/stats").status_code == 200
    finally:
        for s in stalled:
            s.close()


def _answered(s: socket.socket) -> bool:
    """Whether a response (or the close) is waiting on `s`, without reading it."""
    return bool(select.select([s], [], [], 0)[0])


def test_no_keys_on_a_public_address_refuses_to_start(tmp_path, smollm):
    env = server_env(tmp_path / "home", smollm)
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "serve", "--host", "0.0.0.0", "--port",
                             str(free_port())], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("ragcache serve started on 0.0.0.0 with no keys")
    assert proc.returncode == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and "--insecure" in err and "RAGCACHE_API_KEYS" in err, err


def test_exit_reason_names_what_failed_not_the_childs_words():
    from ragcache.jobs.launcher import exit_reason

    log = ["Traceback (most recent call last):", '  File "/home/alice/ragcache/meta.py", line 180',
           'sqlalchemy.exc.OperationalError: (psycopg.OperationalError) connection to server at "db.internal" '
           '(10.1.2.3), port 5432 failed: FATAL: password authentication failed for user "alice"']
    reason = exit_reason(1, log, "job-7.log")
    assert reason == "precompute exited with status 1 (OperationalError); see job-7.log in the server's home"
    reason = exit_reason(2, ["ragcache: error: cannot open the database at postgresql://alice@db.internal/x"], "j")
    assert "alice" not in reason and "db.internal" not in reason and "a setting or the environment" in reason
    assert "SIGKILL" in exit_reason(-9, [], "job-8.log")
