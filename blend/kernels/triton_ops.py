"""Triton kernels for the blend hot path, each behind a thin launcher that asserts layout.

Used on CUDA (see `__init__.py`); the tests run them on the CPU with TRITON_INTERPRET=1 and
compare with `reference.py`.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_tiles import _attend_rows, _load_rows, _qk, _store_rows

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _bf16_dot_broken(dtype: torch.dtype) -> bool:
    """Triton's CPU interpreter multiplies bfloat16 as raw integers; upcast there (the products
    of bfloat16 values are exact in float32, so the result is what a GPU's bf16 dot gives)."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


# ---- (a) RoPE re-alignment: k ← R(delta)·src -----------------------------------------------------


@triton.jit
def _realign_kernel(K, SRC, COS, SIN, B, stride_kb, stride_kn, stride_sb, stride_sn,
                    HALF: tl.constexpr, BLOCK_B: tl.constexpr):
    row = tl.program_id(0)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_d = tl.arange(0, HALF)
    mask = offs_b[:, None] < B
    c = tl.load(COS + row * HALF + offs_d)[None, :]
    s = tl.load(SIN + row * HALF + offs_d)[None, :]
    src = SRC + offs_b[:, None] * stride_sb + row * stride_sn + offs_d[None, :]
    x1 = tl.load(src, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask).to(tl.float32)
    dst = K + offs_b[:, None] * stride_kb + row * stride_kn + offs_d[None, :]
    tl.store(dst, (x1 * c - x2 * s).to(K.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(K.dtype.element_ty), mask=mask)


def realign_rope_(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, src: torch.Tensor | None = None) -> None:
    """k, src (B, n, hd) with unit stride on hd; cos, sin (n, hd/2) float32 contiguous."""
    src = k if src is None else src
    assert k.dim() == 3 and src.shape == k.shape, (k.shape, src.shape)
    b, n, hd = k.shape
    assert k.stride(2) == 1 and src.stride(2) == 1, "head_dim must be contiguous"
    assert _pow2(hd // 2) and hd % 2 == 0, f"head_dim {hd}: half must be a power of two"
    assert k.dtype in _FLOATS and src.dtype == k.dtype, (k.dtype, src.dtype)
    assert cos.shape == sin.shape == (n, hd // 2) and cos.dtype == sin.dtype == torch.float32
    assert cos.is_contiguous() and sin.is_contiguous() and cos.device == k.device
    if n == 0 or b == 0:
        return
    block_b = min(32, triton.next_power_of_2(b))
    _realign_kernel[(n, triton.cdiv(b, block_b))](k, src, cos, sin, b, k.stride(0), k.stride(1), src.stride(0),
                                                  src.stride(1), HALF=hd // 2, BLOCK_B=block_b)


# ---- (b) deviation ||new − cached||² fused with the scatter of new rows -------------------------


@triton.jit
def _deviation_scatter_kernel(CACHE, NEW, ROWS, DEV, HKV, stride_ch, stride_ct, stride_nn, stride_nh,
                              HD: tl.constexpr, BLOCK_H: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(ROWS + i)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HD)
    mask = offs_h[:, None] < HKV
    new = tl.load(NEW + i * stride_nn + offs_h[:, None] * stride_nh + offs_d[None, :], mask=mask, other=0.0)
    dst = CACHE + offs_h[:, None] * stride_ch + row * stride_ct + offs_d[None, :]
    old = tl.load(dst, mask=mask, other=0.0)
    diff = new.to(tl.float32) - old.to(tl.float32)
    tl.store(DEV + i, tl.sum(tl.sum(diff * diff, axis=1), axis=0))
    tl.store(dst, new.to(CACHE.dtype.element_ty), mask=mask)


def deviation_scatter_(cache: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """cache (Hkv, capacity, hd); rows (n,) int64 distinct; new (n, Hkv, hd) → dev (n,) float32."""
    assert cache.dim() == 3 and new.dim() == 3, (cache.shape, new.shape)
    hkv, _, hd = cache.shape
    n = rows.shape[0]
    assert new.shape == (n, hkv, hd), (new.shape, (n, hkv, hd))
    assert cache.stride(2) == 1 and new.stride(2) == 1, "head_dim must be contiguous"
    assert _pow2(hd), f"head_dim {hd} must be a power of two"
    assert cache.dtype in _FLOATS and new.dtype == cache.dtype, (cache.dtype, new.dtype)
    assert rows.dtype == torch.int64 and rows.is_contiguous() and rows.device == cache.device
    dev = torch.empty(n, dtype=torch.float32, device=cache.device)
    if n:
        _deviation_scatter_kernel[(n,)](cache, new, rows, dev, hkv, cache.stride(0), cache.stride(1), new.stride(0),
                                        new.stride(1), HD=hd, BLOCK_H=triton.next_power_of_2(hkv))
    return dev


# ---- (c) attention of selected rows, causal by absolute position, grouped-query heads -------------


@triton.jit
def _selected_attention_kernel(Q, K, V, O, QPOS, KS, VS, n, T, scale, stride_qn, stride_qh, stride_kh, stride_kt,
                               stride_vh, stride_vt, stride_on, stride_oh, stride_sh, GROUP: tl.constexpr,
                               HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                               F32_DOT: tl.constexpr, SCALED: tl.constexpr):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid_m = offs_m < n
    q_pos = tl.load(QPOS + offs_m, mask=valid_m, other=0)  # padding rows see key 0 only: no NaN
    q = _load_rows(Q, offs_m, valid_m, head, stride_qn, stride_qh, HD)
    out = _attend_rows(q, q_pos, K + kv_head * stride_kh, stride_kt, V + kv_head * stride_vh, stride_vt, T, scale,
                       HD, BLOCK_M, BLOCK_N, IEEE, F32_DOT, KS + kv_head * stride_sh, VS + kv_head * stride_sh, SCALED)
    _store_rows(O, offs_m, valid_m, head, stride_on, stride_oh, out, HD)


def attention_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None,
                     q_pos: torch.Tensor | None = None, compact: bool = False) -> tuple[int, int, int, int, int]:
    """What every attention launcher asserts: q (n, H, hd), k and v (Hkv, T, hd), H a multiple of Hkv,
    head_dim contiguous and a power of two ≥ 16, one float dtype (`compact`: K/V may be any float or int8),
    q_pos (n,) int64 → (n, H, hd, Hkv, T)."""
    v = k if v is None else v
    assert q.dim() == 3 and k.dim() == 3 and v.shape == k.shape, (q.shape, k.shape, v.shape)
    n, h, hd = q.shape
    hkv, t, _ = k.shape
    assert k.shape[2] == hd and h % hkv == 0, (q.shape, k.shape)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "head_dim must be contiguous"
    assert _pow2(hd) and hd >= 16, f"head_dim {hd} must be a power of two >= 16"
    assert q.dtype in _FLOATS and k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
    assert k.dtype == q.dtype or (compact and k.dtype in (*_FLOATS, torch.int8)), (q.dtype, k.dtype)
    assert q_pos is None or (q_pos.shape == (n,) and q_pos.dtype == torch.int64 and q_pos.is_contiguous())
    return n, h, hd, hkv, t


def selected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                       k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q (n, H, hd), q_pos (n,) int64 ascending; k, v (Hkv, T, hd) in q's dtype, another float, or int8 with
    k_scale, v_scale (Hkv, T) float32 (one per key, unit stride, the same head stride) → (n, H, hd) in q's dtype."""
    n, h, hd, hkv, t = attention_layout(q, k, v, q_pos, compact=True)
    scaled = check_scales(k, k_scale, v_scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if n == 0:
        return out
    block_m = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    grid = (triton.cdiv(n, block_m), h)
    ks, vs = (k_scale, v_scale) if scaled else (k, v)  # unread without SCALED
    _selected_attention_kernel[grid](q, k, v, out, q_pos, ks, vs, n, t, scale, q.stride(0), q.stride(1), k.stride(0),
                                     k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
                                     ks.stride(0) if scaled else 0, GROUP=h // hkv, HD=hd, BLOCK_M=block_m,
                                     BLOCK_N=64, IEEE=q.dtype == torch.float32,
                                     F32_DOT=_bf16_dot_broken(q.dtype), SCALED=scaled)
    return out


def check_scales(k: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> bool:
    """int8 K/V come with (Hkv, T) float32 scales of unit stride along T and one head stride; floats with none."""
    if k.dtype != torch.int8:
        assert k_scale is None and v_scale is None, "float K/V take no scales"
        return False
    assert k_scale is not None and v_scale is not None, "int8 K/V need their scales"
    for s in (k_scale, v_scale):
        assert s.dtype == torch.float32 and s.shape == k.shape[:2] and s.stride(1) == 1, (s.dtype, s.shape, s.stride())
    assert k_scale.stride(0) == v_scale.stride(0), (k_scale.stride(), v_scale.stride())
    return True


# ---- (d) the question's attention mass on each context key (query-aware selection) ----------------


@triton.jit
def _mass_lse_kernel(Q, K, LSE, n, T, scale, stride_qn, stride_qh, stride_kh, stride_kt, GROUP: tl.constexpr,
                     HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                     F32_DOT: tl.constexpr):
    """Pass 1: log-sum-exp over all T keys of each (head, query row)."""
    head = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HD)
    valid_m = offs_m < n
    q = _load_rows(Q, offs_m, valid_m, head, stride_qn, stride_qh, HD)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, T, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = tl.load(K + (head // GROUP) * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :],
                    mask=offs_n[:, None] < T, other=0.0)
        s = tl.where(offs_n[None, :] < T, _qk(q, k, scale, IEEE, F32_DOT), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m_i = m_new
    tl.store(LSE + head * n + offs_m, m_i + tl.log(l_i), mask=valid_m)


@triton.jit
def _mass_sum_kernel(Q, K, LSE, OUT, n, T, scale, stride_qn, stride_qh, stride_kh, stride_kt, GROUP: tl.constexpr,
                     HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                     F32_DOT: tl.constexpr):
    """Pass 2: per block of keys of one K/V head, Σ over its query heads and rows of exp(s − lse)."""
    kv_head = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HD)
    valid_n = offs_n < T
    k = tl.load(K + kv_head * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :], mask=valid_n[:, None],
                other=0.0)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in range(0, GROUP):
        head = kv_head * GROUP + i
        for start in range(0, n, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            valid_m = offs_m < n
            q = _load_rows(Q, offs_m, valid_m, head, stride_qn, stride_qh, HD)
            lse = tl.load(LSE + head * n + offs_m, mask=valid_m, other=float("inf"))
            p = tl.exp(_qk(q, k, scale, IEEE, F32_DOT) - lse[:, None])  # padding rows: exp(-inf) = 0
            acc += tl.sum(p, axis=0)
    tl.store(OUT + kv_head * T + offs_n, acc, mask=valid_n)


def attention_mass(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q (n, H, hd), k (Hkv, T, hd) → (T,) float32: softmax over the T keys, summed over rows and heads."""
    n, h, hd, hkv, t = attention_layout(q, k)
    if n == 0 or t == 0:
        return torch.zeros(t, dtype=torch.float32, device=q.device)
    lse = torch.empty(h, n, dtype=torch.float32, device=q.device)
    partial = torch.empty(hkv, t, dtype=torch.float32, device=q.device)
    block_m = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    flags = dict(GROUP=h // hkv, HD=hd, BLOCK_M=block_m, BLOCK_N=64, IEEE=q.dtype == torch.float32,
                 F32_DOT=_bf16_dot_broken(q.dtype))
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    _mass_lse_kernel[(triton.cdiv(n, block_m), h)](q, k, lse, n, t, scale, *strides, **flags)
    _mass_sum_kernel[(triton.cdiv(t, 64), hkv)](q, k, lse, partial, n, t, scale, *strides, **flags)
    return partial.sum(0)


# ---- (e) int8 → float dequantization of stored KV, one scale per (layer·head, token) -------------


@triton.jit
def _dequantize_int8_kernel(Q, SCALE, OUT, rows, HD: tl.constexpr, BLOCK_R: tl.constexpr):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, HD)
    mask = offs_r[:, None] < rows
    q = tl.load(Q + offs_r[:, None] * HD + offs_d[None, :], mask=mask, other=0)
    s = tl.load(SCALE + offs_r, mask=offs_r < rows, other=0.0)
    out = q.to(tl.float32) * s[:, None]
    tl.store(OUT + offs_r[:, None] * HD + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=mask)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q (B, n, hd) int8 contiguous, scale (B, n) float32 contiguous → (B, n, hd) `dtype`."""
    assert q.dtype == torch.int8 and q.is_contiguous() and q.dim() == 3, (q.dtype, q.shape)
    assert scale.dtype == torch.float32 and scale.is_contiguous() and scale.shape == q.shape[:2]
    assert dtype in _FLOATS and _pow2(q.shape[2]), (dtype, q.shape)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    rows = q.shape[0] * q.shape[1]
    if rows:
        _dequantize_int8_kernel[(triton.cdiv(rows, 64),)](q, scale, out, rows, HD=q.shape[2], BLOCK_R=64)
    return out

