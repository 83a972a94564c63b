"""The compact codec's last stages on the CPU, compiled by numba: a frame's byte scales to floats, packed
symbols to float32 in one pass, and the rounding noise the decoder reports.

Each byte holds two symbols (channel j low, channel j + hd/2 high); a symbol q becomes q · step + lo of
its group: per (head, token) for V, per (head, block of tokens, channel) for K. Torch needed five passes
over the output for the same (two masked copies, a multiply, an add, the packed bytes' own copy); this
writes each float once from the bytes zstd returned.
"""
from __future__ import annotations

import numba
import numpy as np


@numba.njit(fastmath=True, cache=True)
def per_token(packed, lo, step, out):  # pragma: no cover — compiled
    """packed (H, n, hd/2) uint8; lo, step (H, n) float32 → out (H, n, hd) float32."""
    h, n, half = packed.shape
    for i in range(h):
        for t in range(n):
            a, s, src, low, high = lo[i, t], step[i, t], packed[i, t], out[i, t, :half], out[i, t, half:]
            for j in range(half):  # one simple loop a half row: it vectorizes (3× the speed of one loop for both)
                low[j] = np.float32(src[j] & 15) * s + a
            for j in range(half):
                high[j] = np.float32(src[j] >> 4) * s + a


@numba.njit(fastmath=True, cache=True)
def per_channel(packed, lo, step, group, out):  # pragma: no cover — compiled
    """packed (H, n, hd/2) uint8; lo, step (H, blocks, hd) float32, one block a `group` tokens (the last one
    shorter) → out (H, n, hd) float32."""
    h, n, half = packed.shape
    for i in range(h):
        for c in range(lo.shape[1]):
            s_low, s_high, a_low, a_high = step[i, c, :half], step[i, c, half:], lo[i, c, :half], lo[i, c, half:]
            for t in range(c * group, min(n, (c + 1) * group)):
                src, low, high = packed[i, t], out[i, t, :half], out[i, t, half:]
                for j in range(half):
                    low[j] = np.float32(src[j] & 15) * s_low[j] + a_low[j]
                for j in range(half):
                    high[j] = np.float32(src[j] >> 4) * s_high[j] + a_high[j]


@numba.njit(cache=True)  # no fastmath: the encoder computes its symbols from these same floats
def byte_scales(e, m, c, steps, period, lo, step):  # pragma: no cover — compiled
    """scales.values: e uint8, m int8 (G, B, W) a group each; c (G, 1, W) int8 K centers, or an empty array for
    V; steps (256,) float32 → lo, step (G, B, W) float32. A group's dither is frac(i · golden ratio), i its
    index in V's groups, or its K channel's (G · W, modulo `period` = heads · hd: candidates share it)."""
    g, b, w = e.shape
    top = steps[steps.shape[0] - 1]
    for x in range(g):
        for y in range(b):
            for z in range(w):
                s = steps[e[x, y, z]]
                i = (x * w + z) % period if c.size else (x * b + y) * w + z
                d = np.float32((i * 0.6180339887498949) % 1.0)
                center = np.float32(c[x, 0, z]) * top if c.size else np.float32(0)
                lo[x, y, z] = center + (np.float32(m[x, y, z]) + d) * (s * np.float32(0.25))
                step[x, y, z] = s


@numba.njit(cache=True)
def noise(step, per_token, hd, group, out):  # pragma: no cover — compiled
    """step (H, n, 1) per V token, or (H, blocks, hd) per K channel block of `group` tokens, float32 → out (n,)
    float32: each token's expected squared rounding error summed over heads and channels, step²/12 an element."""
    h, b, w = step.shape
    n = out.shape[0]
    for c in range(b):
        acc = 0.0
        for i in range(h):
            for j in range(w):
                acc += np.float64(step[i, c, j]) ** 2
        if per_token:
            out[c] = acc / 12 * hd
        else:
            for t in range(c * group, min(n, (c + 1) * group)):
                out[t] = acc / 12
