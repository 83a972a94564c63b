"""Attention over int8 KV caches on the CPU, compiled by numba: the decode path of compact caches (and the
small pass beside it: a decode row's int8 write).

Torch has no float × int8 product that runs near memory speed here (`_weight_int8pack_mm` falls back
to scalar code; widening int8 to float32 first writes four times the bytes it read), so the int8 keys
and values are widened inside the loop, eight rows at a time, and everything accumulates in float32.
One call serves every sequence of a decode batch: the work splits into (row, K/V head, block of
keys) tasks that run in parallel and merge by their log-sum-exps (flash-decoding). numba runs them on
TBB, whose workers wake too slowly for the ~0.2 ms of one sequence's layer: a call that small runs on
the calling thread. `reference.compact_attention` is this kernel's oracle.
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

from .cpu_int8_loops import attend, quantize_rows  # noqa: E402

BLOCK = 1024  # keys per parallel task
PARALLEL_FROM = 1 << 15  # key × K/V-head reads (~1 ms) below which a call runs on one core: TBB wakes too slowly


def varlen_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], q_pos: torch.Tensor,
                     cu_rows: list[int], scale: float, scales: list[tuple]) -> torch.Tensor:
    """q (N, H, hd) float32, sequence i's rows q[cu_rows[i]:cu_rows[i+1]] at q_pos (N,) ascending within each;
    ks[i], vs[i] (Hkv, T_i, hd) int8 with scales[i] = (k_scale, v_scale) (Hkv, T_i) float32, each a layer's
    first rows (each row's hd contiguous) → (N, H, hd) float32."""
    assert q.dtype == torch.float32 and all(k.dtype == v.dtype == torch.int8 for k, v in zip(ks, vs))
    out = torch.empty(q.shape, dtype=torch.float32)
    if not q.shape[0]:
        return out
    # numpy, not torch, from here: a torch op may wake torch's OpenMP team, whose spinning worker then
    # holds the core TBB's worker needs (measured: no gain from a second core after one)
    layers = [[_layer(t) for t in (k, v, *sc)] for k, v, sc in zip(ks, vs, scales)]  # (address, capacity) each
    addresses = np.array([[a for a, _ in ls] for ls in layers], dtype=np.int64)
    capacity = np.array([ls[0][1] for ls in layers], dtype=np.int64)
    seq = np.repeat(np.arange(len(ks)), np.diff(cu_rows))
    pos = q_pos.numpy()
    hkv = ks[0].shape[0]
    reads = (int(pos.sum()) + len(pos)) * hkv
    numba.set_num_threads(1 if reads < PARALLEL_FROM else min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    attend(q.contiguous().numpy(), seq, pos, addresses, capacity, hkv, scale, out.numpy(), BLOCK)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
              k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """One sequence: q (n, H, hd) float32 at q_pos (n,) ascending; k, v (Hkv, T, hd) int8 with k_scale, v_scale
    (Hkv, T) float32 → (n, H, hd) float32."""
    return varlen_attention(q, [k], [v], q_pos, [0, q.shape[0]], scale, [(k_scale, v_scale)])


def write_rows_(q: torch.Tensor, scale: torch.Tensor, new: torch.Tensor, first: int) -> None:
    """q (Hkv, capacity, hd) int8 and scale (Hkv, capacity) float32 rows first.. ← new (n, Hkv, hd) float32
    quantized as `reference.quantize_int8` does."""
    assert q.dtype == torch.int8 and scale.dtype == new.dtype == torch.float32
    quantize_rows(new.numpy(), q.numpy(), scale.numpy(), first)


def _layer(x: torch.Tensor) -> tuple[int, int]:
    """A cache layer's first rows, x[:, :T] (Hkv, T[, hd]), → the address and capacity of the contiguous
    (Hkv, capacity[, hd]) layer they were cut from: the kernel addresses that layer (it reads no row past
    the last position; the caller's tensors keep it alive). Strides only: views cost ~5 µs each here."""
    row = x.shape[2] if x.dim() == 3 else 1
    step = x.stride()
    assert step[-1] == 1 and step[1] == row and step[0] % row == 0, step
    return x.data_ptr(), step[0] // row
