"""The compiled code of `cpu_int8`: `quantize_rows` and `quantize_all`, the int8 cache's write (`write_rows`: at a step's
addresses), and the attention: `attend`, the parallel driver, and its loops over one block of keys of one K/V head, written so LLVM vectorizes them: widen eight int8 rows into float32 once,
then reuse each loaded query (scores) or accumulator (values) eight times; the softmax's max in 16 lanes
and its exp into a buffer of its own (in place, LLVM's overlap check runs the scalar loop). One file for
all of it: numba's on-disk cache keys a function by its own file, so a driver cached in another file
would keep running the loops it was compiled with after they change. Scratch timings on one core,
2,475 keys, 3 query heads a K/V head, on an AVX-512 Intel host: scores 32 µs, softmax 32 → 10 µs, values
28 µs, `attend` for one sequence's layer (3 K/V heads) 299 → 229 µs; the same layer through
`varlen_attention` on a Zen 5 host 188 → 150 µs.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

U = 8  # rows widened at once
_EXACT = {"nnan", "ninf", "nsz", "contract", "afn"}  # fastmath without reassociation: Cody-Waite stays exact


@numba.njit(inline="always")
def widen(src, t, x):  # pragma: no cover — compiled
    """x (U, hd) f32 = src[t:t+U] (int8 rows)."""
    for u in range(U):
        for d in range(x.shape[1]):
            x[u, d] = src[t + u, d]


@numba.njit(fastmath=True, cache=True)
def scores(qs, k, ks, a, b, s):  # pragma: no cover — compiled
    """s (g, b-a) = (qs (g, hd) · k[a:b] widened) · ks[a:b]; k (T, hd) int8, ks (T,) f32."""
    hd = k.shape[1]
    x = np.empty((U, hd), dtype=np.float32)
    t = a
    while t + U <= b:
        widen(k, t, x)
        for i in range(qs.shape[0]):
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0)
            for d in range(hd):
                qd = qs[i, d]
                a0 += qd * x[0, d]
                a1 += qd * x[1, d]
                a2 += qd * x[2, d]
                a3 += qd * x[3, d]
                a4 += qd * x[4, d]
                a5 += qd * x[5, d]
                a6 += qd * x[6, d]
                a7 += qd * x[7, d]
            c = t - a
            s[i, c], s[i, c + 1], s[i, c + 2], s[i, c + 3] = a0 * ks[t], a1 * ks[t + 1], a2 * ks[t + 2], a3 * ks[t + 3]
            s[i, c + 4], s[i, c + 5], s[i, c + 6], s[i, c + 7] = (a4 * ks[t + 4], a5 * ks[t + 5], a6 * ks[t + 6],
                                                                  a7 * ks[t + 7])
        t += U
    for t in range(t, b):
        for i in range(qs.shape[0]):
            dot = np.float32(0)
            for d in range(hd):
                dot += qs[i, d] * np.float32(k[t, d])
            s[i, t - a] = dot * ks[t]


@numba.njit(fastmath=_EXACT, cache=True)
def exp_into(x, out, bits):  # pragma: no cover — compiled
    """out = exp(x) for x ≤ 0, in loops LLVM vectorizes: 2^n · p(r), r = x − n·ln 2 split in two
    (Cody-Waite), p of degree 7; relative error ~1e-7 above −87, below which it flushes to 2^−126.
    bits: int32 scratch of x's length. out must not be x: LLVM checks the arrays for overlap and runs an
    aliased call in its scalar loop (2,475 values: 7.3 µs in place, 1.2 µs apart)."""
    for t in range(x.shape[0]):
        y = max(x[t], np.float32(-87.0))
        n = np.floor(y * np.float32(1.4426950408889634) + np.float32(0.5))
        r = (y - n * np.float32(0.693359375)) + n * np.float32(2.12194440e-4)
        p = np.float32(1.0 / 5040)
        p = p * r + np.float32(1.0 / 720)
        p = p * r + np.float32(1.0 / 120)
        p = p * r + np.float32(1.0 / 24)
        p = p * r + np.float32(1.0 / 6)
        p = p * r + np.float32(0.5)
        p = p * r + np.float32(1.0)
        out[t] = p * r + np.float32(1.0)
        bits[t] = (np.int32(n) + np.int32(127)) << np.int32(23)
    two = bits.view(np.float32)
    for t in range(x.shape[0]):
        out[t] *= two[t]


@intrinsic
def _as_float32(typingctx, bits):
    """int32 bits → the float32 they spell."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@numba.njit(inline="always")
def _amax(x):  # pragma: no cover — compiled
    """max |x| of x (hd,) f32 (not NaN), as the largest of the magnitudes' bits: an integer max vectorizes, a
    float one did not (LLVM kept its NaN order), and non-negative floats order as their bits do."""
    bits = x.view(np.int32)
    top = 0
    for d in range(bits.shape[0]):
        top = max(top, bits[d] & 0x7FFFFFFF)
    return _as_float32(np.int32(top))


@numba.njit(fastmath={"nnan", "ninf", "nsz"}, cache=True)  # exact arithmetic: x / step rounds as torch's division
def _quantize_row(x, q):  # pragma: no cover — compiled
    """x (hd,) f32 → q (hd,) int8 and its scale, exactly as `reference.quantize_int8`: scale amax / 127, q the
    nearest (ties to even) of x / max(scale, 1e-30) in ±127."""
    scale = _amax(x) / np.float32(127)
    step = max(scale, np.float32(1e-30))
    for d in range(x.shape[0]):
        q[d] = np.int8(min(max(np.rint(x[d] / step), np.float32(-127)), np.float32(127)))
    return scale


@numba.njit(cache=True)
def quantize_rows(x, q, s, first):  # pragma: no cover — compiled
    """x (n, Hkv, hd) f32 → rows first.. of q (Hkv, capacity, hd) int8 and s (Hkv, capacity) f32 (`_quantize_row`)."""
    n, hkv, hd = x.shape
    for r in range(n):
        for j in range(hkv):
            s[j, first + r] = _quantize_row(x[r, j], q[j, first + r])


@numba.njit(parallel=True, cache=True)
def quantize_all(x, q, s, n):  # pragma: no cover — compiled
    """Rows 0..n of x (L, Hkv, capacity, hd) f32 → of q (L, Hkv, capacity, hd) int8 and s (L, Hkv, capacity) f32
    (`_quantize_row`), each contiguous: a whole cache in one pass (torch took six over it), layers in parallel."""
    for l in numba.prange(x.shape[0]):
        for j in range(x.shape[1]):
            for t in range(n):
                s[l, j, t] = _quantize_row(x[l, j, t], q[l, j, t])


@numba.njit(fastmath=True, inline="always")
def row_max(x):  # pragma: no cover — compiled
    """max of x (n,) f32, finite, in 16 lanes: `x.max()` compiles to a scalar loop (3.2 against 0.7 µs for 2,475)."""
    lanes = np.full(16, -np.inf, dtype=np.float32)
    t = 0
    while t + 16 <= x.shape[0]:
        for u in range(16):
            lanes[u] = max(lanes[u], x[t + u])
        t += 16
    top = lanes.max()
    for t in range(t, x.shape[0]):
        top = max(top, x[t])
    return top


@numba.njit(fastmath=True, cache=True)
def softmax(p, vs, a, m, l):  # pragma: no cover — compiled
    """p (g, keys) scores of keys a.. → exp(p − m) · vs[a + t], with m (g,) the row maxima and l (g,) the sums
    of the exps (before vs)."""
    bits = np.empty(p.shape[1], dtype=np.int32)
    e = np.empty(p.shape[1], dtype=np.float32)
    for i in range(p.shape[0]):
        row = p[i]
        m[i] = row_max(row)
        for t in range(row.shape[0]):
            row[t] -= m[i]
        exp_into(row, e, bits)
        total = np.float32(0)
        for t in range(row.shape[0]):
            total += e[t]
            row[t] = e[t] * vs[a + t]
        l[i] = total


@numba.njit(fastmath=True, cache=True)
def weigh(p, v, a, b, o):  # pragma: no cover — compiled
    """o (g, hd) += p (g, b-a) · v[a:b] widened; v (T, hd) int8."""
    hd = v.shape[1]
    x = np.empty((U, hd), dtype=np.float32)
    t = a
    while t + U <= b:
        widen(v, t, x)
        c = t - a
        for i in range(p.shape[0]):
            w0, w1, w2, w3 = p[i, c], p[i, c + 1], p[i, c + 2], p[i, c + 3]
            w4, w5, w6, w7 = p[i, c + 4], p[i, c + 5], p[i, c + 6], p[i, c + 7]
            for d in range(hd):
                o[i, d] += (w0 * x[0, d] + w1 * x[1, d] + w2 * x[2, d] + w3 * x[3, d]
                            + w4 * x[4, d] + w5 * x[5, d] + w6 * x[6, d] + w7 * x[7, d])
        t += U
    for t in range(t, b):
        for i in range(p.shape[0]):
            w = p[i, t - a]
            for d in range(hd):
                o[i, d] += w * np.float32(v[t, d])


@numba.njit(fastmath=True, cache=True)
def merge(m, l, acc, out):  # pragma: no cover — compiled
    """Blocks' partial results m, l (blocks, g), acc (blocks, g, hd) → out (g, hd), weighted by exp(m − max)."""
    for i in range(out.shape[0]):
        top = m[:, i].max()
        total = np.float32(0)
        o = np.zeros(out.shape[1], dtype=np.float32)
        for c in range(m.shape[0]):
            if l[c, i] > 0:
                w = np.exp(m[c, i] - top)
                total += w * l[c, i]
                o += w * acc[c, i]
        out[i] = o / total


@intrinsic
def _pointer(typingctx, address):
    """An int64 address as a void pointer, for `numba.carray` (a sequence's cache is its own allocation)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(types.int64), codegen


@numba.njit(parallel=True, fastmath=True, cache=True)
def attend(q, seq, pos, addresses, capacity, hkv, scale, out, block):  # pragma: no cover — compiled
    """q (n, H, hd) f32, row r of sequence seq[r] at position pos[r]; addresses (S, 4) int64 of sequence s's
    K, V (Hkv, capacity[s], hd) int8 and K, V scales (Hkv, capacity[s]) f32 → out (n, H, hd) f32.
    A row reads keys 0..pos[r] of its sequence's layer, never past."""
    n, h, hd = q.shape
    g = h // hkv
    first = np.zeros(n + 1, dtype=np.int64)  # row r's blocks are tasks first[r] .. first[r+1]
    for r in range(n):
        first[r + 1] = first[r] + (pos[r] + block) // block
    row = np.empty(first[n], dtype=np.int64)
    for r in range(n):
        row[first[r]:first[r + 1]] = r
    m = np.full((first[n], hkv, g), -np.inf, dtype=np.float32)
    l = np.zeros((first[n], hkv, g), dtype=np.float32)
    acc = np.zeros((first[n], hkv, g, hd), dtype=np.float32)
    for u in numba.prange(first[n] * hkv):
        task, j = u // hkv, u % hkv
        r = row[task]
        a = (task - first[r]) * block
        b = min(a + block, pos[r] + 1)
        s, cap = seq[r], capacity[seq[r]]
        k = numba.carray(_pointer(addresses[s, 0]), (hkv, cap, hd), np.int8)[j]
        v = numba.carray(_pointer(addresses[s, 1]), (hkv, cap, hd), np.int8)[j]
        ks = numba.carray(_pointer(addresses[s, 2]), (hkv, cap), np.float32)[j]
        vs = numba.carray(_pointer(addresses[s, 3]), (hkv, cap), np.float32)[j]
        p = np.empty((g, b - a), dtype=np.float32)  # (g, keys): scores, then weights
        scores(q[r, j * g:(j + 1) * g] * np.float32(scale), k, ks, a, b, p)
        softmax(p, vs, a, m[task, j], l[task, j])
        weigh(p, v, a, b, acc[task, j])
    for u in numba.prange(n * hkv):
        r, j = u // hkv, u % hkv
        merge(m[first[r]:first[r + 1], j], l[first[r]:first[r + 1], j], acc[first[r]:first[r + 1], j],
              out[r, j * g:(j + 1) * g])


@numba.njit(cache=True)
def write_rows(k, v, seq, pos, addresses, capacity, hkv):  # pragma: no cover — compiled
    """k, v (n, Hkv, hd) f32: row r's K and V quantized (as `quantize_rows`) into position pos[r] of sequence
    seq[r]'s layer at addresses (S, 4) (`attend`'s)."""
    hd = k.shape[2]
    for r in range(k.shape[0]):
        s, cap = seq[r], capacity[seq[r]]
        for x, a in ((k, 0), (v, 1)):
            q = numba.carray(_pointer(addresses[s, a]), (hkv, cap, hd), np.int8)
            scale = numba.carray(_pointer(addresses[s, a + 2]), (hkv, cap), np.float32)
            quantize_rows(x[r:r + 1], q, scale, pos[r])
