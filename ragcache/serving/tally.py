"""Serving statistics the scheduler keeps for /metrics: plain counters, no metrics library here."""
from __future__ import annotations

from dataclasses import dataclass, field

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
WAIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60)


class Tally:
    """A histogram: counts per upper bound (the last one +Inf), and the sum of what was observed."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """[(upper bound as Prometheus writes it, observations at or under it)], "+Inf" last."""
        out, total = [], 0
        for bound, n in zip([*map(str, self.bounds), "+Inf"], self.counts):
            total += n
            out.append((bound, total))
        return out


@dataclass
class ServingStats:
    decode_batch: Tally = field(default_factory=lambda: Tally(ROW_BUCKETS))  # sequences per decode step
    prefill_batch: Tally = field(default_factory=lambda: Tally(ROW_BUCKETS))  # requests per batched prefill
    queue_wait: Tally = field(default_factory=lambda: Tally(WAIT_BUCKETS))  # submitted → admitted, seconds
    kv_peak: int = 0  # the most KV budget ever reserved at once
