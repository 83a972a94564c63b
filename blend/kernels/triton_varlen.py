"""Triton varlen attention: the selected rows of several sequences in one launch, each sequence
against its own KV cache (its own tensor, its own length), causal by absolute position.

Caches are separate allocations, so the kernel reaches each through an element offset from the
first one's base pointer (one address space on a device); per sequence its head stride too (a
cache's capacity sets it). Used on CUDA (see `__init__.py`); the tests run it on the CPU with
TRITON_INTERPRET=1 against `reference.varlen_attention`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ops import _FLOATS, _bf16_dot_broken, _pow2, check_scales
from .triton_tiles import _attend_rows, _load_rows, _store_rows


@triton.jit
def _varlen_kernel(Q, K, V, O, QPOS, BLK_SEQ, BLK_START, BLK_END, K_OFF, V_OFF, K_HSTRIDE, V_HSTRIDE, T_LEN,
                   KS, VS, KS_OFF, VS_OFF, S_HSTRIDE, scale, stride_qn, stride_qh, stride_on, stride_oh,
                   GROUP: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   IEEE: tl.constexpr, F32_DOT: tl.constexpr, SCALED: tl.constexpr):
    blk = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(BLK_SEQ + blk)
    row_start = tl.load(BLK_START + blk)
    row_end = tl.load(BLK_END + blk)
    t_len = tl.load(T_LEN + seq)
    k_base = K + tl.load(K_OFF + seq) + kv_head * tl.load(K_HSTRIDE + seq)  # row t at k_base + t·HD
    v_base = V + tl.load(V_OFF + seq) + kv_head * tl.load(V_HSTRIDE + seq)
    offs_m = row_start + tl.arange(0, BLOCK_M)
    valid_m = offs_m < row_end
    q_pos = tl.load(QPOS + offs_m, mask=valid_m, other=0)  # padding rows see key 0 only: no NaN
    q = _load_rows(Q, offs_m, valid_m, head, stride_qn, stride_qh, HD)
    ks_base = KS + tl.load(KS_OFF + seq) + kv_head * tl.load(S_HSTRIDE + seq)  # int8: key t's scale at ks_base + t
    vs_base = VS + tl.load(VS_OFF + seq) + kv_head * tl.load(S_HSTRIDE + seq)
    out = _attend_rows(q, q_pos, k_base, HD, v_base, HD, t_len, scale, HD, BLOCK_M, BLOCK_N, IEEE, F32_DOT,
                       ks_base, vs_base, SCALED)
    _store_rows(O, offs_m, valid_m, head, stride_on, stride_oh, out, HD)


def _offsets(views: list[torch.Tensor], base: torch.Tensor) -> torch.Tensor:
    """Element offset of each view's first element from `base`'s."""
    size = base.element_size()
    return torch.tensor([(t.data_ptr() - base.data_ptr()) // size for t in views], dtype=torch.int64)


def varlen_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], q_pos: torch.Tensor,
                     cu_rows: list[int], scale: float, scales: list[tuple] | None = None) -> torch.Tensor:
    """q (N, H, hd): sequence i's rows are q[cu_rows[i]:cu_rows[i+1]], positions q_pos (N,) ascending
    within each; ks[i], vs[i] (Hkv, T_i, hd) with rows contiguous (hd stride 1, row stride hd) → (N, H, hd).
    K/V in q's dtype, another float, or int8 with scales[i] = (k_scale, v_scale) (Hkv, T_i) float32."""
    n, h, hd = q.shape
    b = len(ks)
    assert len(vs) == b and len(cu_rows) == b + 1 and cu_rows[0] == 0 and cu_rows[-1] == n, (len(ks), cu_rows)
    assert q.dim() == 3 and q.stride(2) == 1 and _pow2(hd) and hd >= 16, (q.shape, q.stride())
    assert q.dtype in _FLOATS and q_pos.shape == (n,) and q_pos.dtype == torch.int64 and q_pos.is_contiguous()
    hkv = ks[0].shape[0]
    assert h % hkv == 0
    for k, v in zip(ks, vs):
        assert k.shape[0] == v.shape[0] == hkv and k.shape[2] == v.shape[2] == hd and k.shape[1] == v.shape[1]
        assert k.dtype == v.dtype == ks[0].dtype and k.device == q.device == v.device
        assert k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == hd, "rows must be contiguous"
    scales = scales or [()] * b
    scaled = [check_scales(k, *sc) for k, sc in zip(ks, scales)][0]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if n == 0:
        return out
    block_m = 16 if max(b - a for a, b in zip(cu_rows, cu_rows[1:])) <= 16 else 64
    seq, start, end = [], [], []  # one program per (block of one sequence's rows, head)
    for i, (a, z) in enumerate(zip(cu_rows, cu_rows[1:])):
        for s in range(a, z, block_m):
            seq.append(i), start.append(s), end.append(min(s + block_m, z))
    dev = q.device
    ints = lambda xs: torch.tensor(xs, dtype=torch.int64).to(dev)  # noqa: E731
    k_sc, v_sc = ([s[0] for s in scales], [s[1] for s in scales]) if scaled else (ks, vs)  # unread without SCALED
    _varlen_kernel[(len(seq), h)](
        q, ks[0], vs[0], out, q_pos, ints(seq), ints(start), ints(end), _offsets(ks, ks[0]).to(dev),
        _offsets(vs, vs[0]).to(dev), ints([k.stride(0) for k in ks]), ints([v.stride(0) for v in vs]),
        ints([k.shape[1] for k in ks]), k_sc[0], v_sc[0], _offsets(k_sc, k_sc[0]).to(dev),
        _offsets(v_sc, v_sc[0]).to(dev), ints([x.stride(0) if scaled else 0 for x in k_sc]), scale, q.stride(0),
        q.stride(1), out.stride(0), out.stride(1), GROUP=h // hkv, HD=hd, BLOCK_M=block_m, BLOCK_N=64,
        IEEE=q.dtype == torch.float32, F32_DOT=_bf16_dot_broken(q.dtype), SCALED=scaled)
    return out
