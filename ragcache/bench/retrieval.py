"""One query's retrieval latency over a 10K-chunk index (synthetic unit vectors)."""
from __future__ import annotations

import tempfile
import time

import numpy as np

from index import Embedder, VectorIndex

from .timing import median, table


def run(settings, args) -> int:
    args.chunks = args.chunks or 10000
    rng = np.random.default_rng(0)
    n, dim, queries = args.chunks, 384, 200
    vecs = rng.normal(size=(n, dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    embedder = Embedder()
    texts = ["Where was the author of Hannibal and Scipio educated at?"] * 20
    rows = []
    for kind in ("flat", "hnsw", "ivf"):
        with tempfile.TemporaryDirectory() as tmp:
            idx = VectorIndex(tmp, dim, kind, nlist=64)
            idx.add("bench", np.arange(n), vecs)
            q = rng.normal(size=(queries, dim)).astype(np.float32)
            times = []
            for v in q:
                t = time.perf_counter()
                idx.search("bench", v, 10)
                times.append(time.perf_counter() - t)
            exact = [set(np.argsort(-vecs @ v)[:10].tolist()) for v in q[:50]]
            recall = np.mean([len(e & {i for i, _ in idx.search("bench", v, 10)}) / 10 for e, v in zip(exact, q)])
            rows.append([kind, median(times) * 1000, float(np.percentile(times, 99)) * 1000, recall])
    embed_times = []
    for text in texts:
        t = time.perf_counter()
        embedder.embed([text])
        embed_times.append(time.perf_counter() - t)
    print(f"{n} chunks × {dim} dims, top-10, {queries} queries, one at a time")
    print(table(rows, ["index", "search ms (median)", "p99 ms", "recall@10 vs exact"]))
    print(f"embedding the query (all-MiniLM-L6-v2, CPU): {median(embed_times) * 1000:.1f} ms median")
    return 0
