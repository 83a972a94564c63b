"""The rerankers in `bench coverage`: each question's hybrid top-N reordered on the candidates' chunk KV
(computed behind the system prompt, as the server stores them, and kept in memory as a CPU-tier hit would
give them) by each reranker (blend/relevance.py), and what each adds to TTFT: per question, every rerank
beside cacheblend@0.15 and reuse over the top-4, interleaved; medians of the per-question times and ratios.
`rerank` is the deployment's reranker (RAGCACHE_RERANKER), `rerank-<name>` the other.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from blend import CacheBlend, Reuse, Runner, compute_chunk, compute_prefix, fuse_and_prefill, load_model
from blend.prompt import QUESTION, as_ids, chat_frame, encode
from blend.relevance import RERANKERS, relevance

from .timing import interleaved, median

KEEP = 60  # chunk KVs kept between questions (~25 MB each for SmolLM2 at 550 tokens, float32)


@torch.inference_mode()  # the prefix's KV is an inference tensor that compute_chunk copies into each cache
def rerank(settings, questions: list[str], texts: list[str], hybrid: list[list[int]], n: int,
           top_k: int = 4) -> tuple[dict[str, list[list[int]]], dict]:
    model = load_model(settings.model, settings.home, settings.device, settings.dtype)
    runner, tok = Runner(model), model.tokenizer
    frame = chat_frame(tok, settings.system_prompt)
    prefix = compute_prefix(runner, as_ids(frame.head))
    names = {r: "rerank" if r == settings.reranker else f"rerank-{r}" for r in RERANKERS}
    kept: OrderedDict[int, object] = OrderedDict()

    def kv(i: int):
        if i not in kept:
            kept[i] = compute_chunk(runner, as_ids(encode(tok, texts[i] + "\n\n")), prefix)
            while len(kept) > KEEP:
                kept.popitem(last=False)
        kept.move_to_end(i)
        return kept[i]

    out: dict[str, list[list[int]]] = {name: [] for name in names.values()}
    times: dict[str, list[float]] = {name: [] for name in [*names.values(), "cacheblend", "reuse"]}
    for q, ranking in zip(questions, hybrid):
        ids = ranking[:n]
        chunks = [kv(i) for i in ids]

        def score(reranker):
            return lambda: relevance(runner, prefix, chunks, tok, frame.tail, q, reranker)

        for reranker, name in names.items():
            order = [ids[j] for j in torch.argsort(score(reranker)(), descending=True, stable=True).tolist()]
            out[name].append(order + ranking[n:])
        top = [kv(i) for i in out["rerank"][-1][:top_k]]
        suffix = as_ids(encode(tok, QUESTION + q) + frame.tail)

        def ttft(policy):
            def go():
                res = fuse_and_prefill(runner, prefix, top, suffix, policy)
                int(res.logits.argmax())
                runner.release(res.cache)
            return go

        t = interleaved({**{name: score(r) for r, name in names.items()},
                         "cacheblend": ttft(CacheBlend(0.15)), "reuse": ttft(Reuse())}, repeats=1)
        for name, seconds in t.items():
            times[name].append(seconds[0])
    cost = {"candidates": n, "cacheblend_ms_p50": median(times["cacheblend"]) * 1000,
            "reuse_ms_p50": median(times["reuse"]) * 1000, "rerankers": {}}
    for name in names.values():
        added = [r / c for r, c in zip(times[name], times["cacheblend"])]
        cost["rerankers"][name] = {"ms_p50": median(times[name]) * 1000, "added_ttft": median(added)}
    return out, cost
