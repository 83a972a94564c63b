"""Two rankings → one: reciprocal rank fusion, or a convex mix of min–max normalised scores."""
from __future__ import annotations

RRF_K = 60  # the constant of Cormack et al. (2009), untuned


def rrf(rankings: list[list[tuple[int, float]]], k: int) -> list[tuple[int, float]]:
    """Σ 1 / (RRF_K + rank) over the rankings each id appears in; the top k, best first."""
    score: dict[int, float] = {}
    for ranking in rankings:
        for rank, (i, _) in enumerate(ranking, 1):
            score[i] = score.get(i, 0.0) + 1.0 / (RRF_K + rank)
    return sorted(score.items(), key=lambda t: -t[1])[:k]


def convex(dense: list[tuple[int, float]], lexical: list[tuple[int, float]], alpha: float,
           k: int) -> list[tuple[int, float]]:
    """alpha · dense + (1 − alpha) · lexical, each min–max normalised over its own list (absent: 0)."""
    score: dict[int, float] = {}
    for weight, ranking in ((alpha, dense), (1.0 - alpha, lexical)):
        if not ranking:
            continue
        values = [s for _, s in ranking]
        lo, span = min(values), (max(values) - min(values)) or 1.0
        for i, s in ranking:
            score[i] = score.get(i, 0.0) + weight * (s - lo) / span
    return sorted(score.items(), key=lambda t: -t[1])[:k]
