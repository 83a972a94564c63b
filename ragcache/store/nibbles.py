"""The compact codec's last stage on the CPU, compiled by numba: packed symbols to float32 in one pass.

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
            a, s = lo[i, t], step[i, t]
            for j in range(half):
                b = packed[i, t, j]
                out[i, t, j] = np.float32(b & 15) * s + a
                out[i, t, j + half] = np.float32(b >> 4) * s + a


@numba.njit(fastmath=True, cache=True)
def per_channel(packed, lo, step, group, out):  # pragma: no cover — compiled
    """packed (H, n, hd/2) uint8; lo, step (H, blocks, hd) float32, one block a `group` tokens (the last one
    shorter) → out (H, n, hd) float32."""
    h, n, half = packed.shape
    for i in range(h):
        for t in range(n):
            c = t // group
            for j in range(half):
                b = packed[i, t, j]
                out[i, t, j] = np.float32(b & 15) * step[i, c, j] + lo[i, c, j]
                out[i, t, j + half] = np.float32(b >> 4) * step[i, c, j + half] + lo[i, c, j + half]
