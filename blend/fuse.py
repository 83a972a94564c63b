"""Fusion: [exact prefix] + [chunk KVs re-aligned to their new offsets] + [query suffix rows],
then recompute what the policy selects. `fuse_and_prefill` is the whole query-time prefill.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import kernels
from .cache import KVCache
from .chunk import ALONE, ChunkKV, PrefixKV
from .reweight import Stale
from .rope import delta_cos_sin
from .runner import Runner, Selected
from .select import Layout, Plan


@dataclass
class FusedResult:
    logits: torch.Tensor  # (V,) float32: the first generated token's distribution
    cache: KVCache  # the fused per-layer cache, ready for decode
    token_ids: torch.Tensor  # (T,) the whole prompt
    layout: Layout
    kv_rows: list[torch.Tensor]  # per layer: rows whose K/V were recomputed (same tensor while unchanged)
    out_rows: list[torch.Tensor]  # per layer: rows whose attention and MLP ran
    row_work: tuple[int, int]  # multiply-adds per row and layer: (q/k/v, the rest)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage: assemble, recompute
    deviations: dict = field(default_factory=dict)  # check layer → (rows, ||ΔK||², ||ΔV||²): what cacheblend ranked
    probe_rows: int = 0  # rows the query probe ran through `probe_layers` layers before the plan was made
    probe_layers: int = 0

    @property
    def work_fraction(self) -> float:
        """Linear-layer work (the probe's included) over a full prefill's after the prefix; attention not counted."""
        qkv, rest = self.row_work
        done = sum(qkv * kv.numel() + rest * out.numel() for kv, out in zip(self.kv_rows, self.out_rows))
        done += self.probe_layers * self.probe_rows * (qkv + rest)
        full = len(self.kv_rows) * (self.layout.total - self.layout.prefix_len) * (qkv + rest)
        return done / max(full, 1)

    def recomputed_rows(self) -> dict[int, torch.Tensor]:
        """layer → rows whose K/V were recomputed, at layer 0 and wherever the set changes."""
        out, prev = {}, None
        for l, rows in enumerate(self.kv_rows):
            if rows is not prev:
                out[l] = rows
                prev = rows
        return out


def layout_of(prefix: PrefixKV | None, chunks: list[ChunkKV], suffix_len: int) -> Layout:
    prefix_len = offset = len(prefix) if prefix is not None else 0
    before = prefix.key if prefix is not None else ALONE
    spans, exact = [], []
    for i, c in enumerate(chunks):
        spans.append((offset, offset + len(c)))
        exact.append(i == 0 and c.is_exact_at(offset, before))  # only the first can follow exactly its context
        offset += len(c)
    return Layout(prefix_len, spans, exact, offset + suffix_len, tuple(c.noise for c in chunks))


def assemble(runner: Runner, prefix: PrefixKV | None, chunks: list[ChunkKV], layout: Layout,
             needed: list[bool], headroom: int = 0) -> KVCache:
    """A cache with the prefix and every needed chunk's KV at its new offset; suffix rows zeroed.

    Chunk KV is placed a layer at a time. When some chunk's layers are still arriving (`ChunkKV.ready`),
    each layer is placed when the model first reads it (`KVCache.placed`), the same way, so the bits
    do not depend on when the layers came."""
    cache = runner.new_cache(layout.total + headroom)
    if prefix is not None:
        cache.k[:, :, : len(prefix)] = prefix.k
        cache.v[:, :, : len(prefix)] = prefix.v
    placed = []
    for chunk, (a, b), need in zip(chunks, layout.spans, needed):
        if not need:
            continue
        if chunk.k is None:
            raise ValueError("this policy reads chunk KV: pass ChunkKVs with tensors, not tokens_only()")
        rotation = None
        if a != chunk.start or chunk.k_pre_rope:  # RoPE re-alignment by the delta (pre-RoPE K: by the position)
            delta = torch.arange(a, b) if chunk.k_pre_rope else torch.full((b - a,), a - chunk.start, dtype=torch.long)
            rotation = tuple(t.to(runner.device) for t in delta_cos_sin(delta, runner.inv_freq))
        placed.append((chunk, a, b, rotation))
    cache.k[:, :, layout.suffix_start : layout.total] = 0
    cache.v[:, :, layout.suffix_start : layout.total] = 0
    cache.length = layout.total
    arriving = _Arriving(cache, placed)
    if any(chunk.ready is not None for chunk, *_ in placed):
        cache.pending = arriving
    else:
        arriving(runner.num_layers - 1)
    return cache


class _Arriving:
    """Places chunk KV into a cache layer by layer, in order, each layer once every chunk has it."""

    def __init__(self, cache: KVCache, placed: list):
        self.cache, self.placed, self.next = cache, placed, 0

    def __call__(self, layer: int) -> None:
        cache = self.cache
        while self.next <= layer:
            l = self.next
            for chunk, a, b, rotation in self.placed:
                if chunk.ready is not None:
                    chunk.ready.wait(l)
                cache.v[l, :, a:b] = chunk.v[l]
                if rotation is None:
                    cache.k[l, :, a:b] = chunk.k[l]
                else:
                    kernels.realign_rope_(cache.k[l, :, a:b], *rotation, src=chunk.k[l].to(cache.k.device))
            self.next += 1
        if self.next == cache.k.shape[0]:
            cache.pending = None


def _needed(layout: Layout, plan: Plan) -> list[bool]:
    """A chunk's cached KV is needed unless the plan recomputes all its rows on every layer."""
    if plan.row_filter is not None:
        return [True] * len(layout.spans)
    if not layout.spans:
        return []
    spans = torch.tensor(layout.spans)  # (chunks, 2); plan.rows ascending and distinct
    inside = torch.searchsorted(plan.rows.cpu(), spans).diff(dim=1)[:, 0]  # recomputed rows per chunk
    return (inside != spans.diff(dim=1)[:, 0]).tolist()


@dataclass
class Staged:
    """A fused prefill up to its recompute: the cache assembled, the rows to recompute planned."""

    layout: Layout
    plan: Plan
    cache: KVCache
    token_ids: torch.Tensor  # (T,) the whole prompt
    assemble_s: float
    probe_s: float = 0.0  # the query probe, when the policy has one (its plan is made after it)
    probe_rows: int = 0
    probe_layers: int = 0


def stage(runner: Runner, prefix_kv: PrefixKV | None, chunk_kvs: list[ChunkKV], suffix_ids: torch.Tensor, policy,
          headroom: int = 0) -> Staged:
    """Lay out, plan, assemble and (for a query-probe policy) probe: see `fuse_and_prefill`; the
    recompute is left to the caller. A policy with an active `reweight` (APE) marks the cache's
    stale context for the question's attention."""
    if suffix_ids.numel() == 0:
        raise ValueError("the query suffix must hold at least one token")
    t0 = time.perf_counter()
    layout = layout_of(prefix_kv, chunk_kvs, suffix_ids.numel())
    plan = policy.plan(layout, runner.num_layers)
    cache = assemble(runner, prefix_kv, chunk_kvs, layout, _needed(layout, plan), headroom)
    parts = ([prefix_kv.token_ids] if prefix_kv is not None else []) + [c.token_ids for c in chunk_kvs]
    token_ids = torch.cat([*parts, suffix_ids.cpu()])
    t1 = time.perf_counter()
    probe_rows = probe_layers = 0
    if plan.probe is not None:  # the probe's time is the mode's: it counts as recompute
        probe_rows, probe_layers = plan.rows.numel(), min(plan.probe_layers or runner.num_layers, runner.num_layers)
        mass = _probe(runner, cache, token_ids, layout, plan.rows, probe_layers, plan.probe_whole)
        plan = plan.probe(mass)
    reweight = getattr(policy, "reweight", None)
    if reweight is not None and reweight.active:
        cache.reweight = Stale(reweight, layout, runner.num_layers, runner.device)
    return Staged(layout, plan, cache, token_ids, t1 - t0, time.perf_counter() - t1, probe_rows, probe_layers)


def finish_fused(runner: Runner, staged: Staged, out: Selected, recompute_s: float) -> FusedResult:
    return FusedResult(out.logits, staged.cache, staged.token_ids, staged.layout, out.kv_rows, out.out_rows,
                       runner.row_work(), {"assemble": staged.assemble_s, "recompute": staged.probe_s + recompute_s},
                       out.deviations, staged.probe_rows, staged.probe_layers)


def fuse_and_prefill(runner: Runner, prefix_kv: PrefixKV | None, chunk_kvs: list[ChunkKV],
                     suffix_ids: torch.Tensor, policy, headroom: int = 0) -> FusedResult:
    """Prefill [prefix] + chunks + suffix from cached KV, recomputing the rows `policy` selects.

    suffix_ids (S,) must be non-empty: its last row yields the first token's logits.
    `headroom` reserves cache rows for decoding.
    """
    s = stage(runner, prefix_kv, chunk_kvs, suffix_ids, policy, headroom)
    t0 = time.perf_counter()
    out = runner.forward_selected(s.cache, s.token_ids[s.plan.rows], s.plan.rows,
                                  deviation_layers=s.plan.deviation_layers, row_filter=s.plan.row_filter)
    return finish_fused(runner, s, out, time.perf_counter() - t0)


def _probe(runner: Runner, cache: KVCache, token_ids: torch.Tensor, layout: Layout, rows: torch.Tensor,
           layers: int, whole: bool = False) -> torch.Tensor:
    """Run `rows` (the suffix) through the first `layers` layers against the fused cache as it is;
    → (C,) float32: the attention they give each context row (softmax over the context's keys), averaged
    over those layers; `whole`: (suffix_start,), every row before the suffix, softmax over all of them.
    Their K/V land in the cache and are overwritten by the recompute that follows."""
    mass = _MassSum(layout, whole)
    runner.forward_selected(cache, token_ids[rows], rows, deviation_layers=frozenset(range(layers)),
                            row_filter=mass, layers=layers)
    return mass.total / layers


class _MassSum:
    """The probe's row filter: adds up the question's attention on the context at each layer, keeps every row."""

    def __init__(self, layout: Layout, whole: bool):
        self.layout, self.first = layout, 0 if whole else layout.prefix_len  # the first key the softmax spans
        self.total: torch.Tensor | float = 0.0  # (suffix_start - first,) once a layer has run

    def __call__(self, check) -> None:
        self.total = self.total + check.question_mass(self.layout.suffix_start, (self.first, self.layout.suffix_start))
