"""Fusion correctness gates on the real SmolLM2: exact at 100%, RoPE re-alignment, causality."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from blend import (A3, Adaptive, BlendQ, CacheBlend, Deferred, Epic, Full, Prefix, Probe, Reuse, after_first,
                   compute_chunk, compute_prefix, fuse_and_prefill, make_policy, repair_of)
from blend.decode import Sampling, decode
from blend.fuse import stage
from blend.prompt import as_ids, chat_frame, encode, stop_token_ids
from blend.reweight import Reweight, Reweighted
from blend.rope import delta_cos_sin
from blend import kernels

TOL = 1e-4
DATA = Path(__file__).resolve().parents[2] / "demo" / "data" / "musique_demo.json"


@pytest.fixture(scope="module")
def parts(smol_runner):
    """System prefix, three ~120-token passages, a question suffix (real MuSiQue text)."""
    tok = smol_runner.model.tokenizer
    item = json.loads(DATA.read_text())[0]
    frame = chat_frame(tok, "Answer from the passages.")
    prefix = compute_prefix(smol_runner, as_ids(frame.head))
    texts = [as_ids(encode(tok, c["text"] + "\n\n")[:120]) for c in item["ctxs"][:3]]
    suffix = as_ids(encode(tok, "Question: " + item["question"]) + frame.tail)
    return prefix, texts, suffix


@pytest.fixture(scope="module", params=["alone", "prefixed"])
def chunks(request, smol_runner, parts):
    prefix, texts, _ = parts
    behind = prefix if request.param == "prefixed" else None
    return [compute_chunk(smol_runner, t, behind) for t in texts]


@pytest.fixture(scope="module")
def reference(smol_runner, parts, chunks):
    """Full prefill of the same token ids, and its greedy answer."""
    prefix, _, suffix = parts
    ids = torch.cat([prefix.token_ids, *[c.token_ids for c in chunks], suffix])
    pre = smol_runner.prefill(ids)
    cache = smol_runner.new_cache(ids.numel())
    cache.k[:, :, : ids.numel()], cache.v[:, :, : ids.numel()] = pre.k, pre.v
    cache.length = ids.numel()
    return pre.logits, _answer(smol_runner, cache, pre.logits)


def _answer(runner, cache, logits):
    stops = stop_token_ids(runner.model.tokenizer, runner.model.config)
    return decode(runner, cache, logits, Sampling(max_new_tokens=12), stops)


@pytest.mark.parametrize("policy", [Full(), CacheBlend(ratio=1.0), CacheBlend(ratio=1.0, by="k", gradual=3),
                                    Epic(k=1000), Prefix(), Probe(ratio=1.0), Probe(ratio=1.0, epic_k=8),
                                    Adaptive(coverage=1.0, max_ratio=1.0), A3(ratio=1.0), BlendQ(ratio=1.0)], ids=str)
def test_full_recompute_reproduces_full_prefill(smol_runner, parts, chunks, reference, policy):
    prefix, _, suffix = parts
    res = fuse_and_prefill(smol_runner, prefix, chunks, suffix, policy, headroom=12)
    assert (res.logits - reference[0]).abs().max() <= TOL
    assert _answer(smol_runner, res.cache, res.logits) == reference[1]


@pytest.mark.parametrize("policy", [Deferred(ratio=1.0), Reweighted(Deferred(ratio=1.0), Reweight(1.0, 0.5))], ids=str)
def test_deferred_serves_reuse_first_then_its_full_repair_reproduces_full_prefill(smol_runner, parts, chunks, reference,
                                                                                  policy):
    """The first token is reuse's; the repair over the prompt and that token, at 100%, is full prefill's from there."""
    prefix, _, suffix = parts
    first = fuse_and_prefill(smol_runner, prefix, chunks, suffix, policy, headroom=12)
    reuse = Reweighted(Reuse(), policy.reweight) if isinstance(policy, Reweighted) else Reuse()
    served = fuse_and_prefill(smol_runner, prefix, chunks, suffix, reuse)
    assert torch.equal(first.logits, served.logits)  # the first pass is reuse's (with the same APE)
    answer = reference[1]
    assert len(answer) > 2
    repair = repair_of(policy)
    assert isinstance(getattr(repair, "policy", repair), Probe) and repair_of(Reuse()) is None
    fixed = fuse_and_prefill(smol_runner, prefix, chunks, after_first(suffix, answer[0]), repair, headroom=11)
    whole = smol_runner.prefill(torch.cat([fixed.token_ids[:-1], torch.tensor(answer[:1])]))
    assert (fixed.logits - whole.logits).abs().max() <= TOL
    assert [answer[0], *_answer(smol_runner, fixed.cache, fixed.logits)][: len(answer)] == answer


def test_partial_policies_recompute_what_they_say(smol_runner, parts, chunks):
    prefix, _, suffix = parts
    layout_exact = chunks[0].context != ""  # behind the prefix, the first chunk is exact in place
    stale = sum(len(c) for c in chunks[int(layout_exact):])
    s = suffix.numel()
    reuse = fuse_and_prefill(smol_runner, prefix, chunks, suffix, Reuse())
    assert all(r.numel() == s for r in reuse.kv_rows)
    epic = fuse_and_prefill(smol_runner, prefix, chunks, suffix, Epic(k=4))
    assert epic.kv_rows[0].numel() == 4 * (3 - int(layout_exact)) + s
    blend = fuse_and_prefill(smol_runner, prefix, chunks, suffix, CacheBlend(ratio=0.2))
    rows = blend.recomputed_rows()
    assert sorted(rows) == [0, 2]  # all stale rows through the check layer, then the kept ones
    assert rows[0].numel() == stale + s and rows[2].numel() == -(-stale * 2 // 10) + s
    assert set(range(reuse.layout.suffix_start, reuse.layout.total)) <= set(rows[2].tolist())
    assert rows[2].min() >= len(prefix)  # the prefix is never recomputed
    assert 0 < blend.work_fraction < 0.5 and reuse.work_fraction < blend.work_fraction
    for res in (reuse, epic, blend):
        assert torch.isfinite(res.logits).all()


@pytest.mark.parametrize("policy", [CacheBlend(ratio=0.2, by="k", gradual=3), Epic(k=4),
                                    Reweighted(Probe(ratio=0.1), Reweight(1.0, 0.5))], ids=str)
def test_a_pass_advanced_in_small_budgets_equals_one_pass(smol_runner, parts, chunks, policy):
    """What a scheduler step runs of a long prompt (`Runner.advance`): layer by layer over all rows, so
    cacheblend's filter still ranks every stale row at its check layers, and the bits are one pass's."""
    prefix, _, suffix = parts
    whole = fuse_and_prefill(smol_runner, prefix, chunks, suffix, policy)
    s = stage(smol_runner, prefix, chunks, suffix, policy)
    run = smol_runner.start_selected(s.cache, s.token_ids[s.plan.rows], s.plan.rows,
                                     deviation_layers=s.plan.deviation_layers, row_filter=s.plan.row_filter)
    steps, out = 0, None
    while out is None:
        layer = run.layer
        out = smol_runner.advance(run, budget=1.5 * run.rows.numel())  # one layer a step, two once rows shrink
        assert run.layer > layer
        steps += 1
    assert steps > smol_runner.num_layers // 2
    assert torch.equal(out.logits, whole.logits)
    assert [torch.equal(a, b) for a, b in zip(out.kv_rows, whole.kv_rows)] == [True] * smol_runner.num_layers
    n = whole.layout.total
    assert torch.equal(s.cache.k[:, :, :n], whole.cache.k[:, :, :n]) and torch.equal(s.cache.v[:, :, :n], whole.cache.v[:, :, :n])


def test_single_chunk_at_offset_zero_reused_as_is_is_exact(smol_runner, parts):
    _, texts, suffix = parts
    chunk = compute_chunk(smol_runner, texts[0])
    ref = smol_runner.prefill(torch.cat([texts[0], suffix])).logits
    res = fuse_and_prefill(smol_runner, None, [chunk], suffix, Reuse())
    assert res.layout.exact == [True] and all(r.numel() == suffix.numel() for r in res.kv_rows)
    assert (res.logits - ref).abs().max() <= TOL


def test_chunks_computed_behind_a_lead_passage_are_all_stale_and_recomputed_exactly(smol_runner, parts):
    """RAGCACHE_CHUNK_PREFILL=lead: chunk KV computed behind the prefix and a passage the prompt never holds. No
    chunk is exact where it lands (the first neither: its KV saw the lead), every one is re-rotated back over the
    lead's length, and recomputing every row is still full prefill."""
    prefix, texts, suffix = parts
    tok = smol_runner.model.tokenizer
    other = json.loads(DATA.read_text())[1]["ctxs"][0]["text"]  # another question's passage
    lead = compute_prefix(smol_runner, torch.cat([prefix.token_ids, as_ids(encode(tok, other + "\n\n")[:100])]))
    chunks = [compute_chunk(smol_runner, t, lead) for t in texts]
    assert chunks[0].start == len(lead) > len(prefix) and chunks[0].context == lead.key != prefix.key
    ids = torch.cat([prefix.token_ids, *texts, suffix])
    want = smol_runner.prefill(ids).logits
    for policy in (CacheBlend(ratio=1.0), Probe(ratio=1.0), Epic(k=1000)):
        res = fuse_and_prefill(smol_runner, prefix, chunks, suffix, policy)
        assert not any(res.layout.exact)
        assert (res.logits - want).abs().max() <= TOL
    reuse = fuse_and_prefill(smol_runner, prefix, chunks, suffix, Reuse())
    plain = fuse_and_prefill(smol_runner, prefix, [compute_chunk(smol_runner, t, prefix) for t in texts], suffix,
                             Reuse())
    assert (reuse.logits - want).abs().max() > TOL and (reuse.logits - plain.logits).abs().max() > TOL


@pytest.mark.parametrize("p,d", [(0, 37), (100, 2000), (3000, -1500)])
def test_realigning_k_from_p_by_d_equals_k_computed_at_p_plus_d(smol_runner, parts, p, d):
    ids = parts[1][1][:50]
    at_p = smol_runner.prefill(ids, torch.arange(p, p + 50)).k
    at_pd = smol_runner.prefill(ids, torch.arange(p + d, p + d + 50)).k
    cos, sin = delta_cos_sin(torch.full((50,), d), smol_runner.inv_freq)
    moved = at_p.clone()
    kernels.realign_rope_(moved.flatten(0, 1), cos, sin)
    # transformers' own float32 angles round to one ulp of p·inv_freq (inv_freq ≤ 1): that is the bound
    ulp = lambda x: 2.0 ** (math.floor(math.log2(max(x, 1))) - 23)  # noqa: E731
    bound = ulp(p + 50) + ulp(p + d + 50)
    err = (moved - at_pd).abs().flatten(1).max(1).values / at_pd.abs().flatten(1).max(1).values
    assert err.max() <= bound, (err.max(), bound)
    assert not torch.allclose(at_p, at_pd, atol=1e-2)  # the move was real


def test_a_recomputed_row_never_attends_to_a_later_position(smol_runner, parts, chunks):
    """Poison every row after the last recomputed one: recomputed outputs must not move."""
    prefix, _, suffix = parts
    policy = CacheBlend(ratio=0.3)
    clean = fuse_and_prefill(smol_runner, prefix, chunks, suffix[:-3], policy, headroom=3)
    poisoned = fuse_and_prefill(smol_runner, prefix, chunks, suffix[:-3], policy, headroom=3)
    total = clean.layout.total
    # the first token is the same either way; now recompute 3 rows with poison right after each
    rows = torch.tensor([total - 40, total - 20, total - 1])
    for res, poison in ((clean, False), (poisoned, True)):
        if poison:
            res.cache.k[:, :, total - 19 : total - 1] += 1e3
            res.cache.v[:, :, total - 19 : total - 1] += 1e3
        out = smol_runner.forward_selected(res.cache, res.token_ids[rows], rows, all_logits=True).logits
        res.probe = out
    assert torch.allclose(clean.probe[:2], poisoned.probe[:2], atol=1e-5)
    assert not torch.allclose(clean.probe[2], poisoned.probe[2], atol=1e-2)  # the poison is visible to row total-1


def test_make_policy_names_a_bad_mode():
    assert make_policy("epic", k=8) == Epic(8)
    with pytest.raises(ValueError, match="unknown mode 'turbo'"):
        make_policy("turbo")
    with pytest.raises(ValueError):
        CacheBlend(ratio=1.5)


def test_empty_suffix_is_refused(smol_runner, parts, chunks):
    with pytest.raises(ValueError, match="suffix"):
        fuse_and_prefill(smol_runner, parts[0], chunks, torch.empty(0, dtype=torch.long), Full())


def test_full_needs_no_chunk_kv_and_other_policies_refuse_tokens_only(smol_runner, parts, chunks, reference):
    from blend import tokens_only

    prefix, _, suffix = parts
    bare = [tokens_only(c.token_ids) for c in chunks]
    res = fuse_and_prefill(smol_runner, prefix, bare, suffix, Full())
    assert (res.logits - reference[0]).abs().max() <= TOL
    with pytest.raises(ValueError, match="reads chunk KV"):
        fuse_and_prefill(smol_runner, prefix, bare, suffix, Reuse())


@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16"])
def test_a_lossy_first_chunk_is_never_taken_as_exact(smol_runner, parts, kv_dtype):
    """Behind the prefix at its own offset, a chunk stored lossily is recomputed by prefix and
    cacheblend@1.0, which then still reproduce full prefill."""
    from ragcache.store import decode as decode_kv
    from ragcache.store import encode as encode_kv

    prefix, texts, suffix = parts
    exact = [compute_chunk(smol_runner, t, prefix) for t in texts]
    stored = [decode_kv(encode_kv(c, kv_dtype), torch.float32, smol_runner.device) for c in exact]
    assert not stored[0].is_exact_at(len(prefix), prefix.key) and exact[0].is_exact_at(len(prefix), prefix.key)
    ids = torch.cat([prefix.token_ids, *texts, suffix])
    full = smol_runner.prefill(ids).logits
    for policy in (Prefix(), CacheBlend(ratio=1.0)):
        out = fuse_and_prefill(smol_runner, prefix, stored, suffix, policy)
        assert (out.logits - full).abs().max() < TOL, policy
