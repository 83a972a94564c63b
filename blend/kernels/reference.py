"""Torch implementations of the blend kernels: the CPU path and the oracle the Triton kernels match."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_BLOCKS = 16  # query blocks in selected attention
CALL_COST = 16384  # one more block's fixed cost, in (query row × key) units of work
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # → (out, logsumexp)


@dataclass
class Block:
    """Query rows [a, b) at positions [start, end): keys [0, start) are all visible to every row
    (no mask); keys [start, end) are the diagonal, causal when the rows are contiguous, else masked."""

    a: int
    b: int
    start: int
    end: int
    mask: torch.Tensor | None  # (b - a, end - start) additive float32, None when causal


def attention_blocks(q_pos: torch.Tensor) -> list[Block]:
    """Split ascending query positions into blocks whose masked diagonals waste least.

    Only a block's diagonal [start, end) is computed with masked-out work: rows × (end − start)
    when its rows are scattered, none when they are contiguous (causal). The split that cuts
    most of that waste is taken first while it saves more than a block costs. Made once per
    row set, not per layer.
    """
    pos = q_pos.cpu().double()
    n = pos.numel()
    spans = [(0, n)]
    while len(spans) < MAX_BLOCKS:
        best = None
        for j, (a, b) in enumerate(spans):
            width = float(pos[b - 1] - pos[a]) + 1
            if b - a < 2 or width == b - a:  # contiguous: causal, nothing to save
                continue
            i = torch.arange(a + 1, b, dtype=torch.float64)  # candidate split points
            cost = (i - a) * (pos[a : b - 1] - pos[a] + 1) + (b - i) * (pos[b - 1] - pos[a + 1 : b] + 1)
            k = int(cost.argmin())
            saving = (b - a) * width - float(cost[k]) - CALL_COST
            if saving > 0 and (best is None or saving > best[0]):
                best = (saving, j, a + 1 + k)
        if best is None:
            break
        _, j, cut = best
        a, b = spans[j]
        spans[j : j + 1] = [(a, cut), (cut, b)]
    blocks = []
    for a, b in spans:
        start, end = int(q_pos[a]), int(q_pos[b - 1]) + 1
        mask = None
        if end - start != b - a:  # scattered rows: mask the keys past each row's position
            keys = torch.arange(start, end, device=q_pos.device)
            mask = torch.zeros(b - a, end - start, device=q_pos.device)
            mask.masked_fill_(keys[None, :] > q_pos[a:b, None], float("-inf"))
        blocks.append(Block(a, b, start, end, mask))
    return blocks


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' LlamaRMSNorm: normalise in float32, scale in the input dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu (n, 2·I), gate then up → silu(gate) · up (n, I)."""
    gate, up = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (n, heads, hd); cos, sin (n, 1, hd) → x rotated to its rows' positions."""
    return x * cos + rotate_half(x) * sin


def split_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int):
    """qkv (n, (H + 2·Hkv)·hd), cos/sin (n, 1, hd) → q (n, H, hd), k (n, Hkv, hd) post-RoPE, v (n, Hkv, hd)."""
    n, hd = qkv.shape[0], cos.shape[-1]
    q, k, v = (t.view(n, -1, hd) for t in qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1))
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def realign_rope_(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, src: torch.Tensor | None = None) -> None:
    """k (B, n, hd) ← R(delta)·src, src defaulting to k itself; cos, sin (n, hd/2) float32."""
    half = k.shape[-1] // 2
    c, s = cos.to(k.device), sin.to(k.device)
    if src is not None and k.dtype == torch.float32:  # rotate straight into place: no temporaries
        x1, x2 = src[..., :half], src[..., half:]
        d1, d2 = k[..., :half], k[..., half:]
        torch.mul(x1, c, out=d1).addcmul_(x2, s, value=-1)
        torch.mul(x2, c, out=d2).addcmul_(x1, s)
        return
    src = k if src is None else src
    x1, x2 = src[..., :half].float(), src[..., half:].float()
    r1 = x1 * c - x2 * s
    r2 = x2 * c + x1 * s
    k[..., :half] = r1
    k[..., half:] = r2


def deviation_scatter_(cache: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """cache (Hkv, capacity, hd); rows (n,); new (n, Hkv, hd) → dev (n,) float32."""
    new_t = new.transpose(0, 1)  # (Hkv, n, hd)
    dev = (new_t.float() - cache[:, rows].float()).square().sum(dim=(0, 2))
    cache[:, rows] = new_t
    return dev


def selected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                       blocks: list[Block] | None = None) -> torch.Tensor:
    """q (n, H, hd), q_pos (n,) ascending; k, v (Hkv, T, hd) → (n, H, hd).

    Per block of queries (`attention_blocks`): the keys every row sees in one unmasked pass,
    the diagonal in a causal or masked pass, merged by their log-sum-exps. Keys past a
    block's last row are never read.
    """
    qh = q.transpose(0, 1).unsqueeze(0)  # (1, H, n, hd)
    kh, vh = k.unsqueeze(0), v.unsqueeze(0)  # (1, Hkv, T, hd)
    outs = []
    for blk in blocks if blocks is not None else attention_blocks(q_pos):
        qb = qh[:, :, blk.a : blk.b]
        mask = None if blk.mask is None else blk.mask.to(q.dtype)
        diag, lse_d = _flash(qb, kh[:, :, blk.start : blk.end], vh[:, :, blk.start : blk.end], 0.0, mask is None,
                             attn_mask=mask, scale=scale)
        if blk.start == 0:
            outs.append(diag)
            continue
        bulk, lse_b = _bulk(qb, kh[:, :, : blk.start], vh[:, :, : blk.start], scale)
        top = torch.maximum(lse_b, lse_d)
        wb, wd = (lse_b - top).exp().unsqueeze(-1), (lse_d - top).exp().unsqueeze(-1)  # (1, H, rows, 1)
        outs.append(((bulk * wb + diag * wd) / (wb + wd)).to(q.dtype))  # the weights are float32
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out[0].transpose(0, 1)


def varlen_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], q_pos: torch.Tensor,
                     cu_rows: list[int], scale: float, plans: list[list[Block] | None] | None = None) -> torch.Tensor:
    """Several sequences' selected rows, each against its own cache: a loop of `selected_attention`.

    q (N, H, hd), sequence i's rows q[cu_rows[i]:cu_rows[i+1]] at q_pos (N,); ks[i], vs[i] (Hkv, T_i, hd).
    """
    outs = [selected_attention(q[a:b], k, v, q_pos[a:b], scale, plans[i] if plans is not None else None)
            for i, (a, b, k, v) in enumerate(zip(cu_rows, cu_rows[1:], ks, vs))]
    return torch.cat(outs)  # (N, H, hd)


def _bulk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention with each K/V head's query heads stacked as rows: K/V are read once
    per K/V head instead of once per query head. q (1, H, m, hd); k, v (1, Hkv, S, hd)."""
    _, h, m, hd = q.shape
    hkv = k.shape[1]
    stacked = q.reshape(1, hkv, (h // hkv) * m, hd)  # query head j·g + i → K/V head j, as GQA maps them
    out, lse = _flash(stacked, k, v, 0.0, False, scale=scale)
    return out.reshape(1, h, m, hd), lse.reshape(1, h, m)


def attention_mass(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q (n, H, hd), k (Hkv, T, hd) → (T,) float32: softmax over the T keys per query row and head,
    summed over rows and heads. Every key is visible to every row (the caller passes keys that all
    precede the queries); query head j·g + i reads K/V head j, as GQA maps them."""
    n, h, hd = q.shape
    hkv = k.shape[0]
    stacked = q.float().permute(1, 0, 2).reshape(hkv, (h // hkv) * n, hd)  # (Hkv, g·n, hd)
    probs = torch.softmax(stacked @ k.float().transpose(1, 2) * scale, dim=-1)  # (Hkv, g·n, T)
    return probs.sum(dim=(0, 1))


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q (B, n, hd) int8, scale (B, n) float32 → (B, n, hd) in `dtype`."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def reweighted_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                         stale: torch.Tensor, scale: float, temperature: float, factor: float) -> torch.Tensor:
    """APE: causal attention whose stale keys form a group with logits ÷ T and mass S·exp(T·lse) (CPU).

    q (n, H, hd) at q_pos (n,), each after every stale key; k, v (Hkv, T, hd); stale (T,) bool → (n, H, hd).
    At T = 1 (float32) the group's mass is a bias of log S on its logits: one flash pass, no gather.
    Otherwise two (the stale keys gathered, then the rest with the causal mask), merged by weight.
    """
    n, h, hd = q.shape
    hkv = k.shape[0]
    g = h // hkv
    stacked = q.permute(1, 0, 2).reshape(1, hkv, g * n, hd)  # query head j·g + i → K/V head j
    if temperature == 1 and q.dtype == torch.float32:
        bias = torch.zeros(g * n, k.shape[1], dtype=q.dtype, device=q.device)  # (g·n, T)
        bias[:, stale] = math.log(factor)
        bias.masked_fill_(torch.arange(k.shape[1], device=q.device)[None, :] > q_pos.repeat(g)[:, None], float("-inf"))
        out, _ = _flash(stacked, k[None], v[None], 0.0, False, attn_mask=bias, scale=scale)
        return out.reshape(h, n, hd).permute(1, 0, 2)
    cold, warm = torch.nonzero(stale).flatten(), torch.nonzero(~stale).flatten()
    out_c, lse_c = _flash(stacked, k[None, :, cold], v[None, :, cold], 0.0, False, scale=scale / temperature)
    future = torch.zeros(g * n, warm.numel(), dtype=q.dtype, device=q.device)
    future.masked_fill_(warm[None, :] > q_pos.repeat(g)[:, None], float("-inf"))  # (g·n, W)
    out_w, lse_w = _flash(stacked, k[None, :, warm], v[None, :, warm], 0.0, False, attn_mask=future, scale=scale)
    lse_c = math.log(factor) + temperature * lse_c.float()  # (1, Hkv, g·n)
    top = torch.maximum(lse_c, lse_w)
    wc, ww = (lse_c - top).exp().unsqueeze(-1), (lse_w - top).exp().unsqueeze(-1)
    out = (out_c * wc + out_w * ww) / (wc + ww)
    return out.reshape(h, n, hd).permute(1, 0, 2).to(q.dtype)


def reweighted_attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                               stale: torch.Tensor, scale: float, temperature: float, factor: float) -> torch.Tensor:
    """`reweighted_attention` with every logit materialised: the oracle of both paths."""
    n, h, hd = q.shape
    hkv, t = k.shape[0], k.shape[1]
    g = h // hkv
    stacked = q.float().permute(1, 0, 2).reshape(hkv, g * n, hd)
    x = stacked @ k.float().transpose(1, 2) * scale  # (Hkv, g·n, T)
    cold = x / temperature
    lse = torch.logsumexp(cold.masked_fill(~stale, float("-inf")), dim=-1, keepdim=True)  # (Hkv, g·n, 1)
    x = torch.where(stale, cold + math.log(factor) + (temperature - 1) * lse, x)
    future = torch.arange(t, device=k.device)[None, :] > q_pos.repeat(g)[:, None]  # (g·n, T)
    probs = torch.softmax(x.masked_fill_(future, float("-inf")), dim=-1)
    return (probs @ v.float()).reshape(h, n, hd).permute(1, 0, 2).to(q.dtype)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per row: x (..., hd) → q (..., hd) int8, scale (...) float32 (amax / 127)."""
    scale = x.abs().amax(-1).float() / 127
    q = torch.round(x.float() / scale.clamp(min=1e-30).unsqueeze(-1)).clamp_(-127, 127)
    return q.to(torch.int8), scale


def widen(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Compact K or V (..., T, hd) (bfloat16, or int8 with scale (..., T)) → `dtype`."""
    return x.to(dtype) if scale is None else dequantize_int8(x, scale, dtype)


COMPACT_BLOCK = 512  # keys widened to float32 at a time: a block of K and V stays in a core's L2


def compact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                      block: int = COMPACT_BLOCK) -> torch.Tensor:
    """`selected_attention` over a compact cache, a block of keys at a time, in float32.

    q (n, H, hd) float at q_pos (n,) ascending; k, v (Hkv, T, hd) bfloat16, or int8 with k_scale,
    v_scale (Hkv, T) → (n, H, hd) in q's dtype. Each block of keys is widened to float32 and attended
    (causal by absolute position) with its log-sum-exp; the blocks merge by weight.
    """
    n, h, hd = q.shape
    hkv = k.shape[0]
    end = min(k.shape[1], int(q_pos[-1]) + 1) if n else 0  # keys past the last row are never read
    stacked = q.float().permute(1, 0, 2).reshape(1, hkv, (h // hkv) * n, hd)  # query head j·g + i → K/V head j
    pos = q_pos.repeat(h // hkv)  # (g·n,) each stacked row's position
    out = torch.zeros_like(stacked)
    lse = torch.full(stacked.shape[:3], float("-inf"), device=q.device)
    for a in range(0, end, block):
        b = min(a + block, end)
        kb = widen(k[:, a:b], None if k_scale is None else k_scale[:, a:b], torch.float32)[None]
        vb = widen(v[:, a:b], None if v_scale is None else v_scale[:, a:b], torch.float32)[None]
        mask = None
        if int(q_pos[0]) < b - 1:  # some row sees only part of this block
            keys = torch.arange(a, b, device=q.device)
            mask = torch.zeros(pos.numel(), b - a, device=q.device).masked_fill_(keys[None] > pos[:, None],
                                                                                   float("-inf"))
        o, l = _flash(stacked, kb, vb, 0.0, False, attn_mask=mask, scale=scale)
        l = l.masked_fill(pos < a, float("-inf"))  # a row that sees none of the block's keys (flash says 0)
        top = torch.maximum(lse, l)
        safe = torch.where(top == float("-inf"), 0.0, top)
        wa, wb = (lse - safe).exp().unsqueeze(-1), (l - safe).exp().unsqueeze(-1)
        out = (out * wa + o * wb) / (wa + wb).clamp(min=1e-30)
        lse = safe + torch.log(wa + wb).squeeze(-1)
    return out.reshape(h, n, hd).permute(1, 0, 2).to(q.dtype)
