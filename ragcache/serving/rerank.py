"""Rerank retrieved chunks on their cached KV (blend/relevance.py: attention, or query likelihood).

    found, chunks, tiers = rerank(generation, query, namespace, found, top_k)

The candidates' KV comes from the store as any request's does (a miss is prefilled and stored), so the
cost is the question's rows through the model: once against every candidate side by side (attention),
or once per candidate, batched (likelihood). The chunks kept are returned with their KV already loaded,
for the request to fuse without loading them again.
"""
from __future__ import annotations

import dataclasses

import torch

from blend.relevance import relevance

from ..corpus.ingest import unpack_ids


def rerank(generation, query: str, namespace: str, found: list, top_k: int) -> tuple[list, list, list[str]]:
    """found: (ChunkHit, Chunk row) pairs → the top_k by the deployment's reranker (each hit's score its
    relevance: an attention lift, or a mean log p), with their ChunkKVs and the tiers they came from."""
    p = generation.p
    chunks, tiers = generation.load_chunks([unpack_ids(row.token_ids) for _, row in found], namespace)
    behind = p.chunk_prefix(namespace)  # where the chunks' KV was computed
    scores = relevance(p.runner, behind, chunks, p.tokenizer, p.frame.tail, query, p.settings.reranker)  # (N,)
    keep = torch.argsort(scores, descending=True, stable=True)[:top_k].tolist()
    hits = [(dataclasses.replace(found[i][0], score=float(scores[i])), found[i][1]) for i in keep]
    return hits, [chunks[i] for i in keep], [tiers[i] for i in keep]
