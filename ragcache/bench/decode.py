"""`ragcache bench decode`: one sequence's per-token decode at ~2.5K tokens of context, for each decode
weights × serving-KV precision, beside llama.cpp's `llama-bench` on the same SmolLM2 GGUF with as many
threads, interleaved in one run (llama.cpp when a `llama-bench` is found; the output says when it is not).
Then whether the faster decode still answers as float32 does: greedy answers on dev questions, and
where one differs, float32's logit margin (best − second best) at the first differing token.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import time
from pathlib import Path

import torch

from blend import Full, KVCache, Runner, compute_prefix, fuse_and_prefill, load_model
from blend.batch import Rows, forward_batch
from blend.linear import make_weights
from blend.model import bundled_gguf
from blend.prompt import as_ids, chat_frame, encode

from ..evaluation.evaluate import load_dataset
from .timing import median, table

KV = {"float32": torch.float32, "int8": torch.int8}
STEPS = 8  # decode steps per timing
LLAMA = "llama.cpp llama-bench (Q4_1 weights, f16 KV)"


def run(settings, args) -> int:
    data = load_dataset(Path(args.dataset), None)
    model = load_model(settings.model, settings.home, settings.device, settings.dtype)
    runner = Runner(model, "float16")  # runner.w: the model's float32 matrices; runner.decode_w: float16
    weights = {"float32": runner.w, "float16": runner.decode_w,
               **{kind: make_weights(model.state, runner.num_layers, kind) for kind in ("int8", "int4")}}
    weights["int4 layer-by-layer"] = dataclasses.replace(weights["int4"], stack=None)  # the one-call step's A/B
    threads = torch.get_num_threads()
    with torch.inference_mode():
        prefix = compute_prefix(runner, as_ids(chat_frame(model.tokenizer, settings.system_prompt).head))
        fused = [_prompt(runner, prefix, data[i], settings.system_prompt) for i in range(args.limit)]
        context = fused[0].cache.length
        steps = {f"ragcache, {w} weights, {kv} KV": _steps(runner, fused[0].cache, weights[w], KV[kv])
                 for w in weights for kv in KV}
        llama = _llama_bench(args.llama_bench, threads, context)
        times = _interleaved(steps, llama, args.repeats)
    base = median(times["ragcache, float32 weights, float32 KV"])
    rows = [[name, median(t) * 1000, base / median(t), _bytes(name, weights, runner, context)]
            for name, t in times.items()]
    print(f"model {model.name} {model.dtype}, {threads} threads, one sequence, {context} tokens of context "
          f"(question 0, 4 passages), median of {args.repeats} interleaved repeats of {STEPS} steps")
    if llama is None:
        print("llama.cpp: no llama-bench found (--llama-bench PATH, or on PATH): its row is missing")
    print(table(rows, ["decode", "ms/token", "speed vs float32", "MB a step reads"]))
    with torch.inference_mode():
        print(_answers(runner, fused, weights, args.new_tokens))
    return 0


def _prompt(runner: Runner, prefix, item: dict, system_prompt: str):
    """A question's 4 passages and the question, fully prefilled (float32) with room to decode."""
    tok = runner.model.tokenizer
    ids = as_ids(encode(tok, "".join(c["text"] + "\n\n" for c in item["ctxs"][:4]) + "\nQuestion: "
                        + item["question"]) + chat_frame(tok, system_prompt).tail)
    return fuse_and_prefill(runner, prefix, [], ids, Full(), headroom=64)


def _steps(runner: Runner, cache, ws, kv: torch.dtype):
    """STEPS decode steps after `cache`'s prompt, on a copy of it at `kv` precision (rewritten in place each call)."""
    own = KVCache(cache.k.clone(), cache.v.clone(), cache.length).compact(kv)
    start = own.length

    def go():
        own.length, token = start, 0
        for _ in range(STEPS):
            step = Rows(own, torch.tensor([token]), torch.tensor([own.length]))
            token = int(forward_batch(runner, [step], ws)[0].logits.argmax())
    return go


def _bytes(name: str, weights: dict, runner: Runner, context: int) -> float | str:
    """What one of our steps reads: its weights and the sequence's KV."""
    if name == LLAMA:
        return ""
    w = next(ws for kind, ws in weights.items() if f"{kind} weights" in name)
    kv = KV["int8" if "int8 KV" in name else "float32"]
    row = KVCache.bytes_per_row_of(runner.num_layers, runner.num_kv_heads, runner.head_dim, kv)
    return (w.bytes + context * row) / 1e6


def _llama_bench(path: str | None, threads: int, depth: int):
    """A function that runs llama-bench once, decoding STEPS tokens after `depth` tokens of context, and
    returns its own time for those tokens (without its start-up and its prefill of the depth); None when no
    llama-bench is found."""
    exe = path or shutil.which("llama-bench")
    if exe is None or not Path(exe).is_file():
        return None
    cmd = [exe, "-m", str(bundled_gguf()), "-t", str(threads), "-p", "0", "-n", str(STEPS), "-d", str(depth),
           "-r", "1", "-o", "json"]
    return lambda: json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)[0]["avg_ns"] / 1e9


def _interleaved(ours: dict, llama, repeats: int) -> dict[str, list[float]]:
    """Seconds per token of every decode, round after round (one warm-up round first)."""
    times: dict[str, list[float]] = {name: [] for name in ours}
    if llama is not None:
        times[LLAMA] = []
    for r in range(1 + repeats):
        for name, go in ours.items():
            t = time.perf_counter()
            go()
            if r:
                times[name].append((time.perf_counter() - t) / STEPS)
        if llama is not None:
            seconds = llama()
            if r:
                times[LLAMA].append(seconds / STEPS)
    return times


def _answers(runner: Runner, fused: list, weights: dict, new_tokens: int) -> str:
    """Greedy answers of each question with every decode against float32's, and float32's margins where
    they differ."""
    rows = []
    for i, f in enumerate(fused):
        ref, margins = _greedy(runner, f, weights["float32"], torch.float32, new_tokens)
        for w, kv in (("float16", "float32"), ("float32", "int8"), ("float16", "int8"), ("int8", "float32"),
                      ("int8", "int8"), ("int4", "float32"), ("int4", "int8")):
            ids, _ = _greedy(runner, f, weights[w], KV[kv], new_tokens)
            first = next((j for j, (a, b) in enumerate(zip(ids, ref)) if a != b), None)
            rows.append([i, f"{w} weights, {kv} KV", "yes" if first is None else "no",
                         "" if first is None else first, "" if first is None else margins[first]])
    same = sum(r[2] == "yes" for r in rows)
    return (f"\ngreedy answers ({new_tokens} tokens) against float32 weights and KV, {len(fused)} dev questions: "
            f"{same} of {len(rows)} equal\n" + table([r for r in rows if r[2] == "no"] or [["-", "all", "yes", "", ""]],
                                                     ["question", "decode", "equal", "first differing token",
                                                      "float32 margin there"]))


def _greedy(runner: Runner, fused, ws, kv: torch.dtype, n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens after the fused prompt (first from its float32 logits) → ids, and each step's margin."""
    cache = KVCache(fused.cache.k.clone(), fused.cache.v.clone(), fused.cache.length).compact(kv)
    logits, ids, margins = fused.logits, [], []
    for _ in range(n):
        top = logits.topk(2).values
        ids.append(int(logits.argmax()))
        margins.append(float(top[0] - top[1]))
        step = Rows(cache, torch.tensor(ids[-1:]), torch.tensor([cache.length]))
        logits = forward_batch(runner, [step], ws)[0].logits
    return ids, margins
