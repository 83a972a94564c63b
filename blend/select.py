"""Which rows to recompute. Each policy turns a fused layout into a `Plan` for the runner.

In every policy the query suffix is recomputed on every layer and the system prefix never is.
Chunks whose KV is already exact where they sit (`Layout.exact`) are never recomputed either.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .deferred import Deferred
from .plan import Layout, Plan
from .runner import Check
from .select_query import A3, Adaptive, BlendQ, Probe


@dataclass(frozen=True)
class Full:
    """Recompute everything after the exact prefix: the baseline. Reads no chunk KV at all."""

    name = "full"
    reads_chunk_kv = False

    def plan(self, layout: Layout, num_layers: int) -> Plan:
        return Plan(torch.arange(layout.prefix_len, layout.total))


@dataclass(frozen=True)
class Prefix:
    """Reuse only leading chunks that are exact where they sit (what a prefix cache would hit)."""

    name = "prefix"
    reads_chunk_kv = True

    def plan(self, layout: Layout, num_layers: int) -> Plan:
        start = next((a for (a, _), ok in zip(layout.spans, layout.exact) if not ok), layout.suffix_start)
        return Plan(torch.arange(start, layout.total))


@dataclass(frozen=True)
class Reuse:
    """Recompute only the query suffix."""

    name = "reuse"
    reads_chunk_kv = True

    def plan(self, layout: Layout, num_layers: int) -> Plan:
        return Plan(layout.suffix())


@dataclass(frozen=True)
class Epic:
    """EPIC / LegoLink: the first k tokens of every chunk not already exact, plus the suffix."""

    k: int = 16
    name = "epic"
    reads_chunk_kv = True

    def __post_init__(self):
        if self.k < 0:
            raise ValueError("epic k must be >= 0")

    def plan(self, layout: Layout, num_layers: int) -> Plan:
        heads = [torch.arange(a, min(a + self.k, b)) for a, b in layout.stale_spans()]
        return Plan(torch.cat([*heads, layout.suffix()]))


@dataclass(frozen=True)
class CacheBlend:
    """CacheBlend: recompute all stale rows up to `check_layer`, then keep the `ratio` of them whose
    K or V deviates most from the cached value. `gradual` > 1 spreads the cut over that many
    check layers, shrinking linearly from twice the ratio (capped at 1) down to `ratio`.
    """

    ratio: float = 0.15
    check_layer: int = 1
    by: str = "v"  # "k" or "v"
    gradual: int = 1
    name = "cacheblend"
    reads_chunk_kv = True

    def __post_init__(self):
        if not 0 <= self.ratio <= 1:
            raise ValueError("cacheblend ratio must be in [0, 1]")
        if self.by not in ("k", "v"):
            raise ValueError("cacheblend deviation must be measured on 'k' or 'v'")
        if self.check_layer < 0 or self.gradual < 1:
            raise ValueError("cacheblend check_layer must be >= 0 and gradual >= 1")

    def ratios(self) -> list[float]:
        if self.gradual == 1:
            return [self.ratio]
        top = min(1.0, 2 * self.ratio)
        return [top + (self.ratio - top) * i / (self.gradual - 1) for i in range(self.gradual)]

    def plan(self, layout: Layout, num_layers: int) -> Plan:
        stale = layout.stale_rows()
        rows = torch.cat([stale, layout.suffix()])
        last = num_layers - 1
        layers = sorted({min(self.check_layer + i, last) for i in range(self.gradual)})
        targets = {l: math.ceil(round(r * stale.numel(), 6)) for l, r in zip(layers, self.ratios())}
        return Plan(rows, frozenset(targets), _TopDeviation(targets, layout, self.by))


@dataclass(frozen=True)
class _TopDeviation:
    """Row filter: keep the `targets[layer]` context rows of largest deviation, and the suffix. From a lossy
    store a row's measured deviation is the context's effect plus the store's rounding error: the error's
    expected share (`Layout.noise_floor`) is taken off, so rows are ranked by the context's effect."""

    targets: dict[int, int] = field(hash=False)
    layout: Layout = field(hash=False)
    by: str

    def __call__(self, check: Check) -> torch.Tensor:
        rows, dev = check.rows, (check.dev_k if self.by == "k" else check.dev_v).float()
        is_context = rows < self.layout.suffix_start
        n_context = int(is_context.sum())
        keep_n = min(self.targets[check.layer], n_context)
        if keep_n == n_context:
            return torch.arange(rows.numel(), device=rows.device)
        floor = self.layout.noise_floor(check.layer, int(self.by == "v"), rows)
        if floor is not None:
            dev = dev - floor
        context_dev = torch.where(is_context, dev, torch.tensor(-math.inf, device=dev.device))
        top = context_dev.topk(keep_n).indices
        suffix = torch.nonzero(~is_context).flatten()
        return torch.cat([top, suffix]).sort().values


POLICIES = {"full": Full, "prefix": Prefix, "reuse": Reuse, "epic": Epic, "cacheblend": CacheBlend, "probe": Probe,
            "adaptive": Adaptive, "a3": A3, "blendq": BlendQ, "deferred": Deferred}


def make_policy(mode: str, **params):
    """`make_policy("cacheblend", ratio=0.15)`, `make_policy("epic", k=16)`; ValueError names a bad mode."""
    if mode not in POLICIES:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(POLICIES)}")
    return POLICIES[mode](**params)
