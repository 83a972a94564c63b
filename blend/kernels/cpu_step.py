"""Every block of a decode step in one compiled call: int4 decode weights (`cpu_groups`) over int8 caches
(`cpu_int8`), on the CPU. The same passes as the step taken layer by layer (`blend.batch.forward_batch`), but
the ~9 crossings a layer between torch and numba (~10 µs each: argument unboxing, `from_numpy`, thread
counts) become one a step, and SiLU runs compiled too.

    stack = stack_layers([(ln1, wqkv, bqkv, wo, ln2, wgu, wd), ...])   # once, from the packed layers
    x = layers(step, stack, x, cos, sin, heads, scale, eps)            # (N, D) → (N, D) after the last block

`_layers` is not cached on disk: numba keys a cached function by its own file only, so a cached driver would
keep the loops of `cpu_groups`, `cpu_rows` and `cpu_int8_loops` it was compiled with after they change. It
compiles once a process (its callees come from their caches), when the decode weights warm up.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import cpu_threads  # before numba: its parallel loops on TBB

import numba
import numpy as np
import torch

from .cpu_groups import TILE, Grouped, _matmul4
from .cpu_int8 import Step
from .cpu_int8_loops import attend, exp_into, write_rows
from .cpu_rows import norm_rows, rope_split


@dataclass(frozen=True)
class Stack:
    """The blocks' 4-bit matrices, each kind stacked over layers (L, ...) as `Grouped` codes and scales, with
    their norms (L, D) and qkv biases (L, out; (L, 0) when the model has none), as numpy arrays."""

    ln1: np.ndarray
    ln2: np.ndarray
    bias: np.ndarray
    codes: tuple[np.ndarray, ...]  # qkv, o, gate-up, down
    scales: tuple[np.ndarray, ...]
    out_features: tuple[int, ...]

    def matrices(self, l: int) -> list[Grouped]:
        """Layer l's four matrices (qkv, o, gate-up, down), views of the stack."""
        return [Grouped(4, n, c[l], s[l]) for n, c, s in zip(self.out_features, self.codes, self.scales)]


def stack_layers(layers: list[tuple]) -> Stack | None:
    """layers[l] = (ln1 (D,), wqkv, bqkv (out,) or None, wo, ln2 (D,), wgu, wd), the matrices 4-bit `Grouped`
    → their `Stack`; None when they are not all 4-bit with the same shapes."""
    ln1, wqkv, bqkv, wo, ln2, wgu, wd = zip(*layers)
    kinds = (wqkv, wo, wgu, wd)
    if any(g.bits != 4 or g.codes.shape != m[0].codes.shape for m in kinds for g in m):
        return None
    bias = np.stack([b.numpy() for b in bqkv]) if all(b is not None for b in bqkv) \
        else np.zeros((len(layers), 0), dtype=np.float32)
    return Stack(np.stack([t.numpy() for t in ln1]), np.stack([t.numpy() for t in ln2]), bias,
                 tuple(np.stack([g.codes for g in m]) for m in kinds), tuple(np.stack([g.scales for g in m]) for m in kinds),
                 tuple(m[0].out_features for m in kinds))


def layers(st: Step, stack: Stack, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, scale: float,
           eps: float) -> torch.Tensor:
    """x (N, D) float32 rows at the step's positions, cos/sin (N, 1, hd) of those positions → x after every block
    (N, D), each block's K/V written into the step's caches and attended as `cpu_int8.step_attention` does."""
    numba.set_num_threads(cpu_threads.cores())
    c, s = stack.codes, stack.scales
    return torch.from_numpy(_layers(
        x.contiguous().numpy(), cos.contiguous().numpy(), sin.contiguous().numpy(), stack.ln1, stack.ln2,
        stack.bias, c[0], s[0], c[1], s[1], c[2], s[2], c[3], s[3], stack.out_features[2] // 2,
        st.seq, st.pos, st.addresses, st.capacity, st.hkv, heads, scale, eps, st.block))


@numba.njit(fastmath={"nnan", "ninf", "nsz", "contract", "afn"})
def _silu_mul(gu, half):  # pragma: no cover — compiled
    """gu (n, ≥ 2·half) gate then up → silu(gate) · up (n, half): gate · σ(gate), σ from e = exp(−|gate|)
    (`exp_into`'s, so it vectorizes): 1 / (1 + e) for gate ≥ 0, e / (1 + e) below."""
    n = gu.shape[0]
    out = np.empty((n, half), dtype=np.float32)
    neg = np.empty(half, dtype=np.float32)
    e = np.empty(half, dtype=np.float32)
    bits = np.empty(half, dtype=np.int32)
    for r in range(n):
        for c in range(half):
            neg[c] = -abs(gu[r, c])
        exp_into(neg, e, bits)
        for c in range(half):
            g = gu[r, c]
            sig = (np.float32(1) if g >= 0 else e[c]) / (np.float32(1) + e[c])
            out[r, c] = g * sig * gu[r, half + c]
    return out


@numba.njit
def _product(x, codes, scales):  # pragma: no cover — compiled
    """x (n, in) f32 · one layer's 4-bit matrix → (n, tiles·64), padding columns included."""
    out = np.empty((x.shape[0], codes.shape[0] * TILE), dtype=np.float32)
    _matmul4(x, codes, scales, out)
    return out


@numba.njit
def _layers(x, cos, sin, ln1, ln2, bias, qc, qs, oc, os, gc, gs, dc, ds, inter, seq, pos, addresses, capacity, hkv,
            heads, scale, eps, block):  # pragma: no cover — compiled
    """`layers`' loop: x (N, D) f32 through every block → (N, D); inter: the MLP's width (gate-up's half)."""
    n, dim = x.shape
    hd = cos.shape[2]
    for l in range(ln1.shape[0]):
        qkv = _product(norm_rows(x, ln1[l], eps), qc[l], qs[l])
        for r in range(n):
            for j in range(bias.shape[1]):
                qkv[r, j] += bias[l, j]
        q, k, v = rope_split(qkv, cos, sin, heads, hkv)
        write_rows(k, v, seq, pos, addresses[l], capacity, hkv)
        attn = np.empty((n, heads, hd), dtype=np.float32)
        attend(q, seq, pos, addresses[l], capacity, hkv, scale, attn, block)
        x = x + _product(attn.reshape(n, heads * hd), oc[l], os[l])[:, :dim]
        gu = _product(norm_rows(x, ln2[l], eps), gc[l], gs[l])
        x = x + _product(_silu_mul(gu, inter), dc[l], ds[l])[:, :dim]
    return x
