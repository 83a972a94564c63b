"""A long prompt, or a long repair after a first token (`deferred`), recomputed across scheduler steps, so
running decodes never wait more than one step's budget behind it: the step's row cap (`Admission.step_rows`)
through every layer, in row-layers (at least one layer a step); its pieces take turns with other requests'
prefill batches. The pass runs layer by layer over all its rows, as one `forward_selected` does, so it gives
the same bits, and a row filter (cacheblend) still ranks every row at its check layer."""
from __future__ import annotations

import time

from blend.fuse import FusedResult, finish_fused, stage


class Piecewise:
    def __init__(self, ticket, prep, seq=None):
        """A request's prompt, or with `seq` that sequence's repair after its first token (`deferred`)."""
        self.ticket, self.prep, self.seq = ticket, prep, seq
        self.args = prep.fuse_args() if seq is None else prep.repair_args(seq.token)
        self.staged = None  # blend.fuse.Staged, once the first step assembled the cache
        self.run = None  # blend.runner.Pass: the recompute under way
        self.start = time.perf_counter()
        self.seconds = 0.0  # spent in its own steps' recompute (not in the decode steps between them)

    @property
    def cache(self):
        return self.staged.cache if self.staged is not None else None

    def step(self, runner, cap: int) -> FusedResult | None:
        """The next `cap` × layers row-layers; the fused result once the last layer ran, else None."""
        if self.staged is None:
            if self.seq is None:
                self.prep.times["admitted"] = self.start
            s = self.staged = stage(runner, *self.args)
            self.run = runner.start_selected(s.cache, s.token_ids[s.plan.rows], s.plan.rows,
                                             deviation_layers=s.plan.deviation_layers, row_filter=s.plan.row_filter)
        t0 = time.perf_counter()
        out = runner.advance(self.run, cap * runner.num_layers)
        self.seconds += time.perf_counter() - t0
        if out is None:
            return None
        return finish_fused(runner, self.staged, out, self.seconds)
