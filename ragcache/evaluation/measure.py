"""One eval request measured: its TTFT, the teacher-forced distributions along a reference answer, and its own
answer, as a served request gets them (its KV at the serving precision); `evaluate` runs one per question and
mode, and `bench store` and `calibrate-codec` reuse it."""
from __future__ import annotations

import time

import torch

from blend import after_first, fuse_and_prefill, repair_of, tokens_only
from blend.decode import Sampling, decode


def run_mode(service, passages, keys, suffix, policy, cfg, reference=None) -> dict:
    """One request: TTFT, then the teacher-forced logits along `reference` ids, then the answer. A policy that
    repairs after the first token (`deferred`) does so in both, over that token: the reference's, then its own.
    `passages.load(keys)` gives the chunk KV and `passages.token_ids[key]` the ids; `cfg` is an EvalConfig."""
    runner = service.runner
    t0 = time.perf_counter()
    chunks = passages.load(keys) if policy.reads_chunk_kv else [tokens_only(passages.token_ids[k]) for k in keys]
    headroom = cfg.max_new_tokens + cfg.tf_tokens
    fused = fuse_and_prefill(runner, service.prefix, chunks, suffix, policy, headroom=headroom)
    first = int(fused.logits.argmax())
    ttft = time.perf_counter() - t0
    total = fused.layout.total
    served = reference is not None  # a served mode decodes from its KV as a running sequence keeps it; the
    if served:                      # reference (full) stays at the model's dtype
        fused.cache = runner.compact(fused.cache, service.kv_cache_dtype)
    repair = repair_of(policy)

    def repaired(token: int):  # the prompt and `token` fused again by the repair policy, timed
        t = time.perf_counter()
        out = fuse_and_prefill(runner, service.prefix, chunks, after_first(suffix, token), repair, headroom=headroom)
        int(out.logits.argmax())
        seconds = time.perf_counter() - t
        if served:
            out.cache = runner.compact(out.cache, service.kv_cache_dtype)
        return out, seconds

    def forced(ids: list[int]) -> torch.Tensor:  # (m, V): the distributions before each of ids[:m]
        m = max(1, min(cfg.tf_tokens, len(ids)))
        head, f, start, ids = [fused.logits[None]], fused, total, ids[: m - 1]
        if repair is not None and ids:
            f, _ = repaired(ids[0])
            head, start, ids = head + [f.logits[None]], total + 1, ids[1:]
        rest = [runner.forward_selected(f.cache, torch.tensor(ids), torch.arange(start, start + len(ids)),
                                        all_logits=True).logits] if ids else []
        f.cache.length = f.layout.total  # those rows were scratch: decoding starts right after the prompt
        if f is not fused:
            runner.release(f.cache)
        return torch.cat([*head, *rest])

    tf = forced(reference) if reference is not None else None
    last, repair_s = fused, 0.0
    if repair is None:
        answer = decode(runner, fused.cache, fused.logits, Sampling(cfg.max_new_tokens), service.stops)
    elif first in service.stops:
        answer = []
    else:  # the first token out, then the repair, then the rest from its cache
        last, repair_s = repaired(first)
        rest = decode(runner, last.cache, last.logits, Sampling(cfg.max_new_tokens - 1),
                      service.stops) if cfg.max_new_tokens > 1 else []
        answer = [first, *rest]
        runner.release(last.cache)
    if reference is None:
        tf = forced(answer)  # full prefill: its own answer is the reference
    layout, rows = last.layout, last.kv_rows[-1]
    context = layout.suffix_start - layout.prefix_len
    recomputed = int(((rows >= layout.prefix_len) & (rows < layout.suffix_start)).sum())
    work = fused.work_fraction + (last.work_fraction if last is not fused else 0.0)
    runner.release(fused.cache)
    return {"ttft_s": ttft, "repair_s": repair_s, "first": first, "answer_ids": answer, "tf": tf,
            "recompute_fraction": recomputed / max(context, 1), "work_fraction": work}
