"""Attention over an int8 KV cache on the CPU, compiled by numba: the decode path of a compact cache.

Torch has no float × int8 product that runs near memory speed on an AVX2 CPU (`_weight_int8pack_mm`
falls back to scalar code there; widening int8 to float32 first writes four times the bytes it
read), so the int8 keys and values are widened inside the loop, one row at a time, and everything
accumulates in float32. The keys are split into blocks that run in parallel and merge by their
log-sum-exps (flash-decoding), so even one sequence's decode row keeps every core busy.
`reference.compact_attention` is this kernel's oracle.
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path


def _load_tbb() -> None:
    """Make numba run its parallel loops on TBB. Its OpenMP layer, launched from any thread but the
    main one (the server's model thread), ran a decode step 5x slower on this machine (299 against
    59 ms, SmolLM2 at 2.5K tokens of context); TBB's does not (71 ms). The `tbb` wheel puts libtbb in
    the environment's lib/, off the loader's path: loaded here before numba, numba's default order
    (tbb, omp, workqueue) takes it. Without the wheel numba falls back to OpenMP."""
    lib = Path(sys.prefix) / "lib" / "libtbb.so.12"
    if lib.is_file():
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


_load_tbb()

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

BLOCK = 256  # keys per parallel task


@numba.njit(parallel=True, fastmath=True, cache=True)
def _attend(q, k, v, ks, vs, pos, scale, out, block):  # pragma: no cover — compiled
    """q (n, H, hd) f32; k, v (Hkv, capacity, hd) int8; ks, vs (Hkv, capacity) f32; pos (n,) i64 ascending
    → out (n, H, hd) f32. Keys past the last row's position are never read."""
    n, h, hd = q.shape
    hkv = k.shape[0]
    g = h // hkv
    blocks = (pos[n - 1] + block) // block
    m = np.full((n, hkv, blocks, g), -np.inf, dtype=np.float32)
    l = np.zeros((n, hkv, blocks, g), dtype=np.float32)
    acc = np.zeros((n, hkv, blocks, g, hd), dtype=np.float32)
    for task in numba.prange(n * hkv * blocks):
        r, j, c = task // (hkv * blocks), (task // blocks) % hkv, task % blocks
        a, b = c * block, min((c + 1) * block, pos[r] + 1)  # causal by absolute position
        if a >= b:
            continue
        qs = q[r, j * g : (j + 1) * g] * np.float32(scale)  # (g, hd)
        s = np.empty((g, b - a), dtype=np.float32)
        for t in range(a, b):
            for i in range(g):
                dot = np.float32(0)
                for d in range(hd):
                    dot += qs[i, d] * np.float32(k[j, t, d])
                s[i, t - a] = dot * ks[j, t]
        for i in range(g):
            top = s[i].max()
            total = np.float32(0)
            o = acc[r, j, c, i]
            for t in range(a, b):
                p = np.exp(s[i, t - a] - top)
                total += p
                w = p * vs[j, t]
                for d in range(hd):
                    o[d] += w * np.float32(v[j, t, d])
            m[r, j, c, i], l[r, j, c, i] = top, total
    for r in range(n):
        for j in range(hkv):
            for i in range(g):
                top = m[r, j, :, i].max()
                total = np.float32(0)
                o = np.zeros(hd, dtype=np.float32)
                for c in range(blocks):
                    if l[r, j, c, i] > 0:
                        w = np.exp(m[r, j, c, i] - top)
                        total += w * l[r, j, c, i]
                        o += w * acc[r, j, c, i]
                out[r, j * g + i] = o / total


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
              k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """q (n, H, hd) float32 at q_pos (n,) ascending; k, v (Hkv, T, hd) int8 with k_scale, v_scale (Hkv, T)
    float32, each row's hd contiguous → (n, H, hd) float32."""
    assert q.dtype == torch.float32 and k.dtype == v.dtype == torch.int8, (q.dtype, k.dtype)
    out = torch.empty(q.shape, dtype=torch.float32)
    if q.shape[0]:
        numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
        _attend(q.contiguous().numpy(), *(_whole(t).numpy() for t in (k, v, k_scale, v_scale)), q_pos.numpy(), scale,
                out.numpy(), BLOCK)
    return out


def _whole(x: torch.Tensor) -> torch.Tensor:
    """A cache layer's first rows, x[:, :T], as the contiguous (Hkv, capacity, ...) layer they were cut from:
    that layout numba compiles to vector code (the kernel reads no row past the last position)."""
    row = x[0, 0].numel()
    assert x.stride(-1) == 1 and x.stride(1) == row and x.stride(0) % row == 0, x.stride()
    return x.as_strided((x.shape[0], x.stride(0) // row, *x.shape[2:]), x.stride())
