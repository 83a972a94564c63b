"""Rerank by attention on cached chunk KV: how much more the question looks at each candidate than a
question with no content does (in-context reranking, Chen et al. 2024, calibrated by a content-free query).

    scores = attention_scores(runner, prefix, chunks, question_ids, null_ids)   # (B,) float32

Every candidate sits where it was computed (right after the system prefix, or at 0 alone): side by side
rather than one after another, so no candidate gains or loses by its place and no cache is assembled.
The question's rows follow the longest candidate and run through the model's first `hi` layers,
attending to the prefix, every candidate's K/V where it lies, and themselves; at layers [lo, hi) each
candidate's share of the question's attention on the candidates (softmax over all their keys, summed
over heads, averaged over rows) is added up. The content-free question (`null_ids`, e.g.
"Question: N/A") runs beside it in the same pass, each seeing only its own rows; a candidate's score is
the ratio of the two (its lift: 1 when the question looks at it as a question with no content would,
more when it wants what the chunk holds). A pass costs the two questions' rows, not the candidates'.
"""
from __future__ import annotations

import torch

from . import kernels
from .chunk import ChunkKV, PrefixKV
from .rope import delta_cos_sin
from .runner import Runner

LAYERS = (1 / 3, 2 / 3)  # the middle third of the layers, chosen on dev questions 40-49 (BENCHMARKS.md)


def layer_range(num_layers: int, span: tuple[float, float] = LAYERS) -> tuple[int, int]:
    lo = min(int(span[0] * num_layers), num_layers - 1)
    return lo, max(lo + 1, round(span[1] * num_layers))


@torch.inference_mode()
def attention_scores(runner: Runner, prefix: PrefixKV | None, chunks: list[ChunkKV], question_ids: torch.Tensor,
                     null_ids: torch.Tensor, span: tuple[float, float] = LAYERS) -> torch.Tensor:
    """chunks: each computed behind `prefix` (or alone, at 0, with prefix None); question_ids (m,), null_ids
    (u,) → (B,) float32: the question's attention mass on each chunk over the null question's."""
    if not chunks:
        return torch.empty(0)
    start = len(prefix) if prefix is not None else 0
    for c in chunks:
        assert c.k is not None and c.start == start and c.context == (prefix.key if prefix else ""), \
            "every candidate is read at the place and behind the prefix it was computed at"
    lo, hi = layer_range(runner.num_layers, span)
    m, u = question_ids.numel(), null_ids.numel()
    at = start + max(len(c) for c in chunks)  # both questions' first position
    pos = torch.cat([torch.arange(at, at + m), torch.arange(at, at + u)]).to(runner.device)
    runner._check_positions(pos)
    cos, sin = runner.rope(pos)
    own = _own_mask(m, u, runner.device)  # (m + u, m + u): each question causal among its own rows
    x = runner.embed[torch.cat([question_ids, null_ids]).to(runner.device)]  # (m + u, D)
    rotations = [_rotation(c, runner) for c in chunks]
    mass = torch.zeros(2, len(chunks), dtype=torch.float32, device=runner.device)
    for l in range(hi):
        q, k, v = runner._qkv(runner.w, l, x, cos, sin)  # (m + u, H, hd), (m + u, Hkv, hd)
        keys = ([(prefix.k[l], prefix.v[l])] if prefix is not None else []) + \
            [_kv(c, l, r, q.dtype) for c, r in zip(chunks, rotations)]  # each (Hkv, n, hd)
        attn, shares = _attend(q, keys, k.transpose(0, 1), v.transpose(0, 1), own, runner.scale,
                               first=1 if prefix is not None else 0, measure=l >= lo)
        if shares is not None:
            mass[0] += shares[:m].sum(0)
            mass[1] += shares[m:].sum(0)
        if l + 1 < hi:  # the last layer's output feeds nothing
            x = runner._finish(runner.w, l, x, attn)
    lift = (mass[0] / m) / (mass[1] / u).clamp(min=torch.finfo(torch.float32).tiny)  # per row: 1 is a null question's
    return lift.cpu()


def _own_mask(m: int, u: int, device) -> torch.Tensor:
    """(m + u, m + u) bool: row i sees row j of the two questions' own rows when they are of the same one and j ≤ i."""
    which = torch.cat([torch.zeros(m, dtype=torch.long), torch.ones(u, dtype=torch.long)])
    idx = torch.arange(m + u)
    return ((which[:, None] == which[None, :]) & (idx[None, :] <= idx[:, None])).to(device)


def _rotation(chunk: ChunkKV, runner: Runner):
    """A pre-RoPE chunk K (a compact blob's) is rotated to its own positions; post-RoPE K is used as it is."""
    if not chunk.k_pre_rope:
        return None
    return tuple(t.to(runner.device) for t in delta_cos_sin(torch.arange(chunk.start, chunk.start + len(chunk)),
                                                            runner.inv_freq))


def _kv(chunk: ChunkKV, l: int, rotation, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if chunk.ready is not None:
        chunk.ready.wait(l)
    k, v = chunk.k[l].to(dtype), chunk.v[l].to(dtype)  # (Hkv, n, hd)
    if rotation is not None:
        placed = torch.empty_like(k)
        kernels.realign_rope_(placed, *rotation, src=k)
        k = placed
    return k, v


def _attend(q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]], k_own: torch.Tensor, v_own: torch.Tensor,
            own: torch.Tensor, scale: float, first: int, measure: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (r, H, hd) against the segments `keys` (each (Hkv, n, hd)) and the rows' own K/V (Hkv, r, hd) under
    `own` → attention output (r, H, hd), and with `measure` (r, C) float32: each row's softmax over the
    candidates' keys (segments from `first` on) summed per candidate over heads."""
    r, h, hd = q.shape
    hkv = k_own.shape[0]
    g = h // hkv
    qg = (q.float() * scale).view(r, hkv, g, hd).permute(1, 2, 0, 3).reshape(hkv, g * r, hd)  # (Hkv, g·r, hd)
    segments = keys + [(k_own, v_own)]
    sizes = [k.shape[1] for k, _ in segments]
    k_all = torch.cat([k.float() for k, _ in segments], 1)  # (Hkv, N, hd)
    v_all = torch.cat([v.float() for _, v in segments], 1)
    s = torch.bmm(qg, k_all.transpose(1, 2))  # (Hkv, g·r, N)
    s[..., -r:].masked_fill_(~own.repeat(g, 1)[None], float("-inf"))
    p = torch.softmax(s, -1)
    out = torch.bmm(p, v_all).view(hkv, g, r, hd).permute(2, 0, 1, 3).reshape(r, h, hd).to(q.dtype)
    if not measure:
        return out, None
    parts = p.split(sizes, -1)
    cand = torch.stack([pp.sum(-1) for pp in parts[first:-1]], -1)  # (Hkv, g·r, C)
    cand = cand / cand.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return out, cand.view(hkv, g, r, -1).sum((0, 1))
