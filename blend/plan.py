"""A fused sequence's layout and a policy's plan for it: the types every selection policy shares."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .runner import RowFilter


@dataclass(frozen=True)
class Layout:
    """Where things sit in the fused sequence: prefix [0, P), chunks, suffix [suffix_start, total)."""

    prefix_len: int
    spans: list[tuple[int, int]]  # [start, end) of each chunk
    exact: list[bool]  # chunk KV already equals a full prefill's at its place
    total: int
    noise: tuple = field(default=(), compare=False, repr=False)  # per chunk its ChunkKV.noise (L, 2, n) or None: what a lossy store adds to a deviation

    def noise_floor(self, layer: int, which: int, rows: torch.Tensor) -> torch.Tensor | None:
        """(n,) float32 at `rows`: the expected share of ||new − cached||² that is the store's rounding of K
        (which 0) or V (1) at `layer`, not the context's effect; None when no chunk's store said."""
        if not any(n is not None for n in self.noise):
            return None
        floor = torch.zeros(self.total)
        for (a, b), noise in zip(self.spans, self.noise):
            if noise is not None:
                floor[a:b] = noise[layer, which]
        return floor.to(rows.device)[rows]

    @property
    def suffix_start(self) -> int:
        return self.spans[-1][1] if self.spans else self.prefix_len

    def suffix(self) -> torch.Tensor:
        return torch.arange(self.suffix_start, self.total)

    def stale_spans(self) -> list[tuple[int, int]]:
        return [s for s, ok in zip(self.spans, self.exact) if not ok]

    def stale_rows(self) -> torch.Tensor:
        spans = self.stale_spans()
        return torch.cat([torch.arange(a, b) for a, b in spans]) if spans else torch.empty(0, dtype=torch.long)


@dataclass(frozen=True)
class Plan:
    rows: torch.Tensor  # (n,) ascending: recomputed from layer 0
    deviation_layers: frozenset[int] = frozenset()
    row_filter: RowFilter | None = None
    # set: `rows` are only the probe's (the suffix, run through every layer against the fused cache
    # first); called with the question's attention on each context row (C,) it gives the real plan
    probe: Callable[[torch.Tensor], "Plan"] | None = None
    probe_layers: int = 0  # the probe runs through the first this many layers (0: all)
    probe_plans: int = 0  # with a probe: how many rows its plan will recompute (known before it runs)
    probe_whole: bool = False  # the probe's mass is a share of the question's whole attention (the prefix too), not
    # of the context's alone

    @property
    def recompute_rows(self) -> int:
        """Rows recomputed from layer 0: the probe's plan's when there is a probe (the probe's own are few)."""
        return self.probe_plans if self.probe is not None else self.rows.numel()
