"""Several sequences through one forward pass: the linear layers run once on all their rows,
attention runs per sequence against its own cache, causal by absolute position.

    outs = forward_batch(runner, [Rows(cache_a, ids_a, rows_a), Rows(cache_b, ids_b, rows_b)])
    logits = decode_batch(runner, [cache_a, cache_b], [token_a, token_b])   # (2, V): one step each

Each sequence gets what `Runner.forward_selected` gives it alone (same rows, same row filter at
its deviation layers), within float tolerance: only the matrix products see more rows.
`fuse_batch` is `fuse_and_prefill` for several requests, their recomputed rows batched.
"""
from __future__ import annotations

import time
from itertools import accumulate
from dataclasses import dataclass

import torch

from . import kernels
from .cache import KVCache
from .fuse import FusedResult, finish_fused, stage
from .linear import Weights
from .runner import Check, RowFilter, Runner, Selected


@dataclass
class Rows:
    """One sequence's part of a batch: recompute `rows` (n,) ascending, tokens `token_ids` (n,)."""

    cache: KVCache
    token_ids: torch.Tensor
    rows: torch.Tensor
    deviation_layers: frozenset[int] = frozenset()
    row_filter: RowFilter | None = None


@torch.inference_mode()
def forward_batch(runner: Runner, items: list[Rows], ws: Weights | None = None,
                  all_logits: bool = False) -> list[Selected]:
    """`runner.forward_selected` of every item, in one pass; each item's logits are its last row's (V,), or with
    `all_logits` every final row's (n, V). `ws`: the matrices to multiply by (default the runner's prefill ones,
    `runner.w`)."""
    ws = ws or runner.w
    dev = runner.device
    rows = [it.rows.to(dev) for it in items]
    spans = [_span(r) for r in rows]  # each item's (first row, last row + 1), kept in step with rows
    for it, r, (_, end) in zip(items, rows, spans):
        runner._check_positions(r[-1:])
        it.cache.reserve(end)
        it.cache.length = max(it.cache.length, end)
    x = runner.embed[torch.cat([it.token_ids for it in items]).to(dev)]  # (N, D), items' rows in order
    cos, sin = (torch.cat(t) for t in zip(*(runner.rope(r) for r in rows)))  # (N, 1, hd) each
    plans = [kernels.attention_plan(r) for r in rows]
    kv_rows: list[list[torch.Tensor]] = [[] for _ in items]
    out_rows: list[list[torch.Tensor]] = [[] for _ in items]
    deviations: list[dict] = [{} for _ in items]
    cu = list(accumulate((r.shape[0] for r in rows), initial=0))  # item i's rows are x[cu[i]:cu[i+1]]
    step = _compact_step(items, rows, cu, x.dtype, ws.on_numba)
    fused = step is not None and ws.stack is not None
    if fused:  # int4 weights over int8 caches: every block in one compiled call
        x = kernels.step_layers(step, ws.stack, x, cos, sin, runner.num_heads, runner.scale, runner.eps)
        kv_rows = [[r] * runner.num_layers for r in rows]  # every layer wrote and kept every row
        out_rows = [list(k) for k in kv_rows]
    for l in range(0 if fused else runner.num_layers):
        q, k, v = runner._qkv(ws, l, x, cos, sin)  # (N, H, hd), (N, Hkv, hd) ×2
        if step is not None:  # int8 caches: every row's K/V written and its attention in one compiled call
            attn = kernels.step_attention(step, l, q, k, v, runner.scale)
            for i in range(len(items)):
                kv_rows[i].append(rows[i])
                out_rows[i].append(rows[i])
            x = runner._finish(ws, l, x, attn)
            continue
        keep: list[torch.Tensor | None] = [None] * len(items)  # the rows a deviation filter kept, where one did
        for i, it in enumerate(items):
            a, b = cu[i], cu[i + 1]
            kv_rows[i].append(rows[i])
            kept = _write(runner, it, l, rows[i], spans[i], q[a:b], k[a:b], v[a:b], deviations[i])
            if kept is not None:
                rows[i] = rows[i][kept]
                plans[i], spans[i], keep[i] = kernels.attention_plan(rows[i]), _span(rows[i]), kept + a
            out_rows[i].append(rows[i])
        if any(kp is not None for kp in keep):
            idx = torch.cat([torch.arange(cu[i], cu[i + 1], device=dev) if kp is None else kp
                             for i, kp in enumerate(keep)])
            x, q, cos, sin = x[idx], q[idx], cos[idx], sin[idx]
            cu = list(accumulate((r.shape[0] for r in rows), initial=0))
        ends = [end for _, end in spans]
        x = runner._finish(ws, l, x, _attention(runner, items, l, q, rows, cu, ends, plans, kv_rows))
    if all_logits:
        logits = runner._logits(ws, x)  # (N', V)
        return [Selected(logits[cu[i] : cu[i + 1]], kv_rows[i], out_rows[i], deviations[i]) for i in range(len(items))]
    last = torch.tensor([c - 1 for c in cu[1:]], device=dev)
    logits = runner._logits(ws, x[last])  # (B, V)
    return [Selected(logits[i], kv_rows[i], out_rows[i], deviations[i]) for i in range(len(items))]


def _compact_step(items: list[Rows], rows: list[torch.Tensor], cu: list[int], dtype: torch.dtype, warm: bool):
    """`kernels.compact_step` when every item is a plain int8 cache (a running sequence's: no deviation layers,
    no re-weighting) under float32 rows, else None. `warm`: the products run on numba's threads."""
    caches = [it.cache for it in items]
    if dtype != torch.float32 or any(c.k_scale is None or c.reweight is not None or c.pending is not None
                                     or it.deviation_layers for c, it in zip(caches, items)):
        return None
    return kernels.compact_step([(c.k, c.v, c.k_scale, c.v_scale) for c in caches], torch.cat(rows), cu, warm)


def _attention(runner: Runner, items: list[Rows], l: int, q: torch.Tensor, rows: list[torch.Tensor], cu: list[int],
               ends: list[int], plans: list, kv_rows: list[list[torch.Tensor]]) -> torch.Tensor:
    """Layer l's attention of every item's rows, q (N', H, hd) → (N', H, hd): one varlen call for the
    plain caches, each APE cache's own re-weighted pass (blend/reweight.py)."""
    attn = torch.empty_like(q)
    plain = [i for i, it in enumerate(items) if it.cache.reweight is None]
    if plain:
        idx = (slice(None) if len(plain) == len(items)
               else torch.cat([torch.arange(cu[i], cu[i + 1], device=q.device) for i in plain]))
        k, v, *scales = zip(*(items[i].cache.layer(l, ends[i]) for i in plain))  # per sequence: K, V (and scales)
        attn[idx] = kernels.varlen_attention(q[idx], list(k), list(v), torch.cat([rows[i] for i in plain]),
                                             list(accumulate((cu[i + 1] - cu[i] for i in plain), initial=0)),
                                             runner.scale, [plans[i] for i in plain], list(zip(*scales)) or None)
    for i, it in enumerate(items):
        if it.cache.reweight is not None:
            a, b = cu[i], cu[i + 1]
            k, v = it.cache.float_layer(l, ends[i], q.dtype)
            attn[a:b] = it.cache.reweight.attention(l, kv_rows[i][-1], q[a:b], k, v, rows[i], runner.scale, plans[i])
    return attn


def _span(rows: torch.Tensor) -> tuple[int, int]:
    """rows (n,) ascending → (first, last + 1)."""
    return int(rows[0]), int(rows[-1]) + 1


def _write(runner: Runner, it: Rows, l: int, rows: torch.Tensor, span: tuple[int, int], q: torch.Tensor,
           k: torch.Tensor, v: torch.Tensor, deviations: dict) -> torch.Tensor | None:
    """Write one item's new K/V (n, Hkv, hd) at layer l; at a deviation layer, the indices its filter keeps
    (None: all rows go on), as `Runner.forward_selected` does. q (n, H, hd): the rows' queries; span:
    `_span(rows)`."""
    ck, cv = it.cache.placed(l)  # (Hkv, capacity, hd)
    if l in it.deviation_layers:  # a fused prefill's: its cache is at the model's dtype
        dev = kernels.deviation_scatter_(ck, rows, k), kernels.deviation_scatter_(cv, rows, v)
        deviations[l] = (rows, *dev)
        keep = it.row_filter(Check(l, rows, *dev, q, ck, runner.scale)) if it.row_filter is not None else None
        return keep if keep is not None and keep.shape[0] != rows.shape[0] else None
    it.cache.write(l, rows, k, v, *span)
    return None


def decode_batch(runner: Runner, caches: list[KVCache], tokens: list[int]) -> torch.Tensor:
    """One decode step of B sequences: token b goes at the end of cache b → next logits (B, V) float32,
    through the runner's decode weights (`RAGCACHE_DECODE_WEIGHTS`)."""
    items = [Rows(c, torch.tensor([t]), torch.tensor([c.length])) for c, t in zip(caches, tokens)]
    return torch.stack([s.logits for s in forward_batch(runner, items, runner.decode_w)])


def warm_decode(runner: Runner, dtype: torch.dtype) -> None:
    """One decode step of a one-token cache kept at `dtype`, through the decode weights: what compiles on a
    step's first use (int4's one-call step, ~6 s) compiles here, not in a request."""
    pre = runner.prefill(torch.tensor([0]))
    cache = KVCache(pre.k, pre.v, 1)
    cache.reserve(2)
    decode_batch(runner, [cache.compact(dtype)], [0])


def fuse_batch(runner: Runner, requests: list[tuple]) -> list[FusedResult]:
    """`fuse_and_prefill(runner, *request)` of each request, their recomputed rows in one batched pass.

    A request is (prefix_kv, chunk_kvs, suffix_ids, policy, headroom). Every result's "recompute"
    timing is the batch's.
    """
    staged = [stage(runner, *r) for r in requests]
    t0 = time.perf_counter()
    outs = forward_batch(runner, [Rows(s.cache, s.token_ids[s.plan.rows], s.plan.rows, s.plan.deviation_layers,
                                       s.plan.row_filter) for s in staged])
    seconds = time.perf_counter() - t0
    return [finish_fused(runner, s, out, seconds) for s, out in zip(staged, outs)]
