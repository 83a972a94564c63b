"""Selection policies on a layout alone: which rows each one recomputes."""
from __future__ import annotations

import pytest
import torch

from blend.runner import Check
from blend.select import CacheBlend, Epic, Full, Layout, Prefix, Reuse

# prefix [0, 10), chunks [10, 30) exact in place, [30, 50), [50, 60); suffix [60, 65)
LAYOUT = Layout(prefix_len=10, spans=[(10, 30), (30, 50), (50, 60)], exact=[True, False, False], total=65)


def test_full_recomputes_everything_after_the_prefix():
    assert Full().plan(LAYOUT, 4).rows.tolist() == list(range(10, 65))


def test_prefix_reuses_only_the_leading_exact_chunk():
    assert Prefix().plan(LAYOUT, 4).rows.tolist() == list(range(30, 65))


def test_reuse_recomputes_the_suffix():
    assert Reuse().plan(LAYOUT, 4).rows.tolist() == list(range(60, 65))


def test_epic_takes_the_first_k_of_each_stale_chunk():
    rows = Epic(k=3).plan(LAYOUT, 4).rows.tolist()
    assert rows == [30, 31, 32, 50, 51, 52, 60, 61, 62, 63, 64]
    assert Epic(k=50).plan(LAYOUT, 4).rows.tolist() == list(range(30, 65))  # k beyond a chunk: all of it


def test_cacheblend_keeps_the_most_deviating_context_rows_and_the_suffix():
    plan = CacheBlend(ratio=0.1, check_layer=1).plan(LAYOUT, 4)
    assert plan.rows.tolist() == list(range(30, 65)) and plan.deviation_layers == {1}
    rows = plan.rows
    dev = torch.zeros(rows.numel())
    dev[rows == 33] = 5.0
    dev[rows == 57] = 9.0
    dev[rows == 41] = 1.0
    dev[rows == 62] = 100.0  # suffix rows never compete: they are always kept
    keep = plan.row_filter(_check(1, rows, torch.zeros_like(dev), dev))
    assert rows[keep].tolist() == [33, 41, 57, 60, 61, 62, 63, 64]  # ceil(0.1 × 30 stale rows) = 3
    by_k = CacheBlend(ratio=0.1, by="k").plan(LAYOUT, 4).row_filter(_check(1, rows, dev, torch.zeros_like(dev)))
    assert rows[by_k].tolist() == [33, 41, 57, 60, 61, 62, 63, 64]


def test_cacheblend_ranks_a_lossy_chunk_by_its_deviation_less_the_stores_rounding_error():
    noise = torch.zeros(4, 2, 20)  # chunk [30, 50) came from a lossy store: (layers, K|V, tokens)
    noise[1, 1, 3] = 6.0  # row 33's V at layer 1 was rounded by ~6 of its measured 7
    lossy = Layout(10, LAYOUT.spans, LAYOUT.exact, 65, noise=(None, noise, None))
    plan = CacheBlend(ratio=0.1).plan(lossy, 4)
    rows = plan.rows
    dev = torch.zeros(rows.numel())
    dev[rows == 33], dev[rows == 41], dev[rows == 44], dev[rows == 57] = 7.0, 3.0, 2.0, 9.0
    keep = plan.row_filter(_check(1, rows, torch.zeros_like(dev), dev))
    assert rows[keep].tolist() == [41, 44, 57, 60, 61, 62, 63, 64]  # 33's 7 is 1 of context's effect: it goes
    by_k = CacheBlend(ratio=0.1, by="k").plan(lossy, 4).row_filter(_check(1, rows, dev, torch.zeros_like(dev)))
    assert rows[by_k].tolist() == [33, 41, 57, 60, 61, 62, 63, 64]  # K's rounding was not in question
    assert lossy.noise_floor(1, 1, rows).sum() == 6.0 and LAYOUT.noise_floor(1, 1, rows) is None


def test_gradual_filtering_shrinks_over_check_layers():
    policy = CacheBlend(ratio=0.2, gradual=3)
    assert policy.ratios() == pytest.approx([0.4, 0.3, 0.2])
    plan = policy.plan(LAYOUT, 8)
    assert plan.deviation_layers == {1, 2, 3}
    assert [plan.row_filter.targets[l] for l in (1, 2, 3)] == [12, 9, 6]


def _check(layer, rows, dev_k, dev_v):
    """A check whose queries and keys no deviation filter reads."""
    return Check(layer, rows, dev_k, dev_v, torch.zeros(rows.numel(), 1, 16), torch.zeros(1, 80, 16), 0.25)
