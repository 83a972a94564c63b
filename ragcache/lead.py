"""The lead passage (chunk_prefill=lead): what a namespace's chunk KV is computed behind, after the system prompt.

Measured (BENCHMARKS.md, issue 23): a passage of the corpus's own kind at a chunk's length takes a quarter to a
half off the reuse-class KL; a made-up passage, or a corpus passage of 100 tokens, next to nothing. So the lead
is one of the namespace's own chunks: of the median length, the nearest the centroid of those chunks'
embeddings. It is picked once, at the namespace's first need, and kept in SQL: every process and every later
ingest computes behind the same one (a new lead would orphan every stored KV of the namespace). A tenant's chunks
are never computed behind another tenant's text; with caching shared across namespaces, one lead serves all.
"""
from __future__ import annotations

import numpy as np
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from .database import Database
from .errors import UserError
from .meta import Chunk, Lead

POOL = 32  # candidates of the median length whose embeddings are compared
LONGEST = 1024  # tokens: a lead precedes every chunk of its namespace within the model's positions, so none is longer


def candidates(n_tokens: list[int]) -> list[int]:
    """Indices of the passages within a quarter of the (lower) median length of those up to LONGEST tokens (the
    shortest passage when none is): the POOL nearest it, nearest first."""
    fit = [i for i, n in enumerate(n_tokens) if n <= LONGEST] or [min(range(len(n_tokens)), key=n_tokens.__getitem__)]
    median = sorted(n_tokens[i] for i in fit)[(len(fit) - 1) // 2]
    near = [i for i in fit if abs(n_tokens[i] - median) <= median / 4]
    return sorted(near, key=lambda i: (abs(n_tokens[i] - median), i))[:POOL]


def most_typical(texts: list[str], embed) -> int:
    """The index of the text whose embedding is nearest the centroid of all of theirs (`embed`: texts → (n, dim)
    unit vectors). Ties go to the earlier."""
    vectors = np.asarray(embed(texts), dtype=np.float32)  # (n, dim)
    return int(np.argmax(vectors @ vectors.mean(0)))


def pick_lead(texts: list[str], n_tokens: list[int], embed) -> int:
    """The index of the most typical of `texts` among those of about the median length."""
    if not texts:
        raise ValueError("no passage to pick a lead from")
    pool = candidates(n_tokens)
    return pool[most_typical([texts[i] for i in pool], embed)]


def namespace_lead(db: Database, namespace: str, embed) -> str:
    """The namespace's lead ("": the one every namespace shares): read from SQL, or picked from its chunks and
    written there (the first writer wins: two processes picking at once keep one)."""
    with db.session() as s:
        row = s.get(Lead, namespace)
        if row is not None:
            return row.text
        q = select(Chunk.id, Chunk.n_tokens).order_by(Chunk.id)
        sizes = s.execute(q.where(Chunk.namespace == namespace) if namespace else q).all()
        if not sizes:
            raise UserError(f"namespace {namespace!r} holds no chunk to pick the lead passage from (chunk_prefill="
                            "lead): ingest its documents first, or name one with RAGCACHE_CHUNK_LEAD")
        ids = [sizes[i].id for i in candidates([n for _, n in sizes])]
        texts = dict(s.execute(select(Chunk.id, Chunk.text).where(Chunk.id.in_(ids))).all())
    best = ids[most_typical([texts[i] for i in ids], embed)]
    try:
        with db.session() as s:
            s.add(Lead(namespace=namespace, text=texts[best], chunk_id=best))
    except IntegrityError:  # another process picked first: its lead is the namespace's
        pass
    with db.session() as s:
        return s.get(Lead, namespace).text
