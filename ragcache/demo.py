"""`ragcache demo`: the main job on the bundled model and the demo data."""
from __future__ import annotations

import json
import time
from pathlib import Path

from blend.decode import Sampling, decode
from blend.model import load_model
from blend.prompt import as_ids, chat_frame, encode, stop_token_ids
from blend.runner import Runner

from .config import Settings
from .errors import UserError


def run_demo(settings: Settings, args) -> int:
    path = Path(args.data)
    if not path.is_file():
        raise UserError(f"demo data {path} not found: run from the repository root or pass --data")
    item = next(q for q in json.loads(path.read_text()) if any(a.lower() in c["text"].lower()
                                                               for c in q["ctxs"] for a in q["answers"]))
    passage = next(c["text"] for c in item["ctxs"] if any(a.lower() in c["text"].lower() for a in item["answers"]))
    t = time.perf_counter()
    model = load_model(settings.model, settings.home, settings.device, settings.dtype)
    runner = Runner(model)
    print(f"model {model.name} ({model.dtype}, {model.device}) loaded in {time.perf_counter() - t:.1f}s")
    tok = model.tokenizer
    frame = chat_frame(tok, settings.system_prompt)
    ids = frame.head + encode(tok, passage + "\n\nQuestion: " + item["question"]) + frame.tail
    t = time.perf_counter()
    pre = runner.prefill(as_ids(ids))
    cache = runner.new_cache(len(ids) + settings.max_new_tokens)
    cache.k[:, :, : len(ids)], cache.v[:, :, : len(ids)] = pre.k, pre.v
    cache.length = len(ids)
    ttft = time.perf_counter() - t
    answer = decode(runner, cache, pre.logits, Sampling(settings.max_new_tokens), stop_token_ids(tok, model.config))
    print(f"question: {item['question']}  (gold: {item['answers'][0]})")
    print(f"answer:   {tok.decode(answer).strip()}")
    print(f"prompt {len(ids)} tokens, TTFT {ttft * 1000:.0f} ms (full prefill)")
    return 0
