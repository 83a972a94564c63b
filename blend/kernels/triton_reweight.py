"""Triton APE attention (`blend/reweight.py`): the question's rows over their cache, the stale
context keys a group of their own (logits ÷ T, mass S·exp(T·logsumexp)), every other key plain.

One pass over the keys keeps two online softmaxes, one per group, merged at the end. Used on CUDA
(see `__init__.py`); the tests run it on the CPU with TRITON_INTERPRET=1 against
`reference.reweighted_attention_dense`.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .triton_ops import _bf16_dot_broken, attention_layout
from .triton_tiles import _fold, _kv_block, _load_rows, _qk, _store_rows


@triton.jit
def _reweighted_kernel(Q, K, V, STALE, O, QPOS, n, T, scale, inv_temp, temp, log_factor, stride_qn, stride_qh,
                       stride_kh, stride_kt, stride_vh, stride_vt, stride_on, stride_oh, GROUP: tl.constexpr,
                       HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                       F32_DOT: tl.constexpr):
    head = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid_m = offs_m < n
    q_pos = tl.load(QPOS + offs_m, mask=valid_m, other=0)
    q = _load_rows(Q, offs_m, valid_m, head, stride_qn, stride_qh, HD)
    k_base, v_base = K + (head // GROUP) * stride_kh, V + (head // GROUP) * stride_vh
    m_c = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    m_w = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_c = tl.zeros((BLOCK_M,), dtype=tl.float32)
    l_w = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc_c = tl.zeros((BLOCK_M, HD), dtype=tl.float32)
    acc_w = tl.zeros((BLOCK_M, HD), dtype=tl.float32)
    last = tl.minimum(tl.max(q_pos, axis=0) + 1, T)
    for start in range(0, last, BLOCK_N):
        offs_n, in_range, k, v = _kv_block(k_base, stride_kt, v_base, stride_vt, start, T, HD, BLOCK_N)
        stale = tl.load(STALE + offs_n, mask=in_range, other=0) != 0
        s = _qk(q, k, scale, IEEE, F32_DOT)  # (BLOCK_M, BLOCK_N)
        visible = (offs_n[None, :] <= q_pos[:, None]) & in_range[None, :]
        cold = visible & stale[None, :]
        m_c, l_c, acc_c = _fold(tl.where(cold, s * inv_temp, float("-inf")), v, m_c, l_c, acc_c, IEEE, F32_DOT)
        m_w, l_w, acc_w = _fold(tl.where(visible & ~cold, s, float("-inf")), v, m_w, l_w, acc_w, IEEE, F32_DOT)
    # the groups' sums kept off 0 for the log and the division; an empty group (l = 0) is weighted 0 below
    safe_c, safe_w = tl.maximum(l_c, 1e-30), tl.maximum(l_w, 1e-30)
    lse_c = log_factor + temp * (m_c + tl.log(safe_c))  # the groups' log weights
    lse_w = m_w + tl.log(safe_w)
    top = tl.maximum(lse_c, lse_w)
    w_c = tl.where(l_c > 0, tl.exp(lse_c - top), 0.0)
    w_w = tl.where(l_w > 0, tl.exp(lse_w - top), 0.0)
    out = (acc_c * (w_c / safe_c)[:, None] + acc_w * (w_w / safe_w)[:, None])
    out = out / (w_c + w_w)[:, None]
    _store_rows(O, offs_m, valid_m, head, stride_on, stride_oh, out, HD)


def reweighted_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                         stale: torch.Tensor, scale: float, temperature: float, factor: float) -> torch.Tensor:
    """q (n, H, hd) at q_pos (n,) int64; k, v (Hkv, T, hd); stale (T,) bool → (n, H, hd) in q's dtype."""
    n, h, hd, hkv, t = attention_layout(q, k, v, q_pos)
    assert stale.shape == (t,) and stale.dtype == torch.bool and temperature > 0 and factor > 0
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if n == 0:
        return out
    block_m = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    _reweighted_kernel[(triton.cdiv(n, block_m), h)](
        q, k, v, stale.to(torch.uint8), out, q_pos, n, t, scale, 1.0 / temperature, temperature, math.log(factor),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        GROUP=h // hkv, HD=hd, BLOCK_M=block_m, BLOCK_N=64, IEEE=q.dtype == torch.float32,
        F32_DOT=_bf16_dot_broken(q.dtype))
    return out
