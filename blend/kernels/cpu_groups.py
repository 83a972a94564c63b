"""Decode weights quantized in groups of 32 inputs, multiplied on the CPU by numba: `int4` decode weights
(`blend.linear`). Weight-only: the rows and every sum stay float32.

Two formats, GGUF's two the bundled SmolLM2 ships in, so its weights pack without loss:
- 4 bits (Q4_1): per group an fp16 step d and minimum m, codes q in 0..15, w = d·q + m;
- 8 bits (Q8_0, the LM head's): per group an fp16 step d, codes q in ±127, w = d·q.
Outputs go in tiles of 64: a tile's codes for input k are contiguous (4 bits: byte j holds outputs j and
j + 32, stored XOR 0x80 so it reads as a signed byte), so the loops run across outputs, 16 lanes at a time,
and no dot product ends in a horizontal sum. Row by row: a row's product never depends on the other rows.
One row through the model's blocks at 4 bits, out of cache, on 2 cores of an AMD EPYC: 6.6 ms against fbgemm's
int8 8.8 (scratch timing). A step of 4 sequences is about even with int8's, and a step of 16 is 15% slower:
fbgemm reuses each weight across the rows better. Batched decoding should keep `int8` (BENCHMARKS.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import cpu_threads  # before numba: its parallel loops on TBB
from . import cpu_rows

import numba
import numpy as np
import torch

TILE, GROUP = 64, 32


@dataclass(frozen=True)
class Grouped:
    """An (out, in) matrix in `bits`-bit groups: codes (tiles, in, 32 or 64) int8, scales (tiles, in / 32,
    1 or 2, 64) int16 (fp16 bit patterns of d, then m); numpy's, as the kernel takes them (a torch tensor's
    `.numpy()` costs ~1 µs a call)."""

    bits: int
    out_features: int
    codes: np.ndarray
    scales: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


def pack(w: torch.Tensor, bits: int) -> Grouped:
    """w (out, in) float → `Grouped` at 4 or 8 bits; in must be a multiple of 32 (out is padded to 64s)."""
    out, k = w.shape
    if k % GROUP:
        raise ValueError(f"{bits}-bit decode weights need in-features a multiple of {GROUP}, not {k}")
    w = torch.cat([w.float(), w.new_zeros(-out % TILE, k, dtype=torch.float32)]).view(-1, TILE, k // GROUP, GROUP)
    if bits == 4:
        low, high = w.amin(-1), w.amax(-1)
        d, m = ((high - low) / 15).half(), low.half()
        q = torch.round((w - m.float()[..., None]) / d.float().clamp_min(1e-30)[..., None]).clamp_(0, 15)
        q = q.to(torch.uint8).flatten(2)  # (tiles, 64, in)
        codes = ((q[:, :32] | (q[:, 32:] << 4)) ^ 0x80).view(torch.int8)
        scales = torch.stack([d, m], 2)  # (tiles, 64, 2, groups)
    else:
        d = (w.abs().amax(-1) / 127).half()
        codes = torch.round(w / d.float().clamp_min(1e-30)[..., None]).clamp_(-127, 127).to(torch.int8).flatten(2)
        scales = d[:, :, None]
    assert torch.isfinite(scales.float()).all(), "a weight group past float16's range"
    return Grouped(bits, out, codes.transpose(1, 2).contiguous().numpy(),
                   scales.view(torch.int16).permute(0, 3, 2, 1).contiguous().numpy())


def unpack(g: Grouped) -> torch.Tensor:
    """The float32 (out, in) matrix `g` stands for: the kernel's oracle."""
    d = torch.from_numpy(g.scales).view(torch.float16).float().permute(0, 3, 2, 1)  # (tiles, 64, 1 or 2, groups)
    codes = torch.from_numpy(g.codes)
    if g.bits == 4:
        c = codes.view(torch.uint8) ^ 0x80
        q = torch.cat([c & 15, c >> 4], 2).transpose(1, 2).float()  # (tiles, 64, in)
        w = q.unflatten(2, (-1, GROUP)) * d[:, :, 0, :, None] + d[:, :, 1, :, None]
    else:
        w = codes.transpose(1, 2).float().unflatten(2, (-1, GROUP)) * d[:, :, 0, :, None]
    return w.flatten(2).flatten(0, 1)[: g.out_features]


def linear(x: torch.Tensor, g: Grouped, norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """x (n, in) float32 → x · unpack(g)ᵀ (n, out) float32; with `norm` (in,), `cpu_rows.norm_rows` of x first,
    in the same crossing from torch (kernels.rms_norm's own costs ~3.5 µs more a call)."""
    x = x.contiguous().numpy()
    if norm is not None:
        x = cpu_rows.norm_rows(x, norm.numpy(), eps)
    out = np.empty((x.shape[0], g.codes.shape[0] * TILE), dtype=np.float32)
    numba.set_num_threads(cpu_threads.cores())
    (_matmul4 if g.bits == 4 else _matmul8)(x, g.codes, g.scales, out)
    y = torch.from_numpy(out)
    return y if y.shape[1] == g.out_features else y[:, : g.out_features].contiguous()


@numba.njit(fastmath=True, inline="always")
def _halves(h, bits, out):  # pragma: no cover — compiled
    """out (64,) f32 ← h (64,) fp16 bit patterns: normals by moving the fields, zeros and subnormals by scaling."""
    for j in range(out.shape[0]):
        b = np.int32(h[j]) & 0xffff
        normal = b & 0x7c00
        bits[j] = ((b & 0x8000) << 16) | (((b & 0x7fff) + 0x1c000) << 13) if normal else (b & 0x8000) << 16
        out[j] = np.float32(0) if normal else np.float32(b & 0x3ff) * np.float32(2.0**-24) * np.float32(1 - 2 * (b >> 15))
    f = bits.view(np.float32)
    for j in range(out.shape[0]):
        out[j] += f[j]


@numba.njit(fastmath=True, inline="always")
def _sums(x, r, g):  # pragma: no cover — compiled
    s = np.float32(0)
    for k in range(g * GROUP, (g + 1) * GROUP):
        s += x[r, k]
    return s


@numba.njit(fastmath=True, inline="always")
def _nibble(c, j):  # pragma: no cover — compiled
    """Code byte j of c (read signed) → (its low nibble, its high nibble less 8), as float32."""
    f = np.float32(c[j])
    h = np.floor(f * np.float32(0.0625))
    return f - np.float32(16) * h, h


@numba.njit(fastmath=True, inline="always")
def _nibbles1(x, r, c, g, acc):  # pragma: no cover — compiled
    """acc (8, 32) rows 0 and 4 ← one row's sums over group g of codes c (in, 32): low nibbles (outputs 0..31),
    high (32..63, less 8: the byte was read signed). Four inputs an update: each accumulator's load and store
    serve four products (15–20% faster than one, scratch timing)."""
    acc[0] = 0
    acc[4] = 0
    lo, hi = acc[0], acc[4]
    for k in range(g * GROUP, (g + 1) * GROUP, 4):
        x0, x1, x2, x3 = x[r, k], x[r, k + 1], x[r, k + 2], x[r, k + 3]
        c0, c1, c2, c3 = c[k], c[k + 1], c[k + 2], c[k + 3]
        for j in range(32):
            l0, h0 = _nibble(c0, j)
            l1, h1 = _nibble(c1, j)
            l2, h2 = _nibble(c2, j)
            l3, h3 = _nibble(c3, j)
            lo[j] += (x0 * l0 + x1 * l1) + (x2 * l2 + x3 * l3)
            hi[j] += (x0 * h0 + x1 * h1) + (x2 * h2 + x3 * h3)


@numba.njit(fastmath=True, inline="always")
def _nibbles4(x, r, c, g, acc):  # pragma: no cover — compiled
    """`_nibbles1` of rows r..r+3 at once, each code unpacked once: acc rows u and 4 + u are row r + u's."""
    acc[:] = 0
    l0, l1, l2, l3, h0, h1, h2, h3 = acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]
    for k in range(g * GROUP, (g + 1) * GROUP):
        x0, x1, x2, x3 = x[r, k], x[r + 1, k], x[r + 2, k], x[r + 3, k]
        ck = c[k]
        for j in range(32):
            lo, h = _nibble(ck, j)
            l0[j] += x0 * lo
            l1[j] += x1 * lo
            l2[j] += x2 * lo
            l3[j] += x3 * lo
            h0[j] += x0 * h
            h1[j] += x1 * h
            h2[j] += x2 * h
            h3[j] += x3 * h


@numba.njit(parallel=True, fastmath=True, cache=True)
def _matmul4(x, codes, scales, out):  # pragma: no cover — compiled
    """out (n, tiles·64) = x (n, in) · W, W in 4-bit groups (`pack`)."""
    n = x.shape[0]
    for t in numba.prange(codes.shape[0]):
        acc = np.empty((8, 32), dtype=np.float32)
        d, m = np.empty(TILE, dtype=np.float32), np.empty(TILE, dtype=np.float32)
        bits = np.empty(TILE, dtype=np.int32)
        res = np.zeros((n, TILE), dtype=np.float32)
        for g in range(codes.shape[1] // GROUP):
            _halves(scales[t, g, 0], bits, d)
            _halves(scales[t, g, 1], bits, m)
            for j in range(32, TILE):
                m[j] += np.float32(8) * d[j]  # the high nibble was read as q − 8
            r = 0
            while r < n:
                rows = 4 if r + 4 <= n else 1
                if rows == 4:
                    _nibbles4(x, r, codes[t], g, acc)
                else:
                    _nibbles1(x, r, codes[t], g, acc)
                for u in range(rows):
                    s = _sums(x, r + u, g)
                    for j in range(32):
                        res[r + u, j] += d[j] * acc[u, j] + m[j] * s
                        res[r + u, j + 32] += d[j + 32] * acc[u + 4, j] + m[j + 32] * s
                r += rows
        out[:, t * TILE : (t + 1) * TILE] = res


@numba.njit(parallel=True, fastmath=True, cache=True)
def _matmul8(x, codes, scales, out):  # pragma: no cover — compiled
    """out (n, tiles·64) = x (n, in) · W, W in 8-bit groups (`pack`)."""
    n = x.shape[0]
    for t in numba.prange(codes.shape[0]):
        acc = np.empty(TILE, dtype=np.float32)
        d = np.empty(TILE, dtype=np.float32)
        bits = np.empty(TILE, dtype=np.int32)
        res = np.zeros((n, TILE), dtype=np.float32)
        c = codes[t]
        for g in range(codes.shape[1] // GROUP):
            _halves(scales[t, g, 0], bits, d)
            for r in range(n):
                acc[:] = 0
                for k in range(g * GROUP, (g + 1) * GROUP, 4):  # four inputs an update, as `_nibbles1`
                    x0, x1, x2, x3 = x[r, k], x[r, k + 1], x[r, k + 2], x[r, k + 3]
                    for j in range(TILE):
                        acc[j] += ((x0 * np.float32(c[k, j]) + x1 * np.float32(c[k + 1, j]))
                                   + (x2 * np.float32(c[k + 2, j]) + x3 * np.float32(c[k + 3, j])))
                for j in range(TILE):
                    res[r, j] += d[j] * acc[j]
        out[:, t * TILE : (t + 1) * TILE] = res
