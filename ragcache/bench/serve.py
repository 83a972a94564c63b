"""`ragcache bench serve`: aggregate decode throughput of N concurrent HTTP clients (continuous batching).

A precomputed MuSiQue corpus (4 passages per question, top-k 4), every chunk loaded once before timing (the
runs read cached KV, whatever N); every request decodes exactly
`--new-tokens` tokens (`ignore_eos`), streamed. For N = 1, 4, 8, 16 clients in `reuse` and in
`cacheblend` (ratio 0.15), each client sends `--rounds` requests one after another:
output tokens/s against N = 1, client TTFT and end-to-end latency p50/p99. Cacheblend's
recompute does not shrink when batched, so its gain is bounded by
    (recompute + decode of one request) ÷ (recompute + its share of a batched decode of N),
with recompute and decode from its N = 1 run and the batched decode share from reuse at N
(whose prefill is a few rows): printed beside the measured ratio. Then, in process: batched, grouped and
sequential selective recompute of 8 requests arriving at once, and a decode step's cost per batch size. Last,
reuse against the bandwidth bound of a decode step's bytes, end to end and in its decode phase alone.
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import httpx

from .batching import run_in_process
from .http import _cli, _env, _jsonl, _questions, _Server, _stream
from .timing import median, table

MODES = {"reuse": {"mode": "reuse"}, "cacheblend@0.15": {"mode": "cacheblend", "recompute_ratio": 0.15}}


def run(settings, args) -> int:
    data = _questions(Path(args.dataset))[:8]
    sizes = args.clients
    with tempfile.TemporaryDirectory(prefix="ragcache-bench-serve-") as tmp:
        env = {**_env(settings, Path(tmp) / "home"), "RAGCACHE_CHUNK_TOKENS": "1024",  # a passage is one chunk
               "RAGCACHE_KV_CACHE_DTYPE": settings.kv_cache_dtype, "RAGCACHE_DECODE_WEIGHTS": settings.decode_weights}
        _cli(env, "ingest", _jsonl(Path(tmp) / "corpus.jsonl", [c for q in data for c in q["ctxs"][:4]], "c"),
             "--namespace", "bench")
        _cli(env, "precompute", "--quiet")
        questions = [q["question"] for q in data]
        with _Server(env, Path(tmp)) as srv:
            print(f"model {settings.model}, {os.cpu_count()} cores, KV of running sequences {settings.kv_cache_dtype}, "
                  f"decode weights {settings.decode_weights}; corpus: {len(data)} questions x 4 MuSiQue passages, "
                  f"top-k 4, {args.new_tokens} tokens per request (ignore_eos), {args.rounds} requests per client, "
                  "streamed")
            # warm every path, and every question's chunks into memory: N = 1 reads question 0's, N = 16 all eight's
            with httpx.Client(base_url=srv.url, timeout=600) as c:
                for body in MODES.values():
                    _stream(c, _body(questions[0], body, 4))
                for q in questions[1:]:
                    _stream(c, _body(q, MODES["reuse"], 1))
            runs = {}
            for m in MODES:
                for n in sizes:
                    runs[(m, n)] = r = _clients(srv.url, questions, MODES[m], n, args.rounds, args.new_tokens)
                    print(f"  {m} N={n}: {r['tokens']} tokens in {r['wall']:.1f} s, {r['errors']} errors", flush=True)
        print(_report(runs, sizes, args.new_tokens))
    text, reads = run_in_process(settings, data, 8, sizes, args.repeats, args.new_tokens)
    print(text)
    print(_bandwidth(runs, sizes, *reads))
    return 0


def _bandwidth(runs: dict, sizes: list[int], weights: int, kv: int) -> str:
    """Reuse's gain against the bound set by the bytes a decode step reads: N sequences read the weights
    once and N caches, so N x (W + KV) / (W + N x KV) over one sequence's step. Twice: end to end (the clients'
    tokens/s, each request's fused prefill included) and the decode phase alone (the server's median time a
    token from first token to last: N sequences at once against one), which is what the bound counts. And what
    end to end could reach if the decode ran at the bound while the rest of a request (retrieval, fused prefill,
    HTTP: its time at N = sizes[0] less its decode share) stayed as it was and ran one request after another."""
    rows = []
    one = runs[("reuse", sizes[0])]
    latency = one["wall"] / one["requests"]  # each request's share of the wall at sizes[0]
    decode = one["decode"] / 1000 / sizes[0]  # its decode's share (ms → s)
    for n in sizes:
        r = runs[("reuse", n)]
        gain = (r["tokens"] / r["wall"]) / (one["tokens"] / one["wall"])
        decode_gain = n * one["decode"] / (sizes[0] * r["decode"])  # the same tokens a request, so ms a token
        bound = n * (weights + kv) / (weights + n * kv) / (sizes[0] * (weights + kv) / (weights + sizes[0] * kv))
        ceiling = latency / (latency - decode + decode / bound) / bound
        rows.append([n, (weights + n * kv) / 1e6, gain, bound, gain / bound, decode_gain, decode_gain / bound, ceiling])
    return (f"\nreuse against the bandwidth bound: a step reads {weights / 1e6:.0f} MB of weights and "
            f"{kv / 1e6:.1f} MB of KV per sequence\n"
            + table(rows, ["N", "MB a step reads", "tokens/s vs N=1", "bound", "vs bound", "decode phase vs N=1",
                           "decode phase vs bound", "end to end vs bound, were decode at the bound"]))


def _body(question: str, mode: dict, new_tokens: int) -> dict:
    return {"query": question, "namespace": "bench", "top_k": 4, "max_tokens": new_tokens, "ignore_eos": True,
            **mode}


def _clients(url: str, questions: list[str], mode: dict, n: int, rounds: int, new_tokens: int) -> dict:
    """N clients, each `rounds` streamed requests in a row, started together."""
    seen: list[tuple[float, float, dict]] = []  # (client TTFT s, client latency s, done event)
    errors: list[str] = []
    start = threading.Barrier(n)

    def client(i: int) -> None:
        with httpx.Client(base_url=url, timeout=900) as c:
            start.wait()
            for r in range(rounds):
                t0 = time.perf_counter()
                try:
                    ttft, done = _stream(c, _body(questions[(i + r * n) % len(questions)], mode, new_tokens))
                except Exception as e:  # noqa: BLE001 — counted and reported, the others go on
                    errors.append(str(e))
                    continue
                seen.append((ttft, time.perf_counter() - t0, done))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(d["usage"]["completion_tokens"] for _, _, d in seen)
    return {"wall": wall, "tokens": tokens, "errors": len(errors), "requests": len(seen),
            "ttft": sorted(t for t, _, _ in seen),
            "latency": sorted(l for _, l, _ in seen), "blend": median([d["timings_ms"]["blend"] for *_, d in seen]),
            "decode": median([d["timings_ms"]["decode"] for *_, d in seen])}


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _report(runs: dict, sizes: list[int], new_tokens: int) -> str:
    rows = []
    for (mode, n), r in runs.items():
        one = runs[(mode, sizes[0])]
        rate, rate1 = r["tokens"] / r["wall"], one["tokens"] / one["wall"]
        bound = ""
        if mode != "reuse":  # (R + D) / (R + D_N / N), R and D from this mode alone, D_N from reuse at N
            recompute, decode = one["blend"], one["decode"]
            bound = (recompute + decode) / (recompute + runs[("reuse", n)]["decode"] / n)
        rows.append([mode, n, r["tokens"], r["errors"], r["wall"], rate, rate / rate1, bound,
                     (rate / rate1 / bound) if bound else "", _pct(r["ttft"], .5) * 1000, _pct(r["ttft"], .99) * 1000,
                     _pct(r["latency"], .5), _pct(r["latency"], .99), r["blend"], r["decode"] / max(1, new_tokens)])
    return ("\nN concurrent clients over HTTP (continuous batching)\n" + table(rows, [
        "mode", "N", "tokens", "errors", "wall s", "tokens/s", "vs N=1", "bound", "vs bound", "TTFT p50 ms",
        "TTFT p99 ms", "latency p50 s", "latency p99 s", "server blend ms (median)", "server ms/token (median)"]))
