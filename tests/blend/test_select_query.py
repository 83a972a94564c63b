"""Query-aware selection: what each policy picks, the probe's scores against transformers' attention,
and the budget-0 anchors on the real SmolLM2."""
from __future__ import annotations

import pytest
import torch

from blend import A3, Adaptive, BlendQ, CacheBlend, Probe, Reuse, compute_chunk, fuse_and_prefill
from blend.fuse import _probe, layout_of
from blend.model import Model
from blend.runner import Check, Runner
from blend.select import Layout
from tests.conftest import tiny_hf_model

# prefix [0, 10), chunks [10, 30) exact in place, [30, 50), [50, 60); suffix [60, 65)
LAYOUT = Layout(prefix_len=10, spans=[(10, 30), (30, 50), (50, 60)], exact=[True, False, False], total=65)


def test_probe_takes_the_top_mass_of_stale_rows_within_its_budget():
    mass = torch.zeros(50)  # context rows 10..59
    for row, m in [(15, 9.0), (33, 5.0), (57, 4.0), (41, 3.0), (45, 1.0)]:  # row 15 is exact: never picked
        mass[row - 10] = m
    plan = Probe(ratio=0.1).plan(LAYOUT, 4)
    assert plan.rows.tolist() == list(range(60, 65)) and plan.probe is not None  # the probe runs the suffix
    assert plan.probe(mass).rows.tolist() == [33, 41, 57, *range(60, 65)]  # ceil(0.1 × 30 stale rows) = 3
    # EPIC's first 2 of each stale chunk count in the same budget of 6
    assert Probe(ratio=0.2, epic_k=2).choose(LAYOUT, mass).tolist() == [30, 31, 33, 50, 51, 57, *range(60, 65)]
    assert Probe(ratio=0.0).choose(LAYOUT, mass).tolist() == list(range(60, 65))
    for p in (Probe(ratio=0.1), Probe(ratio=0.2, epic_k=2), Probe(ratio=0.0, epic_k=4), Probe(ratio=1.0),
              Probe(ratio=0.5, epic_k=20)):
        plan = p.plan(LAYOUT, 4)  # what a scheduler counts before the probe runs: the rows its plan will take
        assert plan.recompute_rows == plan.probe(mass).rows.numel(), p


def test_adaptive_recomputes_nothing_in_a_chunk_the_question_ignores():
    mass = torch.zeros(60)  # rows 0..59: the question reads the prefix, the exact chunk and [30, 50), never [50, 60)
    mass[2], mass[15] = 6.0, 4.0
    mass[30:50] = torch.linspace(2.0, 0.1, 20)
    rows = Adaptive(coverage=0.99, max_ratio=1.0).choose(LAYOUT, mass)
    picked = rows[rows < 60]
    assert picked.numel() > 0 and bool(((picked >= 30) & (picked < 50)).all())
    assert rows[rows >= 60].tolist() == list(range(60, 65))  # the suffix, always
    elsewhere = torch.zeros(60)
    elsewhere[2], elsewhere[15] = 3.0, 1.0  # all of it on the prefix and the chunk already exact in place
    assert Adaptive(coverage=0.99).choose(LAYOUT, elsewhere).tolist() == list(range(60, 65))


def test_adaptive_budget_grows_with_the_coverage_asked_and_with_what_the_question_reads_of_the_passages():
    mass = torch.rand(60, generator=torch.Generator().manual_seed(3)) ** 4  # a few rows carry most
    mass[:10] = 0.0
    counts = [Adaptive(coverage=c, max_ratio=1.0).choose(LAYOUT, mass).numel() - 5 for c in (0.0, 0.5, 0.8, 0.95, 1.0)]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 30 and counts[1] < counts[3]
    left = mass[30:].sum() - mass[30:].sort(descending=True).values[: counts[2]].sum()
    assert left <= 0.2 * mass.sum() + 1e-6  # what stays stale holds at most 1 − coverage of the attention
    sunk = mass.clone()
    sunk[0] = 4 * mass.sum()  # the same passages' mass, but most of the question's attention sinks into the prefix
    assert Adaptive(coverage=0.8, max_ratio=1.0).choose(LAYOUT, sunk).numel() - 5 < counts[2]
    assert Adaptive(coverage=1.0, max_ratio=0.1).choose(LAYOUT, mass).numel() - 5 == 3  # the cap
    for a in (Adaptive(0.5), Adaptive(0.9, max_ratio=0.2), Adaptive(1.0, max_ratio=1.0)):
        plan = a.plan(LAYOUT, 4)  # what a scheduler counts before the probe runs: at least what it will take
        assert plan.probe_layers == a.layers and plan.probe_whole
        assert plan.recompute_rows >= plan.probe(mass).rows.numel()


def _check_with_mass(rows: torch.Tensor, hot: list[int], dev_v: torch.Tensor) -> Check:
    """One head; suffix queries (rows ≥ 60) align with the keys of rows in `hot` only."""
    q = torch.zeros(rows.numel(), 1, 16)
    q[rows >= 60, 0, 0] = 40.0
    k = torch.zeros(1, 80, 16)
    k[0, hot, 0] = 1.0
    return Check(1, rows, torch.zeros_like(dev_v), dev_v, q, k, 0.25)


def test_a3_keeps_the_rows_the_question_attends_to():
    plan = A3(ratio=0.1, window=0).plan(LAYOUT, 4)
    rows = plan.rows
    assert rows.tolist() == list(range(30, 65)) and plan.deviation_layers == {1}
    check = _check_with_mass(rows, [33, 41, 57, 62], torch.zeros(rows.numel()))
    assert rows[plan.row_filter(check)].tolist() == [33, 41, 57, *range(60, 65)]


def test_a3_smoothing_prefers_a_row_among_attended_neighbours():
    rows = A3().plan(LAYOUT, 4).rows
    check = _check_with_mass(rows, [33, 40, 41, 42, 57], torch.zeros(rows.numel()))
    one = 1 / 30  # a budget of one stale row
    assert rows[A3(ratio=one, window=1).plan(LAYOUT, 4).row_filter(check)].tolist() == [41, *range(60, 65)]


def test_blendq_ranks_by_deviation_and_question_attention_together():
    rows = BlendQ(ratio=0.1).plan(LAYOUT, 4).rows
    dev = torch.zeros(rows.numel())
    dev[rows == 33], dev[rows == 41], dev[rows == 35] = 9.0, 8.0, 7.0  # 33 and 41 win on both counts
    check = _check_with_mass(rows, [33, 41, 57], dev)
    keep = BlendQ(ratio=0.1, window=0).plan(LAYOUT, 4).row_filter(check)
    assert rows[keep].tolist()[:2] == [33, 41] and len(keep) == 3 + 5
    assert rows[keep].tolist()[2] in (35, 57)  # one strong signal each: a tie in rank sum
    a3 = A3(ratio=0.1, window=0).plan(LAYOUT, 4).row_filter(check)
    cb = CacheBlend(ratio=0.1).plan(LAYOUT, 4).row_filter(check)
    assert rows[a3].tolist()[:3] == [33, 41, 57] and rows[cb].tolist()[:3] == [33, 35, 41]


def test_probe_scores_equal_the_attention_transformers_computes():
    """A single chunk at offset 0 is exact, so the fused cache is a full prefill's: the probe's
    per-layer attention of the suffix on the chunk, renormalised over the chunk's keys, must be
    transformers' eager attention probabilities for the same rows."""
    hf = tiny_hf_model("qwen2")  # 6 query heads over 2 K/V heads
    hf.config._attn_implementation = "eager"
    runner = Runner(Model.from_hf(hf, name="qwen2"))
    ids = torch.randint(4, 512, (70,), generator=torch.Generator().manual_seed(0))
    chunk, suffix = ids[:60], ids[60:]
    layout = layout_of(None, [compute_chunk(runner, chunk)], suffix.numel())
    cache = runner.new_cache(70)
    pre = runner.prefill(chunk)
    cache.k[:, :, :60], cache.v[:, :, :60], cache.length = pre.k, pre.v, 70
    ours = _probe(runner, cache, ids, layout, layout.suffix(), runner.num_layers)
    first = _probe(runner, cache, ids, layout, layout.suffix(), 1)  # a probe through layer 0 only
    with torch.inference_mode():
        attn = hf(ids[None], output_attentions=True).attentions  # per layer (1, H, 70, 70)
    per_layer = [a[0, :, 60:, :60] / a[0, :, 60:, :60].sum(-1, keepdim=True) for a in attn]
    expected = sum(p.sum(dim=(0, 1)) for p in per_layer) / len(per_layer)
    assert ours.shape == (60,) and torch.allclose(ours, expected, atol=1e-4)
    assert len(per_layer) > 1 and torch.allclose(first, per_layer[0].sum(dim=(0, 1)), atol=1e-4)


@pytest.fixture(scope="module")
def blend_inputs(smol_runner):
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(10, 40000, (n,), generator=g) for n in (60, 50, 40)]
    chunks = [compute_chunk(smol_runner, c) for c in ids[:3]]
    return chunks, torch.randint(10, 40000, (12,), generator=g)


def test_probe_at_budget_zero_is_reuse(smol_runner, blend_inputs):
    chunks, suffix = blend_inputs
    probe = fuse_and_prefill(smol_runner, None, chunks, suffix, Probe(ratio=0.0))
    reuse = fuse_and_prefill(smol_runner, None, chunks, suffix, Reuse())
    assert torch.equal(probe.logits, reuse.logits) and probe.probe_rows == 12
    assert probe.work_fraction > reuse.work_fraction  # the probe's pass is charged
    short = fuse_and_prefill(smol_runner, None, chunks, suffix, Probe(ratio=0.0, layers=3))
    assert torch.equal(short.logits, reuse.logits) and short.probe_layers == 3
    probe_work = probe.work_fraction - reuse.work_fraction  # a 3-layer probe costs 3/L of a whole one
    assert short.work_fraction - reuse.work_fraction == pytest.approx(probe_work * 3 / smol_runner.num_layers)


@pytest.mark.parametrize("policy", [A3(ratio=0.0), BlendQ(ratio=0.0)], ids=str)
def test_check_layer_policies_at_budget_zero_are_cacheblend_at_zero(smol_runner, blend_inputs, policy):
    """Up to the check layer every stale row is recomputed, as CacheBlend's; after it only the suffix."""
    chunks, suffix = blend_inputs
    ours = fuse_and_prefill(smol_runner, None, chunks, suffix, policy)
    cb = fuse_and_prefill(smol_runner, None, chunks, suffix, CacheBlend(ratio=0.0))
    assert torch.equal(ours.logits, cb.logits) and ours.kv_rows[-1].tolist() == list(range(150, 162))
