"""APE re-weighting: the attention formula against a two-group merge done by hand, off == absent to
the bit, exact modes stay exact, and it reaches decode and the batched path."""
from __future__ import annotations

import math

import pytest
import torch

from blend import CacheBlend, Epic, Full, Probe, Reuse, compute_chunk, fuse_and_prefill, kernels
from blend.batch import decode_batch, fuse_batch
from blend.kernels import reference
from blend.reweight import Reweight, Reweighted

APE = Reweight(temperature=0.8, factor=0.6)


def _by_hand(q, k, v, q_pos, stale, scale, temp, factor):
    """Per query row and head: softmax(x/T) over stale keys with mass S·exp(T·LSE(x/T)), plain over the rest."""
    n, h, hd = q.shape
    g = h // k.shape[0]
    out = torch.empty(n, h, hd, dtype=torch.float64)
    for i in range(n):
        seen = torch.arange(k.shape[1]) <= q_pos[i]
        for head in range(h):
            kk, vv = k[head // g].double(), v[head // g].double()
            x = kk @ q[i, head].double() * scale
            cold, warm = stale & seen, ~stale & seen
            w_cold = factor * math.exp(temp * float(torch.logsumexp(x[cold] / temp, 0)))
            w_warm = math.exp(float(torch.logsumexp(x[warm], 0)))
            o_cold = torch.softmax(x[cold] / temp, 0) @ vv[cold]
            o_warm = torch.softmax(x[warm], 0) @ vv[warm]
            out[i, head] = (w_cold * o_cold + w_warm * o_warm) / (w_cold + w_warm)
    return out


def test_reweighted_attention_is_the_two_group_merge():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*s, generator=g) for s in [(5, 6, 16), (2, 40, 16), (2, 40, 16)])  # GQA 3:1
    q_pos = torch.tensor([33, 34, 36, 38, 39])
    stale = torch.zeros(40, dtype=torch.bool)
    stale[4:30] = True
    stale[12] = False  # a recomputed row inside a chunk
    for temp, factor in [(0.8, 0.6), (1.0, 0.5)]:  # the CPU path's two passes, and its one biased pass at T = 1
        by_hand = _by_hand(q, k, v, q_pos, stale, 0.25, temp, factor)
        for fn in (kernels.reweighted_attention, reference.reweighted_attention_dense):  # CPU path, oracle
            assert torch.allclose(fn(q, k, v, q_pos, stale, 0.25, temp, factor).double(), by_hand, atol=1e-5)
    for fn in (kernels.reweighted_attention, reference.reweighted_attention_dense):
        ours = fn(q, k, v, q_pos, stale, 0.25, 0.8, 0.6)
        plain = fn(q, k, v, q_pos, stale, 0.25, 1.0, 1.0)
        assert torch.allclose(plain, kernels.selected_attention(q, k, v, q_pos, 0.25), atol=1e-5)
        assert not torch.allclose(ours, plain, atol=1e-3)


@pytest.fixture(scope="module")
def inputs(smol_runner):
    g = torch.Generator().manual_seed(7)
    chunks = [compute_chunk(smol_runner, torch.randint(10, 40000, (n,), generator=g)) for n in (50, 40, 30)]
    return chunks, torch.randint(10, 40000, (9,), generator=g)


def _steps(runner, res, tokens):
    """Logits (len(tokens), V) of decoding `tokens` one by one after a fused prefill."""
    out = []
    for t in tokens:
        out.append(runner.forward_selected(res.cache, torch.tensor([t]), torch.tensor([res.cache.length])).logits)
    return torch.stack(out)


@pytest.mark.parametrize("policy", [Reuse(), CacheBlend(0.15), Probe(0.1)], ids=str)
def test_ape_off_is_bit_identical_to_no_ape(smol_runner, inputs, policy):
    chunks, suffix = inputs
    plain = fuse_and_prefill(smol_runner, None, chunks, suffix, policy, headroom=3)
    off = fuse_and_prefill(smol_runner, None, chunks, suffix, Reweighted(policy, Reweight(1.0, 1.0)), headroom=3)
    assert off.cache.reweight is None and torch.equal(off.logits, plain.logits)
    assert torch.equal(_steps(smol_runner, off, [11, 12, 13]), _steps(smol_runner, plain, [11, 12, 13]))


@pytest.mark.parametrize("policy", [Full(), CacheBlend(1.0), Probe(1.0)], ids=str)
def test_exact_modes_stay_exact_under_ape(smol_runner, inputs, policy):
    """At 100% no stale key is left on any layer: the plain attention is returned untouched."""
    chunks, suffix = inputs
    plain = fuse_and_prefill(smol_runner, None, chunks, suffix, policy, headroom=3)
    ape = fuse_and_prefill(smol_runner, None, chunks, suffix, Reweighted(policy, APE), headroom=3)
    assert ape.cache.reweight is not None and not ape.cache.reweight.mask.any()
    assert torch.equal(ape.logits, plain.logits)
    assert torch.equal(_steps(smol_runner, ape, [11, 12]), _steps(smol_runner, plain, [11, 12]))


def test_ape_reweights_the_question_and_the_answer_on_stale_keys_only(smol_runner, inputs):
    chunks, suffix = inputs
    plain = fuse_and_prefill(smol_runner, None, chunks, suffix, CacheBlend(0.2), headroom=3)
    ape = fuse_and_prefill(smol_runner, None, chunks, suffix, Reweighted(CacheBlend(0.2), APE), headroom=3)
    mask, layout = ape.cache.reweight.mask, ape.layout
    kept = ape.kv_rows[-1][ape.kv_rows[-1] < layout.suffix_start]
    stale = layout.stale_rows()  # the first chunk sits where it was computed: exact, never stale
    assert mask[0].sum() == 0  # CacheBlend recomputes every stale row up to its check layer
    assert mask[-1].sum() == stale.numel() - kept.numel() and mask[-1, stale].sum() == mask[-1].sum()
    assert not mask[-1, kept].any()
    n = layout.total  # the context rows' own K/V are not re-weighted (up to float order); the question's are
    assert torch.allclose(ape.cache.k[:, :, : layout.suffix_start], plain.cache.k[:, :, : layout.suffix_start],
                          atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ape.cache.k[1:, :, layout.suffix_start : n], plain.cache.k[1:, :, layout.suffix_start : n])
    assert not torch.allclose(ape.logits, plain.logits, atol=1e-3)
    assert not torch.allclose(_steps(smol_runner, ape, [11])[0], _steps(smol_runner, plain, [11])[0], atol=1e-3)


def test_ape_batched_equals_alone(smol_runner, inputs):
    """APE requests (T < 1 and T = 1) beside plain ones in one batch: each as alone, in prefill and decode."""
    chunks, suffix = inputs
    policies = [Reweighted(Reuse(), APE), Epic(4), Reweighted(CacheBlend(0.2), APE),
                Reweighted(Probe(0.2, layers=4), Reweight(1.0, 0.5)), Reuse()]
    requests = [(None, chunks, suffix, p, 2) for p in policies]
    batched = fuse_batch(smol_runner, requests)
    alone = [fuse_and_prefill(smol_runner, *r) for r in requests]
    for got, want in zip(batched, alone):
        assert torch.allclose(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    stepped = decode_batch(smol_runner, [r.cache for r in batched], [11 + i for i in range(len(policies))])
    for i, want in enumerate(alone):
        one = smol_runner.forward_selected(want.cache, torch.tensor([11 + i]), torch.tensor([want.cache.length])).logits
        assert torch.allclose(stepped[i], one, atol=1e-4, rtol=1e-4)


def test_knobs_out_of_range_are_refused():
    with pytest.raises(ValueError, match="temperature and factor"):
        Reweight(temperature=0.0)
    with pytest.raises(ValueError, match="layers"):
        Probe(0.1, layers=-1)
