"""The precompute job: prefill every pending chunk's KV once, store it, embed it, index it.

Per-chunk state lives in SQL (pending → running → done, or back to pending after a failed prefill
until `precompute_attempts` tries, then failed; claims.py has the SQL), so a job killed at any moment
resumes where it stopped, no chunk is counted done twice (the state change and the job's
counter commit together, and only for the worker that holds the claim), and progress is
readable by anyone. Workers claim small batches: on PostgreSQL with SELECT … FOR UPDATE SKIP
LOCKED, so processes on several machines share a job; on SQLite one worker at a time (a file
lock), and a second one is told so. Embeddings are written to the chunk rows; the FAISS index
is brought in line with SQL when the job ends (and at every service start). A changed document's
staged version is swapped in once its last chunk is done (`corpus.versions`): after the batch that
finishes it, or at the end of the run that resumes one killed before its swap. A chunk whose KV no
tier has room for (every one full of pinned entries) is done all the same: embedded and retrievable,
its KV computed when used, as if evicted at once; a full tier is not the chunk's failure. The job ends by
computing again the KV of done chunks the settings now key differently (`rekey.py`: a new chunk prefill, KV dtype).
"""
from __future__ import annotations

import fcntl
import logging
import multiprocessing
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import select

from blend.cores import claim_cores, one_core

from ..config import Settings
from ..corpus.corpus import Corpus
from ..corpus.ingest import unpack_ids
from ..corpus.versions import swap_ready
from ..database import Database
from ..errors import UserError
from ..meta import Chunk
from ..parts import Parts
from ..store import StoreFull
from . import claims
from .rekey import rekey
from .rows import LOCK_FILE, count_chunks, finish_job_if_empty, join_or_start_job

log = logging.getLogger("ragcache.precompute")


@dataclass
class Summary:
    done: int
    failed: int
    skipped: int
    rekeyed: int = 0  # done chunks whose KV was computed again under a key the settings now make (rekey.py)

    def line(self) -> str:
        return f"done={self.done} failed={self.failed} skipped={self.skipped} rekeyed={self.rekeyed}"


def run_precompute(settings: Settings, workers: int = 1, namespace: str | None = None,
                   progress: bool = True, service=None, job_id: int | None = None,
                   retry_failed: bool = False) -> Summary:
    """Precompute every pending chunk; `service` (a RagCache), when given, is used (and left open) instead of
    parts of its own; `job_id` names a job row made beforehand (the server's), else the running one is joined
    or one started; `retry_failed` gives failed chunks a fresh set of attempts first."""
    own = service is None
    parts = Parts(settings) if own else service
    corpus = Corpus(parts) if own else service.corpus
    db, lock = parts.db, None
    try:
        lock = _single_writer_lock(settings, db, workers)
        run = uuid.uuid4().hex[:8]  # this invocation; each worker is host:pid:run:i
        claims.release_dead(db, db.is_sqlite)
        if retry_failed:
            claims.retry_failed(db, namespace)
        skipped = count_chunks(db, namespace, "done")
        job_id = job_id if job_id is not None else join_or_start_job(db, namespace)
        pending = count_chunks(db, namespace, "pending")
        bar = _bar(pending, progress)
        if workers == 1:
            _work(parts, job_id, namespace, claims.worker_id(run, 0),
                  on_batch=lambda n: bar.update(n) if bar else None)
        else:
            ctx = multiprocessing.get_context("spawn")
            threads = max(1, (os.cpu_count() or 1) // workers)
            procs = [ctx.Process(target=_worker_main, args=(settings.model_dump(), job_id, namespace, run, i,
                                                            threads)) for i in range(workers)]
            for p in procs:
                p.start()
            seen = 0
            while any(p.is_alive() for p in procs):
                time.sleep(0.5)
                now = sum(count_chunks(db, namespace, state, by=run) for state in ("done", "failed"))
                if bar:
                    bar.update(now - seen)
                seen = now
            for p in procs:
                p.join()
        if bar:
            bar.close()
        rekeyed = rekey(parts, namespace)  # done chunks whose KV the settings now key differently
        summary = Summary(count_chunks(db, namespace, "done", by=run),
                          count_chunks(db, namespace, "failed", by=run),
                          skipped, rekeyed)
        finish_job_if_empty(db, job_id, namespace)
        for key in swap_ready(db, namespace).orphan_kv_keys:  # versions a killed run finished but did not swap
            parts.store.delete(key)
        for ns in _namespaces(db, namespace):
            corpus.sync_index(ns)
        if namespace is None:
            corpus.prune_index()
        return summary
    finally:
        if lock is not None:
            lock.close()
        if own:
            parts.close()


def _worker_main(settings: dict, job_id: int, namespace: str | None, run: str, i: int, threads: int) -> None:
    claim_cores(threads)  # workers share the cores
    parts = Parts(Settings(**settings))
    try:
        _work(parts, job_id, namespace, claims.worker_id(run, i))
    finally:
        parts.close()


def _work(parts: Parts, job_id: int, namespace: str | None, worker: str, on_batch=None) -> None:
    """Claim a batch, process it, commit it; until nothing is left to claim (waiting out retry delays
    and the leases of chunks other workers hold).

    A chunk's store write (serialise, checksum, fsync) runs on a writer thread while the next
    chunk prefills; the batch commits only once its writes are durable. Leases are renewed meanwhile.
    """
    db, cfg = parts.db, parts.settings
    lease = timedelta(seconds=cfg.lease_seconds)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-write", initializer=one_core) as writer, \
            claims.Heartbeat(db, worker, lease) as heartbeat:
        while True:
            batch = claims.claim(db, namespace, worker, cfg.precompute_batch, lease, job_id)
            if not batch:
                wait = claims.next_wake(db, namespace)
                if wait is None:
                    return
                time.sleep(min(wait + 0.05, 5.0))
                continue
            pending, failed, writes = [], [], {}
            for cid, ns, ids_bytes, text in batch:
                try:
                    ids = unpack_ids(ids_bytes)
                    key = parts.kv_key_of(ids, ns)
                    write = writes.get(key)  # the same text twice in this batch: computed once
                    if write is None and not parts.store.contains(key):  # stored before: one entry
                        _, kv = parts.prefill_for_store(ids, ns)
                        put = writer.submit(parts.store.put, key, kv, durable=True)  # `done` promises a blob
                        write = writes[key] = put
                    pending.append((cid, ns, key, text, int(ids.numel()), write))
                    heartbeat.beat()
                except Exception as e:  # noqa: BLE001 — a failing chunk is recorded, the job goes on
                    failed.append((cid, f"{type(e).__name__}: {e}"))
            done = []
            for cid, ns, key, text, n, write in pending:
                try:
                    if write is not None:
                        write.result()
                    done.append((cid, ns, key, text, n))
                except StoreFull as e:  # every tier full of pins (another tenant's, say): not this chunk's
                    log.warning("chunk %d done without a stored KV, computed when used: %s", cid, e)  # failure
                    done.append((cid, ns, key, text, n))  # retrievable, its KV as if evicted at once
                except Exception as e:  # noqa: BLE001
                    failed.append((cid, f"{type(e).__name__}: {e}"))
            vectors = parts.embedder.embed([t for _, _, _, t, _ in done]) if done else []
            ended = claims.commit(db, job_id, worker, done, vectors, failed, cfg.precompute_attempts,
                                  cfg.retry_backoff_s)
            for key in claims.orphaned(db, done):
                parts.store.delete(key)  # its chunk was deleted meanwhile: no blob without a chunk
            for key in swap_ready(db, chunk_ids=[d[0] for d in done]).orphan_kv_keys:
                parts.store.delete(key)  # an old version's, retired by the swap this batch made ready
            heartbeat.beat()
            if on_batch:
                on_batch(ended)


def _single_writer_lock(settings: Settings, db: Database, workers: int):
    """SQLite: one precompute at a time, enforced with a lock file beside the database."""
    if not db.is_sqlite:
        return None
    if workers > 1:
        raise UserError("SQLite allows one precompute worker at a time: use --workers 1, or PostgreSQL "
                        "(RAGCACHE_DATABASE_URL=postgresql+psycopg://…) for several")
    path = settings.home / LOCK_FILE
    f = open(path, "a+", errors="replace")  # a damaged holder line is still read
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise UserError(f"a precompute is already running on this SQLite database ({holder}); wait for it, "
                        "or use PostgreSQL for several workers") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}")
    f.flush()
    return f


def _namespaces(db: Database, namespace: str | None) -> list[str]:
    if namespace is not None:
        return [namespace]
    with db.session() as s:
        return list(s.scalars(select(Chunk.namespace).distinct()))


def _bar(total: int, show: bool):
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="chunk", desc="precompute", dynamic_ncols=True)
