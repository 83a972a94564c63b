"""TTFT of each fusion mode against full prefill, side by side, chunk KVs already in memory."""
from __future__ import annotations

import torch

from blend import CacheBlend, Epic, Full, Reuse, Runner, compute_chunk, compute_prefix, fuse_and_prefill, load_model
from blend.prompt import as_ids, chat_frame, encode

from ..errors import UserError
from ..evaluation.evaluate import load_dataset
from .timing import interleaved, median, table

MODES = {"full": Full(), "reuse": Reuse(), "epic@16": Epic(16), "cacheblend@0.15": CacheBlend(0.15)}


def run(settings, args) -> int:
    data = load_dataset(args.dataset, None)
    if not 0 <= args.question < len(data):
        raise UserError(f"--question must be in [0, {len(data)}) for {args.dataset}")
    item = data[args.question]
    how = args.chunk_prefill or "alone"
    if how == "lead":
        raise UserError("bench blend computes chunk KV alone or prefixed; lead is measured by `ragcache eval`")
    model = load_model(settings.model, settings.home, settings.device, settings.dtype)
    runner = Runner(model)
    tok = model.tokenizer
    frame = chat_frame(tok, settings.system_prompt)
    prefix = compute_prefix(runner, as_ids(frame.head))
    suffix = as_ids(encode(tok, "\nQuestion: " + item["question"]) + frame.tail)
    for n in args.passages or [4, 10]:
        texts = [c["text"] + "\n\n" for c in item["ctxs"][:n]]
        chunks = [compute_chunk(runner, as_ids(encode(tok, t)), None if how == "alone" else prefix)
                  for t in texts]
        results = {}

        def step(name):
            def go():
                res = fuse_and_prefill(runner, prefix, chunks, suffix, MODES[name])
                int(res.logits.argmax())  # the first token is chosen: TTFT ends here
                runner.release(res.cache)
                results[name] = res
            return go

        token_ids = torch.cat([prefix.token_ids, *[c.token_ids for c in chunks], suffix])
        steps = {name: step(name) for name in MODES}
        steps["prefill, no cache"] = lambda: int(runner.prefill(token_ids).logits.argmax())
        times = interleaved(steps, args.repeats)
        total = results["full"].layout.total
        full_s = median(times["full"])
        rows = []
        for name, ts in times.items():
            if name not in results:
                rows.append([name, median(ts), full_s / median(ts), 1.0, 1.0, "", ""])
                continue
            res = results[name]
            speedup, ideal = full_s / median(ts), 1 / res.work_fraction
            stages = {k: median([v]) for k, v in res.timings.items()}
            rows.append([name, median(ts), speedup, res.work_fraction, ideal, speedup / ideal,
                         stages["assemble"] * 1000])
        print(f"\n{n} passages, {total} tokens (prefix {len(prefix)}, suffix {suffix.numel()}), chunks computed "
              f"{how}; {model.name} {model.dtype} on {model.device}; "
              f"median of {args.repeats} interleaved repeats")
        print(table(rows, ["mode", "TTFT s", "speedup vs full", "recomputed", "ideal", "efficiency",
                           "assemble ms (last)"]))
    return 0
