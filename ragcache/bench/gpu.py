"""`make gpu-check`: one command that answers, on a borrowed CUDA machine, whether the product runs
there and how fast. It needs only torch, triton, transformers, xxhash and pytest (what such a
machine already has), never a package registry, a checkpoint or the server stack.

    1. the Triton kernel tests, natively (on a CPU: under TRITON_INTERPRET=1)
    2. exactness gates in float32 and bfloat16 on a small random Llama: 100% recompute = prefill,
       batched decode = each alone, batched recompute = each alone
    3. each kernel's achieved bandwidth against the H200's ~4.8 TB/s           (CUDA only)
    4. `bench blend` on a random Llama-3-8B-shaped model, bf16, 8K tokens in 16 chunks   (CUDA only)
    5. `bench serve` on it: the scheduler's steps in process, N = 1..64         (CUDA only)
    6. the compact KV codec's decode into CUDA tensors, 8B-shaped chunk    (CUDA only; needs zstandard)
then one summary table. On a machine without CUDA it stops after step 2 and says so.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from blend import CacheBlend, Epic, Full, Reuse, Runner, compute_chunk, compute_prefix, fuse_and_prefill
from blend.batch import decode_batch, fuse_batch

from .gpu_codec import codec_rows
from .gpu_speed import bandwidth_rows, serve_rows
from .random_model import LLAMA3_8B, SMALL_LLAMA, params, random_llama
from .timing import median, table

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # |Δlogits| / max|logits|


def main() -> int:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name() if cuda else "no CUDA device"
    print(f"gpu-check: {name}; torch {torch.__version__}; python {sys.version.split()[0]}", flush=True)
    summary = [["kernel tests", *_kernel_tests(cuda)]]
    for dtype in (torch.float32, torch.bfloat16) if cuda else (torch.float32,):
        summary += _gates(dev, dtype)
    if not cuda:
        for step in ("gates bfloat16 (the CPU runner computes in float32)", "kernel bandwidth",
                     "bench blend (8B-shaped, bf16, 8K tokens)", "bench serve (N up to 64)", "codec decode on CUDA"):
            summary.append([step, "not run", "CUDA required from here on"])
        print("\n" + table(summary, ["check", "result", "detail"]))
        print("\nStopped where CUDA is required: steps 3-6 need a GPU (run `make gpu-check` on one).")
        return 0 if all(r[1] == "pass" for r in summary[:-5]) else 1
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.perf_counter()
    print("\nkernel bandwidth (bf16, Llama-3-8B shapes)\n" + table(*bandwidth_rows()), flush=True)
    model = random_llama(LLAMA3_8B, dev, torch.bfloat16)
    runner = Runner(model)
    print(f"\nrandom Llama-3-8B-shaped model: {params(model) / 1e9:.2f} B parameters, bf16, built in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    blend_text, blend_summary = _blend(runner)
    print(blend_text, flush=True)
    summary += blend_summary
    serve_text, serve_summary = serve_rows(runner, _requests(runner, 64, 4, 512), [1, 4, 8, 16, 32, 64])
    print(serve_text, flush=True)
    summary += serve_summary
    codec_text, codec_summary = codec_rows()
    print(codec_text, flush=True)
    summary += codec_summary
    print("\nSUMMARY\n" + table(summary, ["check", "result", "detail"]))
    return 0 if all(r[1] != "FAIL" for r in summary) else 1


def _kernel_tests(cuda: bool) -> list[str]:
    env = {**os.environ, **({} if cuda else {"TRITON_INTERPRET": "1"})}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider",
                        "tests/blend/test_kernels.py"], env=env, capture_output=True, text=True)
    last = (r.stdout.strip().splitlines() or ["no output"])[-1]
    print(f"\nkernel tests ({'native' if cuda else 'TRITON_INTERPRET=1'}): {last}", flush=True)
    if r.returncode:
        print(r.stdout[-4000:], r.stderr[-2000:])
    return ["pass" if r.returncode == 0 else "FAIL", last + ("" if cuda else " (interpreter)")]


def _ids(runner: Runner, n: int, seed: int) -> torch.Tensor:
    return torch.randint(4, runner.embed.shape[0], (n,), generator=torch.Generator().manual_seed(seed))


def _requests(runner: Runner, n: int, chunks: int, chunk_tokens: int) -> list[tuple]:
    """n (prefix, chunk KVs, suffix) of random tokens, chunks computed behind a 32-token prefix."""
    prefix = compute_prefix(runner, _ids(runner, 32, 0))
    pool = [compute_chunk(runner, _ids(runner, chunk_tokens, 100 + i), prefix) for i in range(max(chunks, 16))]
    return [(prefix, [pool[(r + c) % len(pool)] for c in range(chunks)], _ids(runner, 32, 1000 + r))
            for r in range(n)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _gates(dev: torch.device, dtype: torch.dtype) -> list[list]:
    runner = Runner(random_llama(SMALL_LLAMA, dev, dtype, std=0.08))
    label, tol = str(dtype).removeprefix("torch."), TOL[dtype]
    reqs = _requests(runner, 3, 3, 48)
    errs = {}
    full = fuse_and_prefill(runner, *reqs[0], CacheBlend(1.0))
    errs["100% recompute = prefill"] = _rel(full.logits, runner.prefill(full.token_ids).logits)
    runner.release(full.cache)
    args = [(p, c, s, pol, 8) for (p, c, s), pol in zip(reqs, (CacheBlend(0.15), Epic(8), Reuse()))]
    batched, alone = fuse_batch(runner, args), [fuse_and_prefill(runner, *a) for a in args]
    errs["batched recompute = alone"] = max(_rel(b.logits, a.logits) for b, a in zip(batched, alone))
    worst = 0.0
    for _ in range(4):
        tokens = [int(a.logits.argmax()) for a in alone]
        both = decode_batch(runner, [b.cache for b in batched], tokens)
        for i, a in enumerate(alone):
            a.logits = decode_batch(runner, [a.cache], [tokens[i]])[0]
            worst = max(worst, _rel(both[i], a.logits))
    errs["batched decode = alone"] = worst
    for r in batched + alone:
        runner.release(r.cache)
    rows = [[f"gate {label}: {k}", "pass" if e <= tol else "FAIL", f"max abs(Δ) / max abs(ref) {e:.2e} (tol {tol:g})"]
            for k, e in errs.items()]
    for r in rows:
        print(" ".join(r), flush=True)
    return rows


def _blend(runner: Runner) -> tuple[str, list[list]]:
    """TTFT of each mode against full prefill at 8K tokens (16 chunks of 512), medians of 3."""
    (prefix, chunks, suffix), = _requests(runner, 1, 16, 512)
    modes = {"full": Full(), "reuse": Reuse(), "epic@16": Epic(16), "cacheblend@0.15": CacheBlend(0.15)}
    times = {m: [] for m in modes}
    for r in range(4):
        for m, policy in modes.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            res = fuse_and_prefill(runner, prefix, chunks, suffix, policy)
            int(res.logits.argmax())
            if r:
                times[m].append(time.perf_counter() - t)
            total = res.layout.total
            runner.release(res.cache)
    full = median(times["full"])
    rows = [[m, median(ts) * 1000, full / median(ts)] for m, ts in times.items()]
    text = f"\nbench blend: {total} tokens, 16 chunks, bf16, median of 3\n" + table(rows, ["mode", "TTFT ms",
                                                                                       "speedup vs full"])
    return text, [[f"blend TTFT {m}", "measured", f"{ms:.1f} ms, {sp:.2f}x vs full"] for m, ms, sp in rows]


if __name__ == "__main__":
    sys.exit(main())
