"""Tile-level pieces every Triton attention kernel shares (`triton_ops`, `triton_varlen`,
`triton_reweight`): a head's query/output rows, a key/value block, q·kᵀ, one online-softmax step, and the
whole causal loop of a block of rows."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_rows(X, offs_m, valid_m, head, stride_n, stride_h, HD: tl.constexpr):
    """Rows offs_m (BLOCK_M,) of one head of an (n, H, HD) tensor → (BLOCK_M, HD); zeros where not valid_m."""
    offs_d = tl.arange(0, HD)
    return tl.load(X + offs_m[:, None] * stride_n + head * stride_h + offs_d[None, :], mask=valid_m[:, None],
                   other=0.0)


@triton.jit
def _store_rows(X, offs_m, valid_m, head, stride_n, stride_h, val, HD: tl.constexpr):
    """`_load_rows`'s inverse: val (BLOCK_M, HD) into the valid rows, cast to X's dtype."""
    offs_d = tl.arange(0, HD)
    tl.store(X + offs_m[:, None] * stride_n + head * stride_h + offs_d[None, :], val.to(X.dtype.element_ty),
             mask=valid_m[:, None])


@triton.jit
def _qk(q, k, scale, IEEE: tl.constexpr, F32_DOT: tl.constexpr):
    """Logits (BLOCK_M, BLOCK_N) float32 of q (BLOCK_M, HD) against k (BLOCK_N, HD)."""
    if IEEE:  # float32 stays float32: no TF32 rounding
        return tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    elif F32_DOT:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale
    else:
        return tl.dot(q, tl.trans(k)).to(tl.float32) * scale


@triton.jit
def _fold(s, v, m_i, l_i, acc, IEEE: tl.constexpr, F32_DOT: tl.constexpr):
    """One block of logits s (BLOCK_M, BLOCK_N) (−inf: not seen) into an online softmax's running max,
    sum and weighted values; rows that have seen nothing yet keep max −inf without NaN."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    elif F32_DOT:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
    else:
        pv = tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


@triton.jit
def _kv_block(k_base, stride_kt, v_base, stride_vt, start, t_len, HD: tl.constexpr, BLOCK_N: tl.constexpr,
              ks_base=None, vs_base=None, SCALED: tl.constexpr = False):
    """Keys [start, start + BLOCK_N) of one K/V head → (their positions, which exist, K and V (BLOCK_N, HD)).
    SCALED: K/V are int8 with one float32 scale per key at ks_base + t, vs_base + t, widened here to float32."""
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HD)
    in_range = offs_n < t_len
    k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=in_range[:, None], other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], mask=in_range[:, None], other=0.0)
    if SCALED:
        k = k.to(tl.float32) * tl.load(ks_base + offs_n, mask=in_range, other=0.0)[:, None]
        v = v.to(tl.float32) * tl.load(vs_base + offs_n, mask=in_range, other=0.0)[:, None]
    return offs_n, in_range, k, v


@triton.jit
def _attend_rows(q, q_pos, k_base, stride_kt, v_base, stride_vt, t_len, scale, HD: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, F32_DOT: tl.constexpr,
                 ks_base=None, vs_base=None, SCALED: tl.constexpr = False):
    """Online-softmax attention of one head's block of query rows q (BLOCK_M, HD) over keys [0, t_len),
    key t at k_base + t·stride_kt, causal by absolute position (row i sees t ≤ q_pos[i]) → (BLOCK_M, HD) float32.
    Keys past the block's last position are never read. K/V stored narrower than q (bfloat16, or int8 with
    SCALED) are widened to q's dtype a block at a time; the sums stay float32."""
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HD), dtype=tl.float32)
    last = tl.minimum(tl.max(q_pos, axis=0) + 1, t_len)
    for start in range(0, last, BLOCK_N):
        offs_n, in_range, k, v = _kv_block(k_base, stride_kt, v_base, stride_vt, start, t_len, HD, BLOCK_N,
                                           ks_base, vs_base, SCALED)
        k, v = k.to(q.dtype), v.to(q.dtype)
        visible = (offs_n[None, :] <= q_pos[:, None]) & in_range[None, :]
        s = tl.where(visible, _qk(q, k, scale, IEEE, F32_DOT), float("-inf"))  # (BLOCK_M, BLOCK_N)
        m_i, l_i, acc = _fold(s, v, m_i, l_i, acc, IEEE, F32_DOT)
    return acc / l_i[:, None]
