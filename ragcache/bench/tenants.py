"""`ragcache bench tenants`: tenant B's TTFT alone, then while tenant A floods the same server.

Two API keys, one namespace each (4 MuSiQue passages for each of 8 questions). B sends `--rounds`
streamed requests one after another (`reuse`, top-k 4, 8 tokens): its client TTFT p50/p99, first with
the server to itself, then while A runs `max(--clients)` clients that each send `full`-mode requests
of `--new-tokens` tokens (ignore_eos) again as soon as one ends, 429s included. The target is B's p99
under the flood within 2x of alone (issue 21); A's answers are counted by status.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from .http import _cli, _env, _jsonl, _questions, _Server, _stream
from .timing import table

KEYS = {"bench-tenant-a-key": ["a"], "bench-tenant-b-key": ["b"]}


def run(settings, args) -> int:
    data = _questions(Path(args.dataset))[:8]
    ctxs = [c for q in data for c in q["ctxs"][:4]]
    with tempfile.TemporaryDirectory(prefix="ragcache-bench-tenants-") as tmp:
        env = {**_env(settings, Path(tmp) / "home"), "RAGCACHE_CHUNK_TOKENS": "1024",
               "RAGCACHE_API_KEYS": json.dumps(KEYS)}
        for ns in ("a", "b"):
            _cli(env, "ingest", _jsonl(Path(tmp) / f"{ns}.jsonl", ctxs, ns), "--namespace", ns)
        _cli(env, "precompute", "--quiet")
        questions = [q["question"] for q in data]
        with _Server(env, Path(tmp)) as srv:
            alone = _tenant_b(srv.url, questions, args.rounds)
            stop, statuses = threading.Event(), Counter()
            flooders = [threading.Thread(target=_flood, args=(srv.url, questions, args.new_tokens, stop, statuses),
                                         daemon=True) for _ in range(max(args.clients))]
            for t in flooders:
                t.start()
            try:
                flooded = _tenant_b(srv.url, questions, args.rounds)
            finally:
                stop.set()
                for t in flooders:
                    t.join()
    print(f"model {settings.model}, {os.cpu_count()} cores; B: {args.rounds} streamed requests (reuse, top-k 4, "
          f"8 tokens); A: {max(args.clients)} clients of full-mode requests, {args.new_tokens} tokens each, "
          f"ignore_eos, sent again at once; A's answers by status: {dict(statuses)}")
    pct = lambda t, q: float(np.percentile(t, q))  # noqa: E731
    rows = [[label, pct(t, 50) * 1000, pct(t, 99) * 1000] for label, t in
            (("B alone", alone), ("B while A floods", flooded))]
    print(table(rows, ["", "TTFT p50 ms", "TTFT p99 ms"]))
    print(f"p99 ratio (flooded / alone): {pct(flooded, 99) / pct(alone, 99):.2f} (target <= 2)")
    return 0


def _tenant_b(url: str, questions: list[str], n: int) -> list[float]:
    """Client TTFTs (s) of B's requests, one after another."""
    headers = {"Authorization": f"Bearer {list(KEYS)[1]}"}
    with httpx.Client(base_url=url, headers=headers, timeout=600) as c:
        _stream(c, _body(questions[0], "b", 8))  # warm
        return [_stream(c, _body(questions[i % len(questions)], "b", 8))[0] for i in range(n)]


def _flood(url: str, questions: list[str], tokens: int, stop: threading.Event, statuses: Counter) -> None:
    headers = {"Authorization": f"Bearer {list(KEYS)[0]}"}
    with httpx.Client(base_url=url, headers=headers, timeout=600) as c:
        i = 0
        while not stop.is_set():
            r = c.post("/v1/rag/generate", json={**_body(questions[i % len(questions)], "a", tokens), "mode": "full",
                                                 "ignore_eos": True})
            statuses[r.status_code] += 1
            i += 1


def _body(question: str, namespace: str, tokens: int) -> dict:
    return {"query": question, "namespace": namespace, "mode": "reuse", "top_k": 4, "max_tokens": tokens}
