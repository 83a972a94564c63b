"""The CUDA-only measurements of `make gpu-check`: each Triton kernel's achieved bandwidth, and the
serving loop's throughput per number of concurrent requests, in process."""
from __future__ import annotations

import time

import torch

from blend import CacheBlend, Reuse, Runner
from blend.batch import decode_batch, fuse_batch
from blend.kernels import triton_ops, triton_varlen
from blend.rope import delta_cos_sin

from .timing import median, table

PEAK_TBS = 4.8  # H200 HBM3e


def _cuda_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return median(times)


def bandwidth_rows() -> tuple[list[list], list[str]]:
    """(rows, header): bytes each kernel must move at Llama-3-8B shapes (bf16), its time, TB/s, share of peak."""
    dev, bf = torch.device("cuda"), torch.bfloat16
    hkv, hd, cases = 8, 128, []
    src = torch.randn(32 * hkv, 512, hd, device=dev, dtype=bf)  # one 512-token chunk, every layer
    dst = torch.empty_like(src)
    cos, sin = (t.to(dev) for t in delta_cos_sin(torch.full((512,), 4096), 1.0 / (500000 ** (torch.arange(0, hd, 2) / hd))))
    cases.append(("realign_rope_ (chunk of 512, 32 layers)", 2 * src.numel() * 2, lambda: triton_ops.realign_rope_(dst, cos, sin, src)))
    cache = torch.randn(hkv, 8192, hd, device=dev, dtype=bf)
    rows = torch.randperm(8192, device=dev)[:2048].sort().values
    new = torch.randn(2048, hkv, hd, device=dev, dtype=bf)
    cases.append(("deviation_scatter_ (2048 of 8192 rows)", 3 * new.numel() * 2,
                  lambda: triton_ops.deviation_scatter_(cache, rows, new)))
    k, v = torch.randn(hkv, 8192, hd, device=dev, dtype=bf), torch.randn(hkv, 8192, hd, device=dev, dtype=bf)
    q, pos = torch.randn(16, 32, hd, device=dev, dtype=bf), torch.arange(8176, 8192, device=dev)
    cases.append(("selected_attention (16 rows over 8K keys)", 2 * k.numel() * 2,
                  lambda: triton_ops.selected_attention(q, k, v, pos, hd**-0.5)))
    ks = [torch.randn(hkv, 2112, hd, device=dev, dtype=bf)[:, :2048] for _ in range(64)]
    vs = [torch.randn(hkv, 2112, hd, device=dev, dtype=bf)[:, :2048] for _ in range(64)]
    qd, posd = torch.randn(64, 32, hd, device=dev, dtype=bf), torch.full((64,), 2047, device=dev)
    cu = list(range(65))
    cases.append(("varlen_attention (decode: 64 seqs x 2K keys)", 64 * 2 * ks[0].numel() * 2,
                  lambda: triton_varlen.varlen_attention(qd, ks, vs, posd, cu, hd**-0.5)))
    qi = torch.randint(-127, 128, (256, 8192, hd), device=dev, dtype=torch.int8)
    scale = torch.rand(256, 8192, device=dev)
    cases.append(("dequantize_int8 (8K tokens, 32 layers)", qi.numel() * 3 + scale.numel() * 4,
                  lambda: triton_ops.dequantize_int8(qi, scale, bf)))
    out = []
    for name, nbytes, fn in cases:
        ms = _cuda_ms(fn)
        tbs = nbytes / ms / 1e9
        out.append([name, nbytes / 1e6, ms, tbs, tbs / PEAK_TBS])
    return out, ["kernel", "MB moved", "ms", "TB/s", f"of {PEAK_TBS} TB/s"]


def _serve_once(runner: Runner, reqs: list[tuple], policy, new_tokens: int, max_step_rows: int) -> dict:
    """All requests arrive at once; the scheduler's steps: a batched prefill of what fits the row cap,
    then one batched decode step of everything running, until each has `new_tokens` tokens."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pending, running, ttft = list(reqs), [], []
    while pending or running:
        batch, rows = [], 0
        while pending and (not batch or rows + _rows(runner, pending[0], policy) <= max_step_rows):
            rows += _rows(runner, pending[0], policy)
            batch.append(pending.pop(0))
        if batch:
            for f in fuse_batch(runner, [(p, c, s, policy, new_tokens) for p, c, s in batch]):
                int(f.logits.argmax())
                ttft.append(time.perf_counter() - t0)
                running.append([f.cache, f.logits, 0])
        for seq in running:
            seq[2] += 1
        for seq in [s for s in running if s[2] == new_tokens]:
            runner.release(seq[0])
        running = [s for s in running if s[2] < new_tokens]
        if running:
            tokens = torch.stack([s[1] for s in running]).argmax(-1).tolist()  # one sync for the batch
            logits = decode_batch(runner, [s[0] for s in running], tokens)
            for i, s in enumerate(running):
                s[1] = logits[i]
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"wall": wall, "tokens": len(reqs) * new_tokens, "ttft": sorted(ttft)}


def _rows(runner: Runner, req: tuple, policy) -> int:
    from blend.fuse import layout_of

    prefix, chunks, suffix = req
    return int(policy.plan(layout_of(prefix, chunks, suffix.numel()), runner.num_layers).recompute_rows)


def serve_rows(runner: Runner, reqs: list[tuple], sizes: list[int], new_tokens: int = 64,
               max_step_rows: int = 65536) -> tuple[str, list[list]]:
    modes = {"reuse": Reuse(), "cacheblend@0.15": CacheBlend(0.15)}
    _serve_once(runner, reqs[:2], Reuse(), 4, max_step_rows)  # warm
    runs = {(m, n): _serve_once(runner, reqs[:n], p, new_tokens, max_step_rows) for m, p in modes.items() for n in sizes}
    rows, summary = [], []
    for (m, n), r in runs.items():
        one = runs[(m, 1)]
        rate, ratio = r["tokens"] / r["wall"], (r["tokens"] / r["wall"]) / (one["tokens"] / one["wall"])
        bound = ""
        if m != "reuse":
            recompute, decode = one["ttft"][0], one["wall"] - one["ttft"][0]
            bound = (recompute + decode) / (recompute + runs[("reuse", n)]["wall"] / n)
        p = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1000  # noqa: E731
        rows.append([m, n, rate, ratio, bound, p(r["ttft"], .5), p(r["ttft"], .99), r["wall"]])
        summary.append([f"serve {m} N={n}", "measured", f"{rate:.0f} tok/s, {ratio:.2f}x vs N=1"
                        + (f", bound {bound:.2f}x" if bound else "")])
    ctx = _rows(runner, reqs[0], CacheBlend(1.0)) + len(reqs[0][0])
    text = (f"\nbench serve (in process: the scheduler's steps without HTTP), ~{ctx} tokens of context, "
            f"{new_tokens} new tokens each, all N arriving at once\n" +
            table(rows, ["mode", "N", "tokens/s", "vs N=1", "bound", "TTFT p50 ms", "TTFT p99 ms", "wall s"]))
    return text, summary
