"""What the `+f` codec weighs K's error by: the second moment of the queries that will read a stored key,
measured once per model on dev prompts by `ragcache calibrate-codec` (store/feedback.py uses it).

A query q̃ at row m (after RoPE) reads a key stored before RoPE, k, placed at row n < m, through the logit
(R₋ₙ q̃) · k. So H = E[u uᵀ] with u = q̃ turned back by a key position drawn uniformly below its row, per
(layer, K/V head) over the heads that share it. Rows: the question's (from the end of the passages on, the
rows whose logits the answer comes from) and ROWS passage rows drawn at random (the rows a repair
recomputes), each half of H; DISTANCES key positions a row. Each part is scaled to trace 1.
"""
from __future__ import annotations

import torch

from blend import Runner

from ..store.codec import rotate_k

ROWS = 512  # passage rows drawn per prompt
DISTANCES = 32  # key positions drawn per row


def query_moments(runner: Runner, prompts: list[tuple[torch.Tensor, int]], seed: int = 0) -> torch.Tensor:
    """prompts: (ids (n,), where the question starts) each → H (L, Hkv, hd, hd) float64, trace 1 per (layer, head)."""
    L, hkv, hd = runner.num_layers, runner.num_kv_heads, runner.head_dim
    parts = torch.zeros(2, L, hkv, hd, hd, dtype=torch.float64)  # the question's rows, the passages'
    g = torch.Generator().manual_seed(seed)
    for ids, question in prompts:
        n = ids.shape[0]
        picked = [torch.arange(question, n), torch.randint(1, question, (ROWS,), generator=g)]
        rows = torch.cat(picked)
        keys = (torch.rand(rows.numel(), DISTANCES, generator=g) * rows[:, None]).long().flatten()  # (r·D,) < row
        queries = _queries(runner, ids)
        for l in range(L):
            q = queries[l][rows].float().repeat_interleave(DISTANCES, 0)  # (r·D, H, hd) post-RoPE
            u = rotate_k(q.transpose(0, 1)[None].contiguous(), -keys, runner.inv_freq)[0]  # (H, r·D, hd)
            u = u.view(hkv, -1, u.shape[1], hd).double()  # (Hkv, group, r·D, hd)
            for i, sel in enumerate((slice(0, len(picked[0]) * DISTANCES), slice(len(picked[0]) * DISTANCES, None))):
                x = u[:, :, sel].flatten(1, 2)
                parts[i, l] += torch.einsum("hni,hnj->hij", x, x) / max(x.shape[1], 1)
    h = sum(p / torch.diagonal(p, dim1=-2, dim2=-1).sum(-1).clamp_min(1e-30)[..., None, None] for p in parts)
    return h / 2


def _queries(runner: Runner, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every row's queries after RoPE, per layer: (n, H, hd) each, from one full pass over ids (n,)."""
    out: list[torch.Tensor] = []

    def keep(check) -> None:
        out.append(check.q.detach().cpu())

    cache = runner.new_cache(ids.shape[0])
    try:
        runner.forward_selected(cache, ids, torch.arange(ids.shape[0]),
                                deviation_layers=frozenset(range(runner.num_layers)), row_filter=keep)
    finally:
        runner.release(cache)
    return out
