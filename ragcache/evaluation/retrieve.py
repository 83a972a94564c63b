"""The evaluation's retrieval step: each question's passages, given or retrieved over the whole file.

`given` takes a question's own first top-k passages. `dense`, `bm25` and `hybrid` retrieve over every
passage of the file as the server does (FAISS, BM25, their rank fusion); with `rerank` N the hybrid
(or other) top N are reordered by the deployment's reranker (`RAGCACHE_RERANKER`) on their chunk KV, which
the evaluation computes and keeps in its tier anyway, and the top-k of that order are the question's passages.
"""
from __future__ import annotations

import torch

from blend.relevance import relevance

from ..corpus.retrieval import DEPTH, RETRIEVERS
from ..errors import UserError


def retriever(service, cfg, data: list[dict], root, passages):
    """item → its passages' texts, best first."""
    if cfg.retrieval == "given":
        if cfg.rerank:
            raise UserError("--rerank needs --retrieval dense, bm25 or hybrid")
        return lambda item: [c["text"] for c in item["ctxs"][: cfg.top_k]]
    if cfg.retrieval not in RETRIEVERS:
        raise UserError(f"retrieval must be given, {', '.join(RETRIEVERS)}")
    from index import LexicalIndex, VectorIndex, rrf

    texts = sorted({c["text"] for item in data for c in item["ctxs"]})
    dense, lexical = VectorIndex(root / "index", service.embedder.dim), LexicalIndex()
    dense.add("eval", torch.arange(len(texts)).numpy(), service.embedder.embed(texts))
    lexical.add("eval", range(len(texts)), texts)
    n = max(cfg.top_k, cfg.rerank)

    def ranked(question: str) -> list[int]:
        depth = n if cfg.retrieval != "hybrid" else max(DEPTH, 4 * n)
        lists = []
        if cfg.retrieval in ("dense", "hybrid"):
            lists.append(dense.search("eval", service.embedder.embed([question])[0], depth))
        if cfg.retrieval in ("bm25", "hybrid"):
            lists.append(lexical.search("eval", question, depth))
        return [i for i, _ in (rrf(lists, n) if len(lists) == 2 else lists[0][:n])]

    def retrieve(item) -> list[str]:
        found = [texts[i] for i in ranked(item["question"])]
        if cfg.rerank <= cfg.top_k:
            return found[: cfg.top_k]
        chunks = passages.load(passages.ensure(found))
        scores = relevance(service.runner, passages.behind, chunks, service.tokenizer, service.frame.tail, item["question"],
                           service.settings.reranker)
        return [found[i] for i in torch.argsort(scores, descending=True, stable=True)[: cfg.top_k].tolist()]

    return retrieve
