"""Side-by-side timing helpers: medians of interleaved repeats, so machine drift hits both sides."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run every fn once per round, `repeats` rounds after `warmup`; seconds per fn per round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(warmup + repeats):
        for name, fn in fns.items():
            seconds, _ = timed(fn)
            if r >= warmup:
                times[name].append(seconds)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def table(rows: list[list[object]], header: list[str]) -> str:
    """A Markdown table: what BENCHMARKS.md pastes."""
    cells = [header] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    lines = ["| " + " | ".join(r) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("---" for _ in header) + "|")
    return "\n".join(lines)
