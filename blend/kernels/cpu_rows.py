"""The small passes between a decode step's matrix products, over a few float32 rows on the CPU, compiled by
numba: one call each where torch ran several ops (2–5 µs of dispatch each: an RMSNorm took 13 µs a row, RoPE of
q and k 30, the int8 weights' spread and rebuild three ops a product). A compiled call costs 4–7 µs here, nearly
all of it the crossing from torch to numpy; the work on a few rows is under a microsecond. One sequence's decode
step at 2.5K tokens of context, int8 weights and KV, on a 2-core AMD EPYC: 25.1 → 20.7 ms (means of three
alternated runs, BENCHMARKS.md).

Each is row by row, so a row's result never depends on the other rows of a batch. `rope_split` is bit for bit
`reference.apply_rope` (no fastmath: no contraction into FMAs, the same products and sums); the others agree with
their torch versions to float32 rounding (their sums run in another order). `reference.rms_norm` and friends
are the oracles.
"""
from __future__ import annotations

import numba
import numpy as np
import torch


@numba.njit(cache=True)
def _rms(x, w, eps, r, out):  # pragma: no cover — compiled
    """out (d,) = w · x[r] / sqrt(mean(x[r]²) + eps), as `reference.rms_norm` in float32."""
    d = x.shape[1]
    total = np.float32(0)
    for c in range(d):
        total += x[r, c] * x[r, c]
    inv = np.float32(1) / np.sqrt(total / np.float32(d) + np.float32(eps))
    for c in range(d):
        out[c] = w[c] * (x[r, c] * inv)


@numba.njit(cache=True)
def norm_rows(x, w, eps):  # pragma: no cover — compiled
    """x (n, d), w (d,) f32 → RMSNorm of each row (n, d)."""
    out = np.empty(x.shape, dtype=np.float32)
    for r in range(x.shape[0]):
        _rms(x, w, eps, r, out[r])
    return out


@numba.njit(cache=True)
def _spread_row(x, out, ends, r):  # pragma: no cover — compiled
    """out[r] = (x − low) / span of the row x (d,); ends[:, r, 0] = (low, span); span 1 for a constant row.
    No fastmath: a row's largest value must map to exactly 1."""
    lo, hi = x[0], x[0]
    for c in range(x.shape[0]):
        lo, hi = min(lo, x[c]), max(hi, x[c])
    width = hi - lo if hi > lo else np.float32(1)
    ends[0, r, 0], ends[1, r, 0] = lo, width
    for c in range(x.shape[0]):
        out[r, c] = (x[c] - lo) / width


@numba.njit(cache=True)
def spread_rows(x):  # pragma: no cover — compiled
    """x (n, d) f32 → (out (n, d) f32, each row mapped onto [0, 1]: (x − low) / span; ends (2, n, 1) f32:
    low, each row's least value, and span, its largest less that (1 where the row is constant)). Allocated
    here: three torch.empty and four .numpy() cost 6 µs a call, the pass itself 0.7."""
    n, d = x.shape
    out, ends = np.empty((n, d), dtype=np.float32), np.empty((2, n, 1), dtype=np.float32)
    for r in range(n):
        _spread_row(x[r], out, ends, r)
    return out, ends


@numba.njit(cache=True)
def norm_spread(x, w, eps):  # pragma: no cover — compiled
    """`spread_rows(norm_rows(x, w, eps))` in one pass over each row."""
    n, d = x.shape
    out, ends = np.empty((n, d), dtype=np.float32), np.empty((2, n, 1), dtype=np.float32)
    h = np.empty(d, dtype=np.float32)
    for r in range(n):
        _rms(x, w, eps, r, h)
        _spread_row(h, out, ends, r)
    return out, ends


@numba.njit(cache=True)
def _silu_mul(gu, r, out):  # pragma: no cover — compiled
    """out (i,) = silu(gate) · up of row r of gu (n, 2·i), gate its first half."""
    half = gu.shape[1] // 2
    for c in range(half):
        g = gu[r, c]
        out[c] = g / (np.float32(1) + np.exp(-g)) * gu[r, half + c]


@numba.njit(cache=True)
def silu_mul_spread(gu):  # pragma: no cover — compiled
    """`spread_rows(silu_mul(gu))` in one pass over each row."""
    n, half = gu.shape[0], gu.shape[1] // 2
    out, ends = np.empty((n, half), dtype=np.float32), np.empty((2, n, 1), dtype=np.float32)
    h = np.empty(half, dtype=np.float32)
    for r in range(n):
        _silu_mul(gu, r, h)
        _spread_row(h, out, ends, r)
    return out, ends


@numba.njit(cache=True)
def unspread_(y, ends, sums):  # pragma: no cover — compiled
    """y (n, out) ← span · y + low · sums: W·x rebuilt from W·u, x = low + span · u; ends (2, n, 1), sums (1, out)."""
    for r in range(y.shape[0]):
        lo, span = ends[0, r, 0], ends[1, r, 0]
        for c in range(y.shape[1]):
            y[r, c] = y[r, c] * span + lo * sums[0, c]


@numba.njit(cache=True)
def rope_split(qkv, cos, sin, h, hkv):  # pragma: no cover — compiled
    """qkv (n, (h + 2·hkv)·hd) f32, cos/sin (n, 1, hd) → q (n, h, hd), k (n, hkv, hd) rotated, v (n, hkv, hd):
    x·cos + rotate_half(x)·sin, each product and sum as torch's ops make them."""
    n = qkv.shape[0]
    hd = cos.shape[2]
    half = hd // 2
    q = np.empty((n, h, hd), dtype=np.float32)
    k = np.empty((n, hkv, hd), dtype=np.float32)
    v = np.empty((n, hkv, hd), dtype=np.float32)
    for r in range(n):
        for j in range(h + hkv):
            dst = q[r, j] if j < h else k[r, j - h]
            base = j * hd
            for d in range(half):
                x1, x2 = qkv[r, base + d], qkv[r, base + half + d]
                dst[d] = x1 * cos[r, 0, d] + -x2 * sin[r, 0, d]
                dst[half + d] = x2 * cos[r, 0, half + d] + x1 * sin[r, 0, half + d]
        for j in range(hkv):
            base = (h + hkv + j) * hd
            for d in range(hd):
                v[r, j, d] = qkv[r, base + d]
    return q, k, v


def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int):
    """qkv (n, (H + 2·Hkv)·hd), cos/sin (n, 1, hd) → q (n, H, hd), k (n, Hkv, hd) post-RoPE, v (n, Hkv, hd)."""
    q, k, v = rope_split(qkv.contiguous().numpy(), cos.contiguous().numpy(), sin.contiguous().numpy(), heads, kv_heads)
    return torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v)


def spread(x: torch.Tensor, fn=spread_rows, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """`fn(x, *args)` (a spreading pass) → (out, ends) as tensors."""
    out, ends = fn(x.contiguous().numpy(), *args)
    return torch.from_numpy(out), torch.from_numpy(ends)
