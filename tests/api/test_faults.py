"""Faults are not failures: a corrupt blob is recomputed, a dead Redis is served around, a full queue
answers 429, an oversize body 413."""
from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import time

import httpx
import pytest

from .conftest import copy_home, free_port, start_server


@pytest.fixture
def fresh_server(corpus_home, tmp_path, smollm, request):
    servers = []

    def start(**env):
        servers.append(start_server(copy_home(corpus_home, tmp_path), smollm, **env))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def _ask(server, **kw):
    return {"query": server.question, "namespace": server.namespace, "mode": "reuse", "top_k": 2,
            "max_tokens": 8, **kw}


def test_a_blob_corrupted_while_serving_is_recomputed_not_served(fresh_server):
    s = fresh_server(RAGCACHE_CPU_CACHE_BYTES=0)  # every load reads the disk tier
    with s.client() as c:
        before = c.post("/v1/rag/generate", json=_ask(s)).json()
        assert {ch["tier"] for ch in before["chunks"]} == {"disk"}
        for blob in (s.home / "kv").glob("*/*.safetensors"):
            data = bytearray(blob.read_bytes())
            data[len(data) // 2] ^= 0x40
            blob.write_bytes(bytes(data))
        after = c.post("/v1/rag/generate", json=_ask(s)).json()
    assert after["answer"] == before["answer"]
    assert {ch["tier"] for ch in after["chunks"]} == {"computed"}
    assert s.metric("ragcache_kv_corrupt_total") == 2


def test_redis_configured_but_stopped_still_answers(fresh_server, tmp_path):
    port = free_port()
    redis = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        s = fresh_server(RAGCACHE_REDIS_URL=f"redis://127.0.0.1:{port}/0", RAGCACHE_CPU_CACHE_BYTES=0)
        with s.client() as c:
            shutil.rmtree(s.home / "kv")  # nothing on disk: each chunk is computed, then stored in disk and redis
            (s.home / "kv").mkdir()
            first = c.post("/v1/rag/generate", json=_ask(s)).json()
            assert {ch["tier"] for ch in first["chunks"]} == {"computed"}
            assert httpx.get(f"{s.url}/ready").json()["checks"]["tier:redis"] is True
            redis.terminate()
            redis.wait(10)
            shutil.rmtree(s.home / "kv")  # and not on disk either: every lookup asks Redis, every put tries it
            (s.home / "kv").mkdir()
            for _ in range(2):
                r = c.post("/v1/rag/generate", json=_ask(s))
                assert r.status_code == 200 and r.json()["answer"] == first["answer"]
        assert s.metric("ragcache_store_errors_total", tier="redis") >= 1
        ready = httpx.get(f"{s.url}/ready")
        assert ready.status_code == 503 and ready.json()["checks"]["tier:redis"] is False
    finally:
        redis.kill()


def test_full_queue_is_429_and_large_body_413(fresh_server):
    s = fresh_server(RAGCACHE_MAX_QUEUE=1, RAGCACHE_MAX_BODY_BYTES=4096)
    slow = _ask(s, max_tokens=100, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: httpx.post(f"{s.url}/v1/rag/generate", json=slow, timeout=300), range(4)))
    statuses = sorted(r.status_code for r in codes)
    assert set(statuses) == {200, 429}, statuses  # past the one waiting request (retrieval, KV loads): refused
    busy = next(r for r in codes if r.status_code == 429)
    assert int(busy.headers["retry-after"]) >= 1 and "RAGCACHE_MAX_QUEUE" in busy.json()["error"]["message"]
    big = httpx.post(f"{s.url}/v1/documents", content=b"x" * 5000, headers={"content-type": "application/json"})
    assert big.status_code == 413 and "RAGCACHE_MAX_BODY_BYTES" in big.json()["error"]["message"]


def test_a_damaged_latest_eval_file_is_named_not_a_500(api_server):
    latest = api_server.home / "eval" / "latest"
    latest.mkdir(parents=True, exist_ok=True)
    path = latest / "results.json"
    try:
        with api_server.client() as c:
            for damage in (b'{"modes": {"full": {"ttft_s_med', b"\x00\xff garbage", b"[1, 2]"):  # cut, garbage, no run's
                path.write_bytes(damage)
                r = c.get("/v1/eval/latest")
                assert r.status_code == 200 and r.json()["available"] is False, r.text
                assert str(path) in r.json()["error"] and "ragcache eval" in r.json()["error"], r.text
            path.write_text(json.dumps({"modes": {}}))  # the next run's results: shown again
            assert c.get("/v1/eval/latest").json()["available"] is True
    finally:
        path.unlink(missing_ok=True)
