"""Retrieval coverage on a MuSiQue-format file: how often a passage holding the answer is in the top k, for
dense (FAISS), BM25, hybrid (rank fusion; and convex mixes, for choosing) and each reranker over hybrid.

Every passage of the file (its title line and text, as ingest makes a chunk; with `--window`, every piece
of it) is one chunk; a question is covered at k when one of its top-k passages contains one of its gold
answers (normalised as for F1). The file carries no supporting-passage labels, so the passage the answer
is read from stands in for them; the ceiling is the share of questions some passage answers at all.
Costs: BM25 build and query, and the whole retrieval, per 10K chunks, against a reuse request's TTFT;
each reranker's added time against cacheblend@0.15's TTFT, side by side per question (`rerank_cost`).
"""
from __future__ import annotations

import json
import tempfile
import time

import numpy as np

from index import Embedder, LexicalIndex, VectorIndex, convex, rrf

from ..errors import UserError
from ..evaluation.evaluate import load_dataset
from ..evaluation.scores import normalize
from .timing import median, table

ALPHAS = (0.3, 0.5, 0.7)  # convex mixes measured beside RRF: alpha · dense + (1 − alpha) · BM25
DEPTH = 50  # each ranking fused holds this many


def run(settings, args) -> int:
    data = load_dataset(args.dataset, None)
    picked = _questions(args.questions, len(data))
    ks = args.passages or [1, 2, 4, 8, 10]
    texts = sorted({f"{c.get('title') or ''}\n{c['text']}".lstrip("\n") for item in data for c in item["ctxs"]})
    embedder = Embedder()
    if args.window:  # chunks the embedder covers: what it embeds is all the model would read
        texts = [piece for t in texts for piece in _pieces(embedder.tokenizer, t, args.window)]
    norm = [f" {normalize(t)} " for t in texts]
    depth = max(DEPTH, max(ks), args.rerank)
    rankings: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dense, lexical = VectorIndex(tmp, embedder.dim), LexicalIndex()
        dense.add("bench", np.arange(len(texts)), embedder.embed(texts))
        lexical.add("bench", range(len(texts)), texts)
        for n in picked:
            q = data[n]["question"]
            d, b = dense.search("bench", embedder.embed([q])[0], depth), lexical.search("bench", q, depth)
            found = {"dense": d, "bm25": b, "hybrid": rrf([d, b], depth),
                     **{f"convex@{a:g}": convex(d, b, a, depth) for a in ALPHAS}}
            for name, ranking in found.items():
                rankings.setdefault(name, []).append([i for i, _ in ranking])
    cost = None
    if args.rerank:
        from .rerank_cost import rerank

        reranked, cost = rerank(settings, [data[n]["question"] for n in picked], texts, rankings["hybrid"], args.rerank)
        rankings.update(reranked)
    answers = [[a for a in map(normalize, data[n]["answers"]) if a] for n in picked]
    held = [[any(f" {a} " in t for a in ans) for t in norm] for ans in answers]
    covered = {name: [[any(held[j][i] for i in r[:k]) for j, r in enumerate(rs)] for k in ks]
               for name, rs in rankings.items()}
    ceiling = float(np.mean([any(h) for h in held]))
    result = {"retrievers": {name: {str(k): float(np.mean(c)) for k, c in zip(ks, cs)} for name, cs in covered.items()},
              "ceiling": ceiling, "questions": f"{picked[0]}-{picked[-1]}", "n": len(picked)}
    result["latency_per_10k"] = _latency(embedder, texts, [data[n]["question"] for n in picked])
    if cost is not None:
        result["rerank_cost"] = cost
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    _report(result, covered, ks, len(texts))
    return 0


def _questions(spec: str | None, n: int) -> list[int]:
    """"A-B" (inclusive) → those question indices; None → all."""
    if not spec:
        return list(range(n))
    try:
        a, b = (int(x) for x in spec.split("-"))
    except ValueError:
        raise UserError(f"--questions expects A-B, e.g. 40-49, not {spec!r}") from None
    if not 0 <= a <= b < n:
        raise UserError(f"--questions must lie in 0-{n - 1}")
    return list(range(a, b + 1))


def _latency(embedder, texts: list[str], questions: list[str], n: int = 10000) -> dict:
    """BM25 build and query p50, and the whole retrieval (query embedding, FAISS, BM25, fusion), ms per
    `n` chunks: the file's passages repeated to `n`."""
    big = [texts[i % len(texts)] for i in range(n)]
    lexical = LexicalIndex()
    lexical.add("t", range(n), big)
    t0 = time.perf_counter()
    lexical.build("t")
    build = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        dense = VectorIndex(tmp, embedder.dim)
        vecs = np.repeat(embedder.embed(texts), -(-n // len(texts)), axis=0)[:n]
        dense.add("t", np.arange(n), vecs + rng.normal(0, 1e-3, vecs.shape).astype(np.float32))
        bm25, whole = [], []
        for q in questions * 2:
            t0 = time.perf_counter()
            b = lexical.search("t", q, DEPTH)
            t1 = time.perf_counter()
            rrf([dense.search("t", embedder.embed([q])[0], DEPTH), b], 10)
            t2 = time.perf_counter()
            bm25.append(t1 - t0)
            whole.append(t2 - t0)
    return {"chunks": n, "bm25_build_s": build, "bm25_query_ms_p50": median(bm25) * 1000,
            "hybrid_retrieval_ms_p50": median(whole) * 1000}


def _report(result: dict, covered: dict, ks: list[int], chunks: int) -> None:
    ceiling = result["ceiling"]
    print(f"{result['n']} questions ({result['questions']}), {chunks} chunks; ceiling {ceiling:.2f} "
          "(questions whose answer some passage holds); cells: coverage (share of the ceiling)")
    rows = [[name, *(f"{v:.2f} ({v / ceiling:.0%})" for v in r.values())] for name, r in result["retrievers"].items()]
    print(table(rows, ["retriever", *(f"top-{k}" for k in ks)]))
    at = ks.index(4) if 4 in ks else len(ks) - 1
    pairs = [("dense", "bm25"), ("dense", "hybrid"), ("bm25", "hybrid"),
             *(("hybrid", name) for name in covered if name.startswith("rerank"))]
    pairs = [(a, b) for a, b in pairs if a in covered and b in covered]
    rows = [[f"{a} → {b}", sum(y and not x for x, y in zip(covered[a][at], covered[b][at])),
             sum(x and not y for x, y in zip(covered[a][at], covered[b][at]))] for a, b in pairs]
    print(f"\nquestions gained and lost at top-{ks[at]}")
    print(table(rows, ["pair", "gained", "lost"]))
    lat = result["latency_per_10k"]
    print(f"\nper {lat['chunks']} chunks: BM25 build {lat['bm25_build_s']:.2f} s, BM25 query p50 "
          f"{lat['bm25_query_ms_p50']:.2f} ms, whole hybrid retrieval (embed, FAISS, BM25, RRF) p50 "
          f"{lat['hybrid_retrieval_ms_p50']:.2f} ms")
    cost = result.get("rerank_cost")
    if cost:
        print(f"rerank of the hybrid top-{cost['candidates']} (chunk KV in memory) beside cacheblend@0.15's TTFT of "
              f"the reranked top-4 ({cost['cacheblend_ms_p50']:.0f} ms p50) and reuse's ({cost['reuse_ms_p50']:.0f} "
              f"ms); whole retrieval / reuse TTFT {lat['hybrid_retrieval_ms_p50'] / cost['reuse_ms_p50']:.0%}")
        for name, c in cost["rerankers"].items():
            print(f"  {name}: {c['ms_p50']:.0f} ms p50, added TTFT {c['added_ttft']:.0%} "
                  "(median of per-question ratios)")


def _pieces(tokenizer, text: str, window: int) -> list[str]:
    """`text` cut into consecutive pieces of at most `window` tokens, each cut at a word's first token
    (a word longer than the window is cut inside)."""
    enc = tokenizer.encode(text, add_special_tokens=False)  # a `tokenizers.Tokenizer` (the embedder's)
    spans, words = enc.offsets, enc.word_ids
    starts, a = [], 0
    while a < len(spans):
        starts.append(a)
        b = a + window
        if b < len(spans):
            while b > a + 1 and words[b] == words[b - 1]:  # back to the start of the word the cut falls in
                b -= 1
            if b == a + 1:
                b = a + window
        a = b
    cuts = [spans[i][0] for i in starts] + [len(text)]
    return [text[x:y].strip() for x, y in zip(cuts, cuts[1:]) if text[x:y].strip()]
