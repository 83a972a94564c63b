"""Query-aware selection: recompute the context rows the question attends to.

- `Probe` (ProphetKV, arXiv 2602.02579): the question's rows alone run through every layer (or the
  first `layers`: a cheaper probe) against the naively fused cache; each stale context row is
  scored by the attention the question gives it (softmax over the context keys, summed over heads
  and question rows, averaged over layers); the top `ratio` of them, with the first `epic_k` of
  every stale chunk counted in that budget, are recomputed from layer 0 on every layer.
- `Adaptive`: the probe's pass, then a budget per request: the fewest stale rows that leave at most
  1 − `coverage` of the question's whole attention (the prefix's share, where much of it sinks,
  included) on stale rows (at most `max_ratio` of them). A chunk the question ignores gets no rows; a
  question that reads the passages little, or reads a few tokens, gets fewer than one that reads many.
- `A3` (arXiv 2511.17560): CacheBlend's pass (every stale row up to `check_layer`), ranking at the
  check layer by the question's attention there, smoothed over ±`window` neighbours.
- `BlendQ`: the same pass, ranking by the sum of the row's rank in KV deviation and in question
  attention: what either signal alone misses, the other often catches.

Budgets count stale rows, as CacheBlend's do; the suffix is always recomputed on every layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .plan import Layout, Plan
from .runner import Check


def _budget(ratio: float, n: int) -> int:
    return math.ceil(round(ratio * n, 6))


def _check_ratio(name: str, ratio: float) -> None:
    if not 0 <= ratio <= 1:
        raise ValueError(f"{name} ratio must be in [0, 1]")


@dataclass(frozen=True)
class Probe:
    ratio: float = 0.15
    epic_k: int = 0
    layers: int = 0  # probe through the first this many layers; 0: all
    name = "probe"
    reads_chunk_kv = True

    def __post_init__(self):
        _check_ratio(self.name, self.ratio)
        if self.epic_k < 0 or self.layers < 0:
            raise ValueError("probe epic_k and layers must be >= 0")

    def plan(self, layout: Layout, num_layers: int) -> Plan:
        stale = layout.stale_rows().numel()
        heads = sum(min(self.epic_k, b - a) for a, b in layout.stale_spans())
        n = heads + min(max(0, _budget(self.ratio, stale) - heads), stale - heads) + layout.total - layout.suffix_start
        return Plan(layout.suffix(), probe=lambda mass: Plan(self.choose(layout, mass)), probe_layers=self.layers,
                    probe_plans=n)

    def choose(self, layout: Layout, mass: torch.Tensor) -> torch.Tensor:
        """mass (C,) over context rows [prefix_len, suffix_start) → rows (n,) ascending to recompute."""
        stale = layout.stale_rows()
        heads = torch.cat([torch.arange(a, min(a + self.epic_k, b)) for a, b in layout.stale_spans()]
                          + [torch.empty(0, dtype=torch.long)])
        rest = max(0, _budget(self.ratio, stale.numel()) - heads.numel())
        score = torch.full((layout.suffix_start - layout.prefix_len,), -1.0)  # mass ≥ 0: never picked
        score[stale - layout.prefix_len] = mass.float().cpu()[stale - layout.prefix_len]
        score[heads - layout.prefix_len] = -1.0
        top = score.topk(min(rest, stale.numel() - heads.numel())).indices + layout.prefix_len
        return torch.cat([heads, top, layout.suffix()]).sort().values


@dataclass(frozen=True)
class Adaptive:
    coverage: float = 0.8  # at probe@0.05's work and KL on dev 40–49 (the whole probe's sinks make 0.8 few rows)
    layers: int = 0  # the probe runs through the first this many layers; 0: all (4 measured worse at equal work)
    max_ratio: float = 0.5  # never more than this share of the stale rows
    name = "adaptive"
    reads_chunk_kv = True

    def __post_init__(self):
        if not 0 <= self.coverage <= 1:
            raise ValueError("adaptive coverage must be in [0, 1]")
        _check_ratio(self.name, self.max_ratio)
        if self.layers < 0:
            raise ValueError("adaptive layers must be >= 0")

    def plan(self, layout: Layout, num_layers: int) -> Plan:
        stale = layout.stale_rows().numel()
        most = min(_budget(self.max_ratio, stale), stale) + layout.total - layout.suffix_start
        return Plan(layout.suffix(), probe=lambda mass: Plan(self.choose(layout, mass)), probe_layers=self.layers,
                    probe_plans=most, probe_whole=True)  # an upper bound: the plan is known only after the probe

    def choose(self, layout: Layout, mass: torch.Tensor) -> torch.Tensor:
        """mass (suffix_start,): the question's attention on every row before it (the prefix's too, where
        much of it sinks) → rows (n,) ascending to recompute: stale rows by falling mass until what is
        left of theirs is at most 1 − coverage of it all."""
        stale = layout.stale_rows()
        m = mass.float().cpu().clamp(min=0)
        left = m[stale]  # (S,)
        order = left.argsort(descending=True, stable=True)
        after = left.sum() - left[order].cumsum(0)  # (S,) stale mass still uncovered after taking order[:i + 1]
        allowed = (1 - self.coverage) * m.sum()
        if self.coverage == 1:
            n = stale.numel()
        else:  # the first n whose rest fits
            n = 0 if left.sum() <= allowed else int((after > allowed).sum()) + 1
        n = min(n, _budget(self.max_ratio, stale.numel()), stale.numel())
        return torch.cat([stale[order[:n]], layout.suffix()]).sort().values


@dataclass(frozen=True)
class A3:
    ratio: float = 0.15
    check_layer: int = 1
    window: int = 2
    name = "a3"
    reads_chunk_kv = True
    mix = False  # BlendQ: rank by deviation too

    def __post_init__(self):
        _check_ratio(self.name, self.ratio)
        if self.check_layer < 0 or self.window < 0:
            raise ValueError(f"{self.name} check_layer and window must be >= 0")

    def plan(self, layout: Layout, num_layers: int) -> Plan:
        stale = layout.stale_rows()
        layer = min(self.check_layer, num_layers - 1)
        keep = _TopQuestion(layer, _budget(self.ratio, stale.numel()), layout.prefix_len, layout.suffix_start,
                            self.window, self.mix)
        return Plan(torch.cat([stale, layout.suffix()]), frozenset({layer}), keep)


@dataclass(frozen=True)
class BlendQ(A3):
    name = "blendq"
    mix = True


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """x (n,) → (n,) float32: how many entries are smaller (ties share a rank)."""
    return torch.searchsorted(x.sort().values, x).float()


@dataclass(frozen=True)
class _TopQuestion:
    """Row filter at the check layer: keep the `target` context rows the question attends to most
    (optionally rank-summed with V deviation), and the suffix."""

    layer: int
    target: int
    prefix_len: int
    suffix_start: int
    window: int
    mix: bool

    def __call__(self, check: Check) -> torch.Tensor:
        rows = check.rows
        is_context = rows < self.suffix_start
        context = torch.nonzero(is_context).flatten()
        keep_n = min(self.target, context.numel())
        if keep_n == context.numel():
            return torch.arange(rows.numel(), device=rows.device)
        mass = check.question_mass(self.suffix_start, (self.prefix_len, self.suffix_start))  # (C,)
        if self.window:
            w = self.window
            mass = F.avg_pool1d(mass[None, None], 2 * w + 1, 1, w, count_include_pad=False)[0, 0]
        score = mass[rows[context] - self.prefix_len]
        if self.mix:
            score = _ranks(score) + _ranks(check.dev_v[context])
        top = context[score.topk(keep_n).indices]
        return torch.cat([top, torch.nonzero(~is_context).flatten()]).sort().values
