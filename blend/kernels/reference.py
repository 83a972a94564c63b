"""Torch implementations of the blend kernels: the CPU path and the oracle the Triton kernels match."""
from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_BLOCKS = 8  # query blocks in selected attention: skips most of the masked upper triangle


def realign_rope_(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """k (B, n, hd) in place; cos, sin (n, hd/2) float32."""
    half = k.shape[-1] // 2
    k1, k2 = k[..., :half], k[..., half:]
    x1, x2 = k1.float(), k2.float()
    c, s = cos.to(k.device), sin.to(k.device)
    r1 = x1 * c - x2 * s
    r2 = x2 * c + x1 * s
    k1.copy_(r1)
    k2.copy_(r2)


def deviation_scatter_(cache: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """cache (Hkv, capacity, hd); rows (n,); new (n, Hkv, hd) → dev (n,) float32."""
    new_t = new.transpose(0, 1)  # (Hkv, n, hd)
    dev = (new_t.float() - cache[:, rows].float()).square().sum(dim=(0, 2))
    cache[:, rows] = new_t
    return dev


def selected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """q (n, H, hd), q_pos (n,) ascending; k, v (Hkv, T, hd) → (n, H, hd).

    Queries go in up to MAX_BLOCKS blocks by position; each block reads keys only up to its
    last position, so the masked triangle is mostly never computed.
    """
    n = q.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)  # (1, H, n, hd)
    kh, vh = k.unsqueeze(0), v.unsqueeze(0)  # (1, Hkv, T, hd)
    first, last = int(q_pos[0]), int(q_pos[-1])
    if first == 0 and last == n - 1:  # rows 0..n-1 exactly: plain causal attention
        out = F.scaled_dot_product_attention(qh, kh[:, :, :n], vh[:, :, :n], is_causal=True, scale=scale,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)
    outs = []
    positions = q_pos.tolist()
    bounds = torch.linspace(0, n, min(MAX_BLOCKS, n) + 1).long().tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if a == b:
            continue
        end = positions[b - 1] + 1
        mask = None
        if positions[a] < end - 1:  # some row in the block must not see the block's last keys
            mask = torch.arange(end, device=q.device)[None, :] <= q_pos[a:b, None]
        outs.append(F.scaled_dot_product_attention(qh[:, :, a:b], kh[:, :, :end], vh[:, :, :end], attn_mask=mask,
                                                   scale=scale, enable_gqa=True))
    return torch.cat(outs, dim=2)[0].transpose(0, 1)
