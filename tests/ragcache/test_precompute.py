"""The precompute job and retrieve-and-generate, end to end, through the `ragcache` command."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from ragcache.config import Settings
from ragcache.corpus.ingest import unpack_ids
from ragcache.database import Database
from ragcache.meta import Chunk, Job, KVCopy
from ragcache.service import RagCache

from .conftest import pg_database

DEMO = Path(__file__).resolve().parents[2] / "demo" / "data" / "musique_demo.json"
QUESTION = "Where was the author of Hannibal and Scipio educated at?"


def _env(home: Path, smollm, db_url: str | None = None, **extra) -> dict:
    env = {**os.environ, "RAGCACHE_HOME": str(home), "RAGCACHE_MODEL": str(smollm.path),
           "RAGCACHE_CHUNK_TOKENS": "96", "RAGCACHE_PRECOMPUTE_BATCH": "2", "RAGCACHE_MAX_NEW_TOKENS": "12"}
    if db_url:
        env["RAGCACHE_DATABASE_URL"] = db_url
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _ragcache(*args, env, timeout=300, **kw):
    return subprocess.run([sys.executable, "-m", "ragcache.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, **kw)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """One question's passages: 10 documents, ~45 chunks of ≤ 96 tokens."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.json"
    path.write_text(json.dumps(json.loads(DEMO.read_text())[:1]))
    return path


@pytest.fixture(scope="module")
def precomputed(tmp_path_factory, corpus, smollm) -> Path:
    """A home with the corpus ingested and precomputed (in process); tests work on copies."""
    from ragcache.jobs.precompute import run_precompute

    home = tmp_path_factory.mktemp("precomputed") / "home"
    settings = _settings(_env(home, smollm))
    service = RagCache(settings)
    service.ingest(corpus)
    service.close()
    run_precompute(settings, progress=False)
    return home


def _copy(home: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(home, tmp_path / "home")
    return tmp_path / "home"


def _settings(env: dict) -> Settings:
    return Settings(**{k.removeprefix("RAGCACHE_").lower(): v for k, v in env.items() if k.startswith("RAGCACHE_")})


def _ingest(path: Path, env: dict) -> None:
    """Ingest in this process: what the tests below run as commands is precompute (`ingest`'s command is run in
    test_cli and by test_documents_jobs)."""
    with RagCache(_settings(env)) as service:
        service.ingest(path)


def _agree(env: dict) -> int:
    """Every chunk done exactly once; SQL, store and index agree. Returns the chunk count."""
    settings = _settings(env)
    db = Database(settings.db_url)
    with db.session() as s:
        chunks = list(s.scalars(select(Chunk)))
        done_counted = s.scalar(select(func.sum(Job.done)))
        keys = set(s.scalars(select(KVCopy.key).where(KVCopy.store.like("disk:%"), KVCopy.checksum.is_not(None))))
    assert chunks and all(c.state == "done" for c in chunks), {c.state for c in chunks}
    assert done_counted == len(chunks), "a chunk was counted done twice (or not at all)"
    assert {c.kv_key for c in chunks} <= keys
    service = RagCache(settings)
    assert service.index.ids("default") == {c.id for c in chunks}
    kv_files = {p.name.removesuffix(".safetensors") for p in (settings.home / "kv").glob("*/*.safetensors")}
    assert kv_files == keys
    service.close()
    db.dispose()
    return len(chunks)


def _done(env: dict) -> int:
    db = Database(_settings(env).db_url)
    with db.session() as s:
        n = s.scalar(select(func.count()).select_from(Chunk).where(Chunk.state == "done"))
    db.dispose()
    return n


def test_killed_precompute_resumes_and_does_every_chunk_once(tmp_path, corpus, smollm):
    env = _env(tmp_path / "home", smollm)
    _ingest(corpus, env)
    rng = random.Random(3)
    kills = 0
    for round_ in range(6):
        done_before = _done(env)
        proc = subprocess.Popen([sys.executable, "-m", "ragcache.cli", "precompute", "--quiet"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if round_ < 2:  # before any work: while the model loads
            time.sleep(rng.uniform(1.0, 3.0))
        else:  # during the work, whatever this machine's speed: once a batch has committed
            deadline = time.monotonic() + 120
            while _done(env) == done_before and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(rng.uniform(0.0, 1.5))
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
    assert kills >= 4
    r = _ragcache("precompute", "--quiet", env=env)
    assert r.returncode == 0, r.stderr
    done, failed, skipped, rekeyed = (int(x.split("=")[1]) for x in r.stdout.strip().splitlines()[-1].split())
    assert failed == 0 and done + skipped == _agree(env) and skipped > 0 and rekeyed == 0


def test_two_workers_share_a_job_on_postgresql(tmp_path, corpus, smollm):
    url, drop = pg_database()
    try:
        env = _env(tmp_path / "home", smollm, url)
        _ingest(corpus, env)
        r = _ragcache("precompute", "--workers", "2", "--quiet", env=env, timeout=600)
        assert r.returncode == 0, r.stderr
        n = _agree(env)
        assert r.stdout.strip().splitlines()[-1] == f"done={n} failed=0 skipped=0 rekeyed=0"
        db = Database(url)
        with db.session() as s:
            by_worker = dict(s.execute(select(Chunk.claimed_by, func.count()).group_by(Chunk.claimed_by)).all())
        db.dispose()
        assert len(by_worker) == 2 and sum(by_worker.values()) == n  # disjoint claims, both worked
    finally:
        drop()


def test_sqlite_takes_one_worker_at_a_time(tmp_path, corpus, smollm):
    env = _env(tmp_path / "home", smollm)
    _ingest(corpus, env)
    r = _ragcache("precompute", "--workers", "2", env=env)
    assert r.returncode == 2 and "one precompute worker" in r.stderr and "Traceback" not in r.stderr
    first = subprocess.Popen([sys.executable, "-m", "ragcache.cli", "precompute", "--quiet"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)
        r = _ragcache("precompute", env=env)
        assert r.returncode == 2 and "already running" in r.stderr
    finally:
        first.kill()
        first.wait()


def test_a_failing_chunk_is_recorded_and_the_job_goes_on(tmp_path, smollm):
    docs = tmp_path / "docs.jsonl"
    long = "word " * 9000  # past the model's 8192 positions: its prefill must fail
    docs.write_text(json.dumps({"id": "ok", "text": "Paris is in France."}) + "\n" +
                    json.dumps({"id": "huge", "text": long}) + "\n")
    env = _env(tmp_path / "home", smollm, RAGCACHE_CHUNK_TOKENS=20000, RAGCACHE_RETRY_BACKOFF_S=0.1)
    _ingest(docs, env)
    r = _ragcache("precompute", "--quiet", env=env)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "done=1 failed=1 skipped=0 rekeyed=0", \
        r.stdout + r.stderr
    db = Database(_settings(env).db_url)
    with db.session() as s:
        bad = s.scalars(select(Chunk).where(Chunk.state == "failed")).one()
    db.dispose()
    assert "exceeds" in bad.error


def test_a_setting_that_rekeys_chunks_has_precompute_compute_them_again_while_they_stay_served(tmp_path, precomputed,
                                                                                             smollm):
    """Chunks precomputed behind the lead (the default), then the deployment switched to `prefixed`: every done
    chunk's KV is under a key no request asks for, so the next precompute computes each under its new key (none
    leaves `done`), drops the old entries, and a request is served from the store; a run after that has nothing to
    do. The store, SQL and the index agree throughout."""
    from ragcache.jobs.precompute import run_precompute

    env = _env(_copy(precomputed, tmp_path), smollm, RAGCACHE_CHUNK_PREFILL="prefixed")
    settings = _settings(env)
    before = _keys(settings)
    summary = run_precompute(settings, progress=False)
    assert (summary.done, summary.failed, summary.skipped, summary.rekeyed) == (0, 0, len(before), len(before))
    assert _agree(env) == len(before)  # every row's key is a stored blob, and nothing else is stored
    after = _keys(settings)
    assert after.keys() == before.keys() and not set(after.values()) & set(before.values())
    with RagCache(settings) as service:
        with service.db.session() as s:
            rows = s.execute(select(Chunk.token_ids, Chunk.namespace, Chunk.kv_key)).all()
        assert all(key == service.kv_key_of(unpack_ids(ids), ns) for ids, ns, key in rows)  # the key it asks for
        out = service.generate(QUESTION, top_k=2, max_new_tokens=2)
        assert "computed" not in {c["tier"] for c in out["chunks"]}  # the new keys' KV, served from the store
    assert run_precompute(settings, progress=False).rekeyed == 0


def _keys(settings: Settings) -> dict[int, str]:
    db = Database(settings.db_url)
    with db.session() as s:
        keys = dict(s.execute(select(Chunk.id, Chunk.kv_key)).all())
    db.dispose()
    return keys


def test_ask_answers_from_stored_kv_and_recomputes_corrupt_blobs(tmp_path, precomputed, smollm):
    env = _env(_copy(precomputed, tmp_path), smollm)
    r = _ragcache("ask", QUESTION, "--json", env=env)
    assert r.returncode == 0, r.stderr
    stored = json.loads(r.stdout)
    assert set(stored) == {"request_id", "answer", "mode", "policy", "finish_reason", "chunks", "usage", "timings_ms"}
    assert set(stored["timings_ms"]) == {"queue", "retrieve", "load", "blend", "ttft", "repair", "decode", "total"}
    assert {c["tier"] for c in stored["chunks"]} <= {"disk", "cpu"} and stored["answer"]
    assert stored["usage"]["prompt_tokens"] == stored["usage"]["reused_tokens"] + stored["usage"]["recomputed_tokens"]
    for blob in (Path(env["RAGCACHE_HOME"]) / "kv").glob("*/*.safetensors"):
        data = bytearray(blob.read_bytes())
        data[-100] ^= 0xFF
        blob.write_bytes(bytes(data))
    r = _ragcache("ask", QUESTION, "--json", env=env)
    assert r.returncode == 0, r.stderr
    recomputed = json.loads(r.stdout)
    assert {c["tier"] for c in recomputed["chunks"]} == {"computed"}
    assert recomputed["answer"] == stored["answer"]
    assert [c["id"] for c in recomputed["chunks"]] == [c["id"] for c in stored["chunks"]]


def test_search_prints_ids_scores_and_words(tmp_path, precomputed, smollm):
    env = _env(_copy(precomputed, tmp_path), smollm)
    r = _ragcache("search", "Hannibal and Scipio", "-k", "3", env=env)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and len(lines) == 3
    scores = [float(line.split()[1]) for line in lines]
    assert scores == sorted(scores, reverse=True)
    r = _ragcache("search", "x", "--namespace", "nobody", env=env)
    assert r.returncode == 0 and r.stdout.strip() == ""
    r = _ragcache("ask", QUESTION, "--namespace", "nobody", env=env)
    assert r.returncode == 2 and "no precomputed chunks" in r.stderr


def test_work_is_not_thrown_away(tmp_path, smollm):
    """An edited document keeps the KV of its unchanged chunks, and a text twice in one batch is computed once."""
    from ragcache.jobs.precompute import run_precompute

    words = [f"word{i}" for i in range(150)]
    docs = tmp_path / "docs.jsonl"
    rows = [{"id": "a", "text": " ".join(words)}, {"id": "b", "text": "Same text."}, {"id": "c", "text": "Same text."}]
    docs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = _settings(_env(tmp_path / "home", smollm))
    service = RagCache(settings)
    computed = []
    real = service.compute_chunk_kv
    service.compute_chunk_kv = lambda ids, ns: computed.append(ids.numel()) or real(ids, ns)  # counts, computes
    service.ingest(docs)
    chunks = service.counts()["pending"]
    run_precompute(settings, progress=False, service=service)
    assert len(computed) == chunks - 1  # b and c share one entry, computed once
    before = set(service.store.blobs[0].keys())

    rows[0]["text"] = " ".join(words[:-3] + ["changed", "at", "end"])  # only the last chunk differs
    docs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = service.ingest(docs)
    assert report.staged == 1 and not report.orphan_kv_keys  # served as it was until its new chunks are done
    computed.clear()
    run_precompute(settings, progress=False, service=service)  # then swapped: the changed chunk's old KV goes
    assert len(computed) == 1 and len(before & set(service.store.blobs[0].keys())) == len(before) - 1
    service.close()


def test_a_document_deleted_while_its_chunks_are_computed_leaves_no_blob(tmp_path, smollm):
    from ragcache.jobs.precompute import run_precompute

    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "kept", "text": "Paris is in France."}) + "\n" +
                    json.dumps({"id": "gone", "text": "Rome is in Italy."}) + "\n")
    settings = _settings(_env(tmp_path / "home", smollm, RAGCACHE_PRECOMPUTE_BATCH=8))
    service = RagCache(settings)
    service.ingest(docs)
    real, deleted = service.prefill_for_store, []

    def prefill_then_delete(ids, namespace):  # the document is deleted (over HTTP, say) while its batch computes
        if not deleted:
            deleted.append(service.corpus.delete_document("default", "gone"))
        return real(ids, namespace)

    service.prefill_for_store = prefill_then_delete
    run_precompute(settings, progress=False, service=service)
    with service.db.session() as s:
        keys = set(s.scalars(select(Chunk.kv_key).where(Chunk.kv_key.is_not(None))))
        copies = set(s.scalars(select(KVCopy.key)))
    blobs = set(service.store.blobs[0].keys())
    service.close()
    assert len(keys) == 1 and copies == keys and blobs == keys  # no blob, no copy row without its chunk
