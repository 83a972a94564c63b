"""The reranker in `bench coverage`: each question's hybrid top-N reordered by query likelihood against the
candidates' chunk KV (computed behind the system prompt, as the server stores them, and kept in memory as
a CPU-tier hit would give them), and what it adds to TTFT: per question, the rerank beside cacheblend@0.15
and reuse over the reranked top-4, interleaved, medians of the per-question times and ratios.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from blend import CacheBlend, Reuse, Runner, compute_chunk, compute_prefix, fuse_and_prefill, load_model
from blend.likelihood import likelihood_ids, question_likelihood
from blend.prompt import as_ids, chat_frame, encode

from .timing import interleaved, median

KEEP = 60  # chunk KVs kept between questions (~25 MB each for SmolLM2 at 550 tokens, float32)


@torch.inference_mode()  # the prefix's KV is an inference tensor that compute_chunk copies into each cache
def rerank(settings, questions: list[str], texts: list[str], hybrid: list[list[int]], n: int,
           top_k: int = 4) -> tuple[list[list[int]], dict]:
    model = load_model(settings.model, settings.home, settings.device, settings.dtype)
    runner, tok = Runner(model), model.tokenizer
    frame = chat_frame(tok, settings.system_prompt)
    prefix = compute_prefix(runner, as_ids(frame.head))
    kept: OrderedDict[int, object] = OrderedDict()

    def kv(i: int):
        if i not in kept:
            kept[i] = compute_chunk(runner, as_ids(encode(tok, texts[i] + "\n\n")), prefix)
            while len(kept) > KEEP:
                kept.popitem(last=False)
        kept.move_to_end(i)
        return kept[i]

    out, times = [], {"rerank": [], "cacheblend": [], "reuse": []}
    for q, ranking in zip(questions, hybrid):
        ids = ranking[:n]
        chunks = [kv(i) for i in ids]
        lead, qids = likelihood_ids(tok, q)
        scores = question_likelihood(runner, prefix, chunks, lead, qids)
        order = [ids[j] for j in torch.argsort(scores, descending=True, stable=True).tolist()]
        out.append(order + ranking[n:])
        top = [kv(i) for i in order[:top_k]]
        suffix = as_ids(encode(tok, "Question: " + q) + frame.tail)

        def ttft(policy):
            def go():
                res = fuse_and_prefill(runner, prefix, top, suffix, policy)
                int(res.logits.argmax())
                runner.release(res.cache)
            return go

        t = interleaved({"rerank": lambda: question_likelihood(runner, prefix, chunks, lead, qids),
                         "cacheblend": ttft(CacheBlend(0.15)), "reuse": ttft(Reuse())}, repeats=1)
        for name, seconds in t.items():
            times[name].append(seconds[0])
    added = [r / c for r, c in zip(times["rerank"], times["cacheblend"])]
    return out, {"candidates": n, "rerank_ms_p50": median(times["rerank"]) * 1000,
                 "cacheblend_ms_p50": median(times["cacheblend"]) * 1000,
                 "reuse_ms_p50": median(times["reuse"]) * 1000, "added_ttft": median(added)}
