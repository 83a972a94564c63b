"""Rerank retrieved chunks by query likelihood against their cached KV (blend/likelihood.py).

    found, chunks, tiers = rerank(generation, query, namespace, found, top_k)

The candidates' KV comes from the store as any request's does (a miss is prefilled and stored), so the
cost is the question's tokens through the model once per candidate, batched; the chunks kept are
returned with their KV already loaded, for the request to fuse without loading them again.
"""
from __future__ import annotations

import dataclasses

import torch

from blend.likelihood import likelihood_ids, question_likelihood

from ..corpus.ingest import unpack_ids


def rerank(generation, query: str, namespace: str, found: list, top_k: int) -> tuple[list, list, list[str]]:
    """found: (ChunkHit, Chunk row) pairs → the top_k by likelihood (each hit's score that mean log p),
    with their ChunkKVs and the tiers they came from."""
    p = generation.p
    chunks, tiers = generation.load_chunks([unpack_ids(row.token_ids) for _, row in found], namespace)
    lead, question = likelihood_ids(p.tokenizer, query)
    behind = p.prefix if p.settings.chunk_prefill == "prefixed" else None  # where the chunks' KV was computed
    scores = question_likelihood(p.runner, behind, chunks, lead, question)  # (N,)
    keep = torch.argsort(scores, descending=True, stable=True)[:top_k].tolist()
    hits = [(dataclasses.replace(found[i][0], score=float(scores[i])), found[i][1]) for i in keep]
    return hits, [chunks[i] for i in keep], [tiers[i] for i in keep]
