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

from dataclasses import dataclass

from . import cpu_threads  # before numba: its parallel loops on TBB

import numba
import numpy as np
import torch

from .cpu_int8_loops import attend, quantize_all, quantize_rows, write_rows

BLOCK = 1024  # keys per parallel task
PARALLEL_FROM = 1 << 15  # key × K/V-head reads (~1 ms) below which a call runs on one core: TBB wakes too slowly
# numba's workers awake (the step's products ran on them: int4 weights) and no torch team spinning on the other
# core: a sequence's layer splits from ~1.4K keys (3 K/V heads), in blocks of 256 (one sequence at 2.5K tokens:
# ~1 ms a step faster; at 300 tokens one core is faster, at 800 even)
WARM_PARALLEL_FROM, WARM_BLOCK = 1 << 12, 256


@dataclass(frozen=True)
class Step:
    """Where a decode step's sequences keep their int8 layers, found once for all its layers (per layer, the
    views, pointers and numpy arrays cost ~80 µs here, ~40% of the attention they fed)."""

    addresses: np.ndarray  # (L, S, 4) int64: layer l of sequence s's K, V (Hkv, capacity, hd) and scales (Hkv, capacity)
    capacity: np.ndarray  # (S,) int64
    seq: np.ndarray  # (N,) int64: the sequence of each query row
    pos: np.ndarray  # (N,) int64: each row's position, ascending within its sequence
    hkv: int
    threads: int
    block: int  # keys per parallel task


def step(caches: list[tuple[torch.Tensor, ...]], q_pos: torch.Tensor, cu_rows: list[int], warm: bool = False) -> Step:
    """caches[i] = (k, v, k_scale, v_scale): sequence i's whole int8 cache, (L, Hkv, capacity, hd) and (L, Hkv,
    capacity), each layer contiguous; its rows q_pos[cu_rows[i]:cu_rows[i+1]] → the step's `Step`. `warm`: the
    step's products run on numba's threads too (WARM_PARALLEL_FROM)."""
    assert all(c[0].dtype == c[1].dtype == torch.int8 for c in caches)
    bases = np.array([[_base(t) for t in c] for c in caches], dtype=np.int64)  # (S, 4, 2): address, layer stride
    layers = np.arange(caches[0][0].shape[0], dtype=np.int64)[:, None, None]
    return _step(bases[None, :, :, 0] + layers * bases[None, :, :, 1], [c[0].shape[2] for c in caches], q_pos,
                 cu_rows, caches[0][0].shape[1], warm)


def step_attention(st: Step, l: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Layer l of a step: the rows' new K, V (N, Hkv, hd) float32 written at their positions (as `write_rows_`),
    then their attention, q (N, H, hd) float32 → (N, H, hd)."""
    write_rows(k.contiguous().numpy(), v.contiguous().numpy(), st.seq, st.pos, st.addresses[l], st.capacity, st.hkv)
    return _attend(st, l, q, scale)


def varlen_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], q_pos: torch.Tensor,
                     cu_rows: list[int], scale: float, scales: list[tuple]) -> torch.Tensor:
    """q (N, H, hd) float32, sequence i's rows q[cu_rows[i]:cu_rows[i+1]] at q_pos (N,) ascending within each;
    ks[i], vs[i] (Hkv, T_i, hd) int8 with scales[i] = (k_scale, v_scale) (Hkv, T_i) float32, each a layer's
    first rows (each row's hd contiguous) → (N, H, hd) float32."""
    assert q.dtype == torch.float32 and all(k.dtype == v.dtype == torch.int8 for k, v in zip(ks, vs))
    if not q.shape[0]:
        return torch.empty(q.shape, dtype=torch.float32)
    layers = [[_layer(t) for t in (k, v, *sc)] for k, v, sc in zip(ks, vs, scales)]  # (address, capacity) each
    addresses = np.array([[[a for a, _ in ls] for ls in layers]], dtype=np.int64)  # (1, S, 4)
    return _attend(_step(addresses, [ls[0][1] for ls in layers], q_pos, cu_rows, ks[0].shape[0]), 0, q, scale)


def _step(addresses: np.ndarray, capacity: list[int], q_pos: torch.Tensor, cu_rows: list[int], hkv: int,
          warm: bool = False) -> Step:
    pos = q_pos.numpy().astype(np.int64, copy=False)
    reads = (int(pos.sum()) + len(pos)) * hkv
    threads = 1 if reads < (WARM_PARALLEL_FROM if warm else PARALLEL_FROM) else cpu_threads.cores()
    return Step(addresses, np.array(capacity, dtype=np.int64), np.repeat(np.arange(len(capacity)), np.diff(cu_rows)),
                pos, hkv, threads, WARM_BLOCK if warm else BLOCK)


def _attend(st: Step, l: int, q: torch.Tensor, scale: float) -> torch.Tensor:
    """q (N, H, hd) float32 over layer l of the step's caches → (N, H, hd) float32."""
    out = torch.empty(q.shape, dtype=torch.float32)
    # numpy, not torch, from here: a torch op may wake torch's OpenMP team, whose spinning worker then
    # holds the core TBB's worker needs (measured: no gain from a second core after one)
    numba.set_num_threads(st.threads)
    attend(q.contiguous().numpy(), st.seq, st.pos, st.addresses[l], st.capacity, st.hkv, scale, out.numpy(), st.block)
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


def quantize_into(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, n: int) -> None:
    """Rows 0..n of x (L, Hkv, capacity, hd) float32 → of q (L, Hkv, ≥ n, hd) int8 and scale (L, Hkv, ≥ n)
    float32, as `reference.quantize_int8`; each tensor contiguous (its rows then load in vector lanes)."""
    numba.set_num_threads(cpu_threads.cores())
    quantize_all(x.numpy(), q.numpy(), scale.numpy(), n)


def _layer(x: torch.Tensor) -> tuple[int, int]:
    """A cache layer's first rows, x[:, :T] (Hkv, T[, hd]), → the address and capacity of the contiguous
    (Hkv, capacity[, hd]) layer they were cut from: the kernel addresses that layer (it reads no row past
    the last position; the caller's tensors keep it alive). Strides only: views cost ~5 µs each here."""
    row = x.shape[2] if x.dim() == 3 else 1
    step = x.stride()
    assert step[-1] == 1 and step[1] == row and step[0] % row == 0, step
    return x.data_ptr(), step[0] // row


def _base(x: torch.Tensor) -> tuple[int, int]:
    """A whole cache tensor (L, Hkv, capacity[, hd]) → its address and the bytes from one layer to the next; each
    layer must be contiguous (the kernel addresses it so)."""
    assert x.is_contiguous() or x[0].is_contiguous(), x.stride()
    return x.data_ptr(), x.stride(0) * x.element_size()
