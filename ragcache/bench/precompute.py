"""Precompute throughput beside plain runner prefill of the same chunks, in one run (A B A)."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from sqlalchemy import select

from ..config import Settings
from ..corpus.ingest import unpack_ids
from ..jobs.precompute import _work
from ..jobs.rows import join_or_start_job
from ..meta import Chunk
from ..service import RagCache
from .timing import table


def run(settings: Settings, args) -> int:
    args.chunks = args.chunks or 40
    with tempfile.TemporaryDirectory() as tmp:
        local = settings.model_copy(update={"home": Path(tmp), "database_url": None,
                                            "model": str(_model_dir(settings))})
        service = RagCache(local)
        service.ingest(args.dataset)
        service.warm()
        with service.db.session() as s:
            chunks = [unpack_ids(b) for b in s.scalars(select(Chunk.token_ids).order_by(Chunk.id))][: args.chunks]
            keep = set(s.scalars(select(Chunk.id).order_by(Chunk.id).limit(args.chunks)))
            for c in s.scalars(select(Chunk).where(Chunk.id.not_in(keep))):
                c.state = "skipped-by-bench"
        tokens = sum(int(c.numel()) for c in chunks)

        def plain() -> float:
            t = time.perf_counter()
            for ids in chunks:
                service.runner.prefill(ids)
            return time.perf_counter() - t

        before = plain()
        job = join_or_start_job(service.db, None)
        t = time.perf_counter()
        _work(service, job, None, "bench:0:0")
        job_s = time.perf_counter() - t
        after = plain()
        service.close()
    base = (before + after) / 2
    rows = [["runner prefill only (mean of before/after)", base, tokens / base, ""],
            ["precompute job (prefill + store + embed + SQL)", job_s, tokens / job_s,
             f"{(job_s / base - 1) * 100:+.1f}%"]]
    print(f"{len(chunks)} chunks, {tokens} tokens, chunks computed {settings.chunk_prefill}, kv_dtype "
          f"{settings.kv_dtype}; write-through to disk (fsync)")
    print(table(rows, ["", "seconds", "tokens/s", "overhead"]))
    return 0


def _model_dir(settings: Settings) -> Path:
    from blend.model import DEFAULT_MODEL, default_model_dir

    return default_model_dir(settings.home) if settings.model in ("", DEFAULT_MODEL) else Path(settings.model)
