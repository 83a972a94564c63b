"""The compact codec's compiled loops (numba): the decoder's (a frame's byte scales to floats, packed symbols to
float32 in one pass, the rounding noise it reports) and the encoder's (each group's byte scales; K's symbols by
error feedback, feedback.py). One file: numba's on-disk cache keys a function by its own file, and both sides
share `_dither` and `_lo`.

Each byte holds two symbols (channel j low, channel j + hd/2 high), or in a WIDE frame one; a symbol q becomes
q · step + lo of its group: per (head, token) for V, per (head, block of tokens, channel) for K. Torch needed
five passes over the output for the same (two masked copies, a multiply, an add, the packed bytes' own copy);
this writes each float once from the bytes zstd returned.
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


@numba.njit(fastmath=True, cache=True)
def per_token_wide(q, lo, step, out):  # pragma: no cover — compiled
    """A WIDE frame (a byte a symbol): q (H, n, hd) uint8; lo, step (H, n) float32 → out (H, n, hd) float32."""
    h, n, hd = q.shape
    for i in range(h):
        for t in range(n):
            a, s, src, dst = lo[i, t], step[i, t], q[i, t], out[i, t]
            for j in range(hd):
                dst[j] = np.float32(src[j]) * s + a


@numba.njit(fastmath=True, cache=True)
def per_channel_wide(q, lo, step, group, out):  # pragma: no cover — compiled
    """A WIDE frame: q (H, n, hd) uint8; lo, step (H, blocks, hd) float32, a block a `group` tokens → out (H, n, hd)."""
    h, n, hd = q.shape
    for i in range(h):
        for c in range(lo.shape[1]):
            s, a = step[i, c], lo[i, c]
            for t in range(c * group, min(n, (c + 1) * group)):
                src, dst = q[i, t], out[i, t]
                for j in range(hd):
                    dst[j] = np.float32(src[j]) * s[j] + a[j]


@numba.njit(cache=True)
def frame(packed, lo, step, group, by_token, out, err):  # pragma: no cover — compiled
    """A frame's symbols to out (H, n, hd) float32, and its rounding noise (`noise`) into err (n,) float32 unless
    that is empty: packed (H, n, hd/2), or (H, n, hd) in a WIDE frame; lo, step (H, n, 1) per token, else (H, blocks,
    hd) per channel block of `group` tokens. One call a frame: the loops above, each compiled as it is."""
    wide = packed.shape[2] == out.shape[2]
    if by_token and wide:
        per_token_wide(packed, lo[..., 0], step[..., 0], out)
    elif by_token:
        per_token(packed, lo[..., 0], step[..., 0], out)
    elif wide:
        per_channel_wide(packed, lo, step, group, out)
    else:
        per_channel(packed, lo, step, group, out)
    if err.size:
        noise(step, by_token, out.shape[2], group, err)


@numba.njit(cache=True)  # no fastmath: the grid and the scales as the encoder computed them
def byte_frame(base, octaves, e, m, c, packed, group, by_token, out, err):  # pragma: no cover — compiled
    """`frame` for a frame with byte scales (scales.py): its float32 base, octaves (256,) float64
    (scales.OCTAVES), e uint8 and m int8 (H, B, W) a group, c (H, 1, hd) int8 K centers or empty for V. The
    grid is scales.grid's own arithmetic: float32(float64(base) · octave)."""
    steps = np.empty(octaves.shape[0], np.float32)
    for i in range(octaves.shape[0]):
        steps[i] = np.float32(np.float64(base) * octaves[i])
    lo, step = np.empty(e.shape, np.float32), np.empty(e.shape, np.float32)
    byte_scales(e, m, c, steps, lo, step)
    frame(packed, lo, step, group, by_token, out, err)


@numba.njit(inline="always")
def _dither(i):  # pragma: no cover — compiled
    """Group i's offset of lo in quarter steps: frac(i · golden ratio), float32 (scales.py); y − floor(y) is
    y % 1 exactly for y ≥ 0, without fmod's library call."""
    y = i * 0.6180339887498949
    return np.float32(y - np.floor(y))


@numba.njit(inline="always")
def _lo(center, m, d, s):  # pragma: no cover — compiled
    """lo = center + (m + dither) · step / 4, float32: the encoder and the decoder in the same operations."""
    return center + (np.float32(m) + d) * (s * np.float32(0.25))


@numba.njit(cache=True)  # no fastmath: the encoder computes its symbols from the decoder's floats
def byte_scales(e, m, c, steps, lo, step):  # pragma: no cover — compiled
    """scales.values: e uint8, m int8 (H, B, W) a group each; c (H, 1, W) int8 K centers, or an empty array for
    V; steps (256,) float32 → lo, step (H, B, W) float32. A group's dither index is its own among V's groups
    (W = 1), or its K channel's (a channel's blocks share it)."""
    g, b, w = e.shape
    top = steps[steps.shape[0] - 1]
    for x in range(g):
        for y in range(b):
            for z in range(w):
                s = steps[e[x, y, z]]
                i = x * w + z if c.size else (x * b + y) * w + z
                center = np.float32(c[x, 0, z]) * top if c.size else np.float32(0)
                lo[x, y, z] = _lo(center, m[x, y, z], _dither(i), s)
                step[x, y, z] = s


@numba.njit(fastmath=True, cache=True)
def _squared_error(row, lo, s, top):  # pragma: no cover — compiled
    """Σ (clamp(round((x − lo) / s), 0, top) · s + lo − x)² over row (n,) float32: a candidate's cost, in
    whatever order vectorizes (only a near-tie between candidates can tell the difference)."""
    total = np.float32(0)
    for t in range(row.shape[0]):
        r = min(max(np.rint((row[t] - lo) / s), np.float32(0)), top) * s + lo - row[t]
        total += r * r
    return total


@numba.njit(fastmath=True, cache=True)
def _range(row):  # pragma: no cover — compiled
    """min and max of row (n,) float32, n ≥ 1, in vector lanes (`row.min()` is a scalar loop)."""
    lo = hi = row[0]
    for t in range(row.shape[0]):
        lo, hi = min(lo, row[t]), max(hi, row[t])
    return lo, hi


@numba.njit(fastmath={"nnan", "ninf", "nsz"}, cache=True)  # exact arithmetic, loops that vectorize
def _symbols(row, lo, s, top, q):  # pragma: no cover — compiled
    """q (n,) uint8 = clamp(round((row − lo) / s), 0, top), row (n,) float32."""
    for t in range(row.shape[0]):
        q[t] = np.uint8(min(max(np.rint((row[t] - lo) / s), np.float32(0)), top))


@numba.njit(cache=True)  # no fastmath: as byte_scales
def place_best(x, top, steps, clip, centers, e, m, q):  # pragma: no cover — compiled
    """The encoder's `+b` groups: x (A, B, L) float32, group (a, b) the row x[a, b] (K: a head's channel over a
    block of tokens; V: a head's token over its channels), dither index a · B + b. Each group's range, shrunk
    around its middle to each `clip` fraction, is put on the grid `steps` (the first step ≥ range / top, lo at
    the nearest quarter step from the group's center, centers (A, B) float32); the candidate with the least
    squared error (the first of equals) is kept → e uint8, m int8 (A, B), symbols q (A, B, L) uint8 in 0..top.
    Returns whether every kept m fits a byte (unclamped)."""
    n_a, n_b, n = x.shape
    ftop, last, cands = np.float32(top), steps.shape[0] - 1, clip.shape[0]
    fits = True
    lo, s, k = np.empty(cands, np.float32), np.empty(cands, np.float32), np.empty(cands, np.float32)
    code, err, ok = np.empty(cands, np.int64), np.empty(cands, np.float32), np.empty(cands, np.bool_)
    for a in range(n_a):
        for b in range(n_b):
            row, center, d = x[a, b], centers[a, b], _dither(a * n_b + b)
            lo0, hi0 = _range(row)
            mid = (lo0 + hi0) / np.float32(2)
            for c in range(cands):
                half = (hi0 - lo0) * clip[c] / np.float32(2)
                low = mid - half
                code[c] = min(np.searchsorted(steps, ((mid + half) - low) / ftop), last)
                s[c] = steps[code[c]]
                place = np.rint(np.float32(4) * (low - center) / s[c] - d)
                ok[c], k[c] = -128 <= place <= 127, min(max(place, np.float32(-128)), np.float32(127))
                lo[c] = _lo(center, k[c], d, s[c])
            best = 0
            if cands > 1:  # V's groups have one candidate: nothing to score
                for c in range(cands):
                    err[c] = _squared_error(row, lo[c], s[c], ftop)
                best = np.argmin(err)
            fits = fits and ok[best]
            e[a, b], m[a, b] = code[best], np.int8(k[best])
            _symbols(row, lo[best], s[best], ftop, q[a, b])
    return fits


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


@numba.njit(cache=True)
def feedback_symbols(x, lo, step, top, order, u, out):  # pragma: no cover — compiled
    """x, lo, step (H, n, hd) float64 with channels in `order` (H, hd), u (H, hd, hd) → out (H, n, hd) uint8 in the
    channels' own order: each token's channels rounded in turn, each one's error carried onto the ones after it
    (x is consumed)."""
    heads, n, hd = x.shape
    for h in range(heads):
        for t in range(n):
            row = x[h, t]
            for j in range(hd):
                st = step[h, t, j]  # 0 in a float16-scaled group that was constant: every symbol is lo
                s = min(max(np.rint((row[j] - lo[h, t, j]) / st), 0.0), float(top)) if st > 0 else 0.0
                out[h, t, order[h, j]] = np.uint8(s)
                err = (row[j] - (s * st + lo[h, t, j])) / u[h, j, j]
                for i in range(j + 1, hd):
                    row[i] -= err * u[h, j, i]
