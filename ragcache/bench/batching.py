"""In-process costs behind `bench serve`: batched, grouped and sequential selective recompute of requests that
arrive at once, and one decode step's time against its batch size (real fused contexts)."""
from __future__ import annotations

import torch

from blend import CacheBlend, Epic, Runner, compute_chunk, compute_prefix, fuse_and_prefill
from blend.batch import decode_batch, fuse_batch
from blend.prompt import as_ids, chat_frame, encode

from ..serving.groups import groups
from .timing import interleaved, median, table


def requests(runner: Runner, data: list[dict], system_prompt: str, n: int, passages: int = 4) -> list[tuple]:
    """n (prefix, chunk KVs, suffix) from the first n questions, chunks computed behind the system prompt."""
    tok = runner.model.tokenizer
    frame = chat_frame(tok, system_prompt)
    prefix = compute_prefix(runner, as_ids(frame.head))
    out = []
    for item in data[:n]:
        chunks = [compute_chunk(runner, as_ids(encode(tok, c["text"] + "\n\n")), prefix) for c in item["ctxs"][:passages]]
        out.append((prefix, chunks, as_ids(encode(tok, "\nQuestion: " + item["question"]) + frame.tail)))
    return out


def recompute_table(runner: Runner, reqs: list[tuple], repeats: int, kv: torch.dtype) -> str:
    """Time to all first tokens of len(reqs) requests arriving at once, each fused cache then kept at `kv` as a
    running sequence keeps it: one after another, in one batch, and in the scheduler's `groups` (one batch
    when nothing is compacted). The caches are let go once all are made, as a server's decoding would."""
    rows = []
    for name, policy in (("cacheblend@0.15", CacheBlend(0.15)), ("epic@16", Epic(16))):
        def run(parts):
            def go():
                kept = []
                for part in parts:
                    for r in fuse_batch(runner, [(p, c, s, policy, 0) for p, c, s in part]):
                        int(r.logits.argmax())
                        kept.append(runner.compact(r.cache, kv))  # a compacted one's working cache goes back here
                for cache in kept:
                    runner.release(cache)
            return go

        grouped = groups(runner, kv, reqs)
        ways = {"sequential": run([[r] for r in reqs]), "one batch": run([reqs]), "groups": run(grouped)}
        times = interleaved(ways, repeats)
        seq_s, bat_s, grp_s = (median(times[w]) for w in ways)
        rows.append([name, len(reqs), seq_s, bat_s, grp_s, len(grouped), seq_s / grp_s])
    return table(rows, ["mode", "requests", "sequential s", "one batch s", "in groups s", "groups",
                        "sequential / in groups"])


def decode_table(runner: Runner, reqs: list[tuple], sizes: list[int], repeats: int,
                 kv: torch.dtype) -> tuple[str, dict[int, float]]:
    """Seconds of one decode step of B sequences (each its own fused context, kept at `kv`), per B; and that table."""
    fused = [fuse_and_prefill(runner, *reqs[i % len(reqs)], CacheBlend(0.15), headroom=len(sizes) * (repeats + 1))
             for i in range(max(sizes))]  # requests repeat past len(reqs): each still has its own cache
    caches = [runner.compact(f.cache, kv) for f in fused]
    steps = {b: (lambda b=b: decode_batch(runner, caches[:b], [int(f.logits.argmax()) for f in fused[:b]]))
             for b in sizes}
    times = interleaved(steps, repeats)
    seconds = {b: median(times[b]) for b in sizes}
    for c in caches:
        runner.release(c)
    rows = [[b, seconds[b] * 1000, seconds[b] / seconds[sizes[0]], b * seconds[sizes[0]] / seconds[b]] for b in sizes]
    context = sum(len(x) for x in reqs[0][1]) + len(reqs[0][0]) + reqs[0][2].numel()
    return (f"one decode step of B sequences, ~{context} tokens of context each\n" +
            table(rows, ["B", "step ms", "vs B=1", "tokens/s vs B=1"]), seconds)


def compact_table(runner: Runner, req: tuple, kv: torch.dtype, repeats: int) -> str:
    """A cacheblend@0.15 request's time to its first token, its fused cache left as it is or compacted to `kv`
    as a running sequence keeps it (interleaved)."""
    def fuse(compact: bool):
        def go():
            res = fuse_and_prefill(runner, *req, CacheBlend(0.15), headroom=64)
            int(res.logits.argmax())
            runner.release(runner.compact(res.cache, kv) if compact else res.cache)
        return go

    times = interleaved({"fused cache as computed": fuse(False), f"then compacted to {kv}": fuse(True)}, repeats)
    base = median(times["fused cache as computed"])
    return table([[name, median(t), median(t) / base] for name, t in times.items()],
                 ["cacheblend@0.15 TTFT", "seconds", "vs as computed"])


def run_in_process(settings, data: list[dict], n: int, sizes: list[int], repeats: int,
                   new_tokens: int) -> tuple[str, tuple[int, int]]:
    """The in-process tables, and what one decode step reads: (weight bytes, one sequence's KV bytes at its
    average context while it decodes `new_tokens`)."""
    from blend import KVCache, load_model

    model = load_model(settings.model, settings.home, settings.device, settings.dtype)
    runner = Runner(model, settings.decode_weights)
    kv = model.dtype if settings.kv_cache_dtype == "auto" else getattr(torch, settings.kv_cache_dtype)
    with torch.inference_mode():
        reqs = requests(runner, data, settings.system_prompt, n)
        text = (f"\nBatched, grouped and sequential selective recompute, {n} requests arriving at once, 4 passages "
                f"each, every fused cache kept at {kv} "
                f"({model.name} {model.dtype} on {model.device}, median of {repeats} interleaved repeats)\n")
        text += recompute_table(runner, reqs[:n], repeats, kv)
        decode, _ = decode_table(runner, reqs, sizes, repeats, kv)
        if kv != model.dtype:
            decode += "\n\n" + compact_table(runner, reqs[0], kv, repeats)
    context = sum(len(x) for x in reqs[0][1]) + len(reqs[0][0]) + reqs[0][2].numel() + new_tokens // 2
    row = KVCache.bytes_per_row_of(runner.num_layers, runner.num_kv_heads, runner.head_dim, kv)
    return text + "\n\n" + decode, (runner.decode_w.bytes, context * row)
