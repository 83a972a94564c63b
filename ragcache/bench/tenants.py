"""`ragcache bench tenants`: tenant B's TTFT alone, then while tenant A floods the same server.

Two API keys, one namespace each (4 MuSiQue passages for each of 8 questions). B sends `--rounds`
streamed requests one after another (`reuse`, top-k 4, 8 tokens): its client TTFT p50/p99, first with
the server to itself, then while A runs `max(--clients)` clients that each send `full`-mode requests
of `--new-tokens` tokens (ignore_eos) again as soon as one ends, 429s included. The target is B's p99
under the flood within 2x of alone, every one of B's requests answered (issue 21); A's answers are
counted by status. `--hostile`: for `--seconds`, A also pins and unpins its documents, sends bodies too
large, too deep and with too long integers (each `hostile.RATE` a second: on this machine's 2 cores a
client's own CPU, unpaced, would be what the run measured), and holds 16 stalled uploads open.
`--ingest N`: instead of flooding, A ingests N documents through `POST /v1/documents` while B runs.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from ..errors import UserError
from . import hostile
from .http import _cli, _env, _jsonl, _questions, _Server, _stream
from .timing import table

KEYS = {"bench-tenant-a-key": ["a"], "bench-tenant-b-key": ["b"]}
STALLED = 16  # A's stalled uploads open at once, with --hostile


def run(settings, args) -> int:
    data = _questions(Path(args.dataset))[:8]
    ctxs = [c for q in data for c in q["ctxs"][:4]]
    key_a = list(KEYS)[0]
    with tempfile.TemporaryDirectory(prefix="ragcache-bench-tenants-") as tmp:
        env = {**_env(settings, Path(tmp) / "home"), "RAGCACHE_CHUNK_TOKENS": "1024",
               "RAGCACHE_API_KEYS": json.dumps(KEYS), "RAGCACHE_MAX_BODY_BYTES": str(settings.max_body_bytes)}
        for ns in ("a", "b"):
            _cli(env, "ingest", _jsonl(Path(tmp) / f"{ns}.jsonl", ctxs, ns), "--namespace", ns)
        _cli(env, "precompute", "--quiet")
        questions = [q["question"] for q in data]
        with _Server(env, Path(tmp)) as srv:
            alone, _ = _tenant_b(srv.url, questions, lambda n: n < args.rounds)
            hostile_args = (key_a, [f"a-{i}" for i in range(len(ctxs))], settings.max_body_bytes) if args.hostile else None
            ctx = multiprocessing.get_context("spawn")
            stop, ingested, out = ctx.Event(), ctx.Event(), ctx.Queue()
            clients = 0 if args.ingest else max(args.clients)
            a = ctx.Process(target=tenant_a, args=(srv.url, questions, args.new_tokens, clients, hostile_args,
                                                   (key_a, args.ingest, settings.max_body_bytes, ingested), stop, out),
                            daemon=True)
            a.start()
            t0, end = time.perf_counter(), time.perf_counter() + args.seconds
            if args.ingest:  # B runs while the ingest does
                more = lambda n: not ingested.is_set()  # noqa: E731
            elif args.hostile:
                more = lambda n: time.perf_counter() < end  # noqa: E731
            else:
                more = lambda n: n < args.rounds  # noqa: E731
            try:
                flooded, failed = _tenant_b(srv.url, questions, more)
            finally:
                stop.set()
                a_seen = out.get(timeout=600)
                a.join()
            seconds = time.perf_counter() - t0
    answered = a_seen[("full-mode generate", 200)]
    b_under = f"{args.seconds} s of them" if args.hostile else "them while A ingests" if args.ingest else args.rounds
    a_does = (f"ingests {args.ingest} documents ({hostile.INGEST_BATCH} a request, precompute off)" if args.ingest else
              f"{clients} clients of full-mode requests, {args.new_tokens} tokens each, ignore_eos, sent again at once"
              + (", and pins, bad bodies and stalled uploads" if args.hostile else ""))
    print(f"model {settings.model}, {os.cpu_count()} cores; B: {args.rounds} streamed requests alone, then "
          f"{b_under} (reuse, top-k 4, 8 tokens); A: {a_does}")
    print(f"A's answers in {seconds:.0f} s (what, status: count): "
          + ", ".join(f"{w} {st}: {n}" for (w, st), n in sorted(a_seen.items(), key=str))
          + f"; {answered / seconds:.2f} full-mode answers/s")
    pct = lambda t, q: float(np.percentile(t, q))  # noqa: E731
    rows = [[label, len(t), pct(t, 50) * 1000, pct(t, 99) * 1000, pct(w, 50) * 1000] for label, (t, w) in
            (("B alone", alone), ("B while A floods", flooded))]
    print(table(rows, ["", "answered", "TTFT p50 ms", "TTFT p99 ms", "whole request p50 ms"]))
    print(f"B's requests not answered under the flood: {failed} (target 0)")
    print(f"p99 ratio (flooded / alone): {pct(flooded[0], 99) / pct(alone[0], 99):.2f} (target <= 2)")
    return 0


def _tenant_b(url: str, questions: list[str], more) -> tuple[tuple[list[float], list[float]], int]:
    """((client TTFTs, whole-request times) (s) of B's answered requests, sent one after another while
    `more(requests sent so far)`; how many got no answer)."""
    headers = {"Authorization": f"Bearer {list(KEYS)[1]}"}
    ttfts, wholes, failed = [], [], 0
    with httpx.Client(base_url=url, headers=headers, timeout=600) as c:
        _stream(c, _body(questions[0], "b", 8))  # warm
        while more(len(ttfts) + failed):
            t0 = time.perf_counter()
            try:
                ttfts.append(_stream(c, _body(questions[(len(ttfts) + failed) % len(questions)], "b", 8))[0])
                wholes.append(time.perf_counter() - t0)
            except (UserError, httpx.HTTPError):
                failed += 1
    return (ttfts, wholes), failed


def tenant_a(url: str, questions: list[str], tokens: int, clients: int, hostile_args, ingest_args, stop,
             out) -> None:
    """Tenant A's clients, until `stop`, in a process of its own (B's client never waits on their GIL): its
    answers by (what, status) go to `out`. `hostile_args`: (key, doc ids, max body bytes), or None;
    `ingest_args`: (key, documents to ingest (0: none), max body bytes, an Event set when they are in)."""
    work = [(_flood, (url, questions, tokens)) for _ in range(clients)]
    if ingest_args[1]:
        work.append((hostile.ingest, (url, *ingest_args[:3], "a", ingest_args[3])))
    if hostile_args is not None:
        key, docs, max_body = hostile_args
        work += [(hostile.pins, (url, key, "a", docs)), (hostile.bodies, (url, key, max_body)),
                 (hostile.uploads, (url, key, STALLED))]
    seen = [Counter() for _ in work]
    threads = [threading.Thread(target=fn, args=(*a, stop, c), daemon=True) for (fn, a), c in zip(work, seen)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(sum(seen, Counter()))


def _flood(url: str, questions: list[str], tokens: int, stop, seen: Counter) -> None:
    headers = {"Authorization": f"Bearer {list(KEYS)[0]}"}
    with httpx.Client(base_url=url, headers=headers, timeout=600) as c:
        i = 0
        while not stop.is_set():
            r = c.post("/v1/rag/generate", json={**_body(questions[i % len(questions)], "a", tokens), "mode": "full",
                                                 "ignore_eos": True})
            seen[("full-mode generate", r.status_code)] += 1
            i += 1


def _body(question: str, namespace: str, tokens: int) -> dict:
    return {"query": question, "namespace": namespace, "mode": "reuse", "top_k": 4, "max_tokens": tokens}
