"""A long prompt recomputed in pieces: RAGCACHE_MAX_STEP_ROWS rows a scheduler step, so running
decodes never wait more than one step's budget behind it. Only for fixed row sets (every policy but
cacheblend, whose filter ranks all rows at once): each piece attends to the pieces before it in the
cache, so the pieces add up to one pass."""
from __future__ import annotations

import time

from blend.batch import Rows, forward_batch
from blend.fuse import FusedResult, finish_fused, stage
from blend.runner import Selected


class Piecewise:
    def __init__(self, ticket, prep):
        self.ticket, self.prep = ticket, prep
        self.staged = None  # blend.fuse.Staged, once the first step assembled the cache
        self.done = 0  # rows recomputed so far
        self.start = time.perf_counter()

    @property
    def cache(self):
        return self.staged.cache if self.staged is not None else None

    def step(self, runner, cap: int) -> FusedResult | None:
        """The next `cap` rows; the fused result once the last piece ran, else None."""
        if self.staged is None:
            self.prep.times["admitted"] = self.start
            self.staged = stage(runner, *self.prep.fuse_args())
        rows = self.staged.plan.rows[self.done : self.done + cap]
        out = forward_batch(runner, [Rows(self.staged.cache, self.staged.token_ids[rows], rows)])[0]
        self.done += rows.numel()
        if self.done < self.staged.plan.rows.numel():
            return None
        every = [self.staged.plan.rows] * runner.num_layers  # fixed rows: the same set on every layer
        return finish_fused(runner, self.staged, Selected(out.logits, every, every), time.perf_counter() - self.start)
