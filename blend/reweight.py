"""APE re-weighting (arXiv 2502.05431) of the context that stays cached.

Chunk KV computed apart from its neighbours is attended to differently than a full prefill's: the
question's attention to it is too flat and its total mass off. At query time, for the question's
and the answer's rows only, the logits to *stale* context keys (chunk rows whose K/V no recompute
refreshed at that layer) are divided by a temperature T, and their group's mass is scaled by a
factor S:

    group weight = S · exp(T · logsumexp(logits / T))    (T = 1, S = 1: plain attention)

Every other key (prefix, recomputed rows, the question itself) keeps its plain logit. Where no
stale key remains at a layer (full prefill, any policy at 100%) the plain attention is returned
untouched, so exact modes stay exact to the bit.

    policy = Reweighted(Probe(0.1), Reweight(temperature=0.9, factor=0.8))
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .plan import Layout, Plan


@dataclass(frozen=True)
class Reweight:
    temperature: float = 1.0
    factor: float = 1.0

    def __post_init__(self):
        if not self.temperature > 0 or not self.factor > 0:
            raise ValueError("ape temperature and factor must be > 0")

    @property
    def active(self) -> bool:
        return self.temperature != 1 or self.factor != 1

    @property
    def label(self) -> str:
        return f"ape@{self.temperature:g},{self.factor:g}"


@dataclass(frozen=True)
class Reweighted:
    """Any policy, its question rows' attention to stale context re-weighted; otherwise the policy
    itself (its name, knobs and plan)."""

    policy: object
    reweight: Reweight

    def plan(self, layout: Layout, num_layers: int) -> Plan:
        return self.policy.plan(layout, num_layers)

    def __getattr__(self, name: str):
        if name == "policy":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.policy, name)


class Stale:
    """Per layer, which context rows of one fused cache hold K/V no recompute refreshed.

    mask (L, C) bool over rows [0, C), C = the suffix's start: rows the question sees whole.
    """

    def __init__(self, reweight: Reweight, layout: Layout, num_layers: int, device: torch.device):
        self.reweight, self.query_from = reweight, layout.suffix_start
        mask = torch.zeros(layout.suffix_start, dtype=torch.bool, device=device)
        mask[layout.stale_rows().to(device)] = True
        self.mask = mask.expand(num_layers, -1).clone()
        self._context_plan = None  # (rows, plan of their context rows): made once per row set, as the runner's

    def attention(self, layer: int, written: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  rows: torch.Tensor, scale: float, plan=None) -> torch.Tensor:
        """One layer's attention of `rows` (n,) ascending over this cache, `written` (m,) the rows whose
        K/V were recomputed there (no longer stale): plain for the context rows, re-weighted for the
        question's (≥ query_from). q (n, H, hd); k, v (Hkv, T, hd) → (n, H, hd). `plan`: the
        rows' `kernels.attention_plan`."""
        self.mask[layer, written[written < self.query_from]] = False
        stale = self.mask[layer]
        ask = int(torch.searchsorted(rows, self.query_from))
        if ask == rows.numel() or not bool(stale.any()):
            return kernels.selected_attention(q, k, v, rows, scale, plan)
        keys = torch.zeros(k.shape[1], dtype=torch.bool, device=k.device)
        keys[: stale.numel()] = stale
        rw = self.reweight
        tail = kernels.reweighted_attention(q[ask:], k, v, rows[ask:], keys, scale, rw.temperature, rw.factor)
        if ask == 0:
            return tail
        if self._context_plan is None or self._context_plan[0] is not rows:
            self._context_plan = rows, kernels.attention_plan(rows[:ask])
        return torch.cat([kernels.selected_attention(q[:ask], k, v, rows[:ask], scale, self._context_plan[1]), tail])
